"""Load a `.gguf` file as the engine's model, tokenizer and identity.

On CPU, with bf16 or fp32 compute and the native kernels built, the Q8_0/Q4_0/Q4_1/Q5_0/
Q5_1/Q4_K/Q5_K/Q6_K weights stay quantized in memory (`quantized`): a decode step reads 4.5-8.5 bits
per weight instead of 16, and the model holds that much less memory. Otherwise
(``dequantize=True``, the server's ``--gguf-dequantize``; another device or dtype; no
kernels) every tensor is dequantized at load to the compute dtype. The file is memory-mapped
and read tensor by tensor (see `tensors`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from gguf import GGUFReader

import kvgate.engine.native as native
from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.gguf.metadata import gguf_architecture, model_config
from kvgate.engine.loading.gguf.quantized import attach, quantized_tensors
from kvgate.engine.loading.gguf.tensors import load_gguf_weights
from kvgate.engine.loading.gguf.vocab import gguf_tokenizer
from kvgate.engine.loading.loader import LoadedModel, bounded_context, resolve_dtype, sampled_digest
from kvgate.engine.memory import return_freed_memory
from kvgate.engine.models.registry import build_model


def load_gguf(
    path: Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    dequantize: bool = False,
) -> LoadedModel:
    """``dequantize``: every weight dequantized at load even where the quantized kernels
    could serve it."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:  # a bad magic or version, a truncated file
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    config = bounded_context(model_config(reader), max_model_len)
    torch_dtype = resolve_dtype(dtype, config)
    tokenizer = gguf_tokenizer(reader)
    model = build_model(config, torch_dtype, device)
    kernels = None
    if not dequantize and torch.device(device).type == "cpu" and torch_dtype != torch.float16:
        kernels = native.library()
    types = quantized_tensors(reader, model) if kernels is not None else {}
    unpermute = gguf_architecture(reader) == "llama"
    blocks = load_gguf_weights(model, reader, unpermute, frozenset(types))
    if kernels is not None:
        attach(model, blocks, types, kernels)
    del reader, blocks  # the memory map and the metadata's objects are no longer needed
    return_freed_memory()  # GGUFReader's metadata objects: ~150 MB for a 49k vocabulary
    model.pack_weights()
    model.eval()
    header = repr(config).encode() + (b"\0quantized" if types else b"")
    identity = sampled_digest(header, [path], torch_dtype)
    return LoadedModel(model, config, tokenizer, identity, path, torch_dtype)
