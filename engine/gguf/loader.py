"""Load a `.gguf` file as the engine's model, tokenizer and identity.

There is no quantized matmul in the engine yet, so every tensor is dequantized at load to the
compute dtype: that is the one GGUF path today (a flag to choose it comes with the quantized
kernel). The file is memory-mapped and converted tensor by tensor (see `tensors`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGUFReader

from engine.gguf.metadata import gguf_architecture, model_config
from engine.gguf.tensors import load_gguf_weights
from engine.gguf.vocab import gguf_tokenizer
from engine.loader import LoadedModel, bounded_context, resolve_dtype, sampled_digest
from engine.model_config import ModelLoadError
from engine.models.registry import model_class


def load_gguf(
    path: Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
) -> LoadedModel:
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:  # a bad magic or version, a truncated file
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    config = bounded_context(model_config(reader), max_model_len)
    torch_dtype = resolve_dtype(dtype, config)
    tokenizer = gguf_tokenizer(reader)
    model = model_class(config.architecture)(config, torch_dtype, device)
    load_gguf_weights(model, reader, unpermute_qk=gguf_architecture(reader) == "llama")
    model.pack_weights()
    model.eval()
    identity = sampled_digest(repr(config).encode(), [path], torch_dtype)
    return LoadedModel(model, config, tokenizer, identity, path, torch_dtype)
