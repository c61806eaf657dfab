"""A GGUF file's tensors into the engine's parameters, dequantized to the model dtype at load,
or (the tensors named in `keep`) copied as the file's quantized blocks (`kvgate.engine.loading.gguf.quantized`).

The file is memory-mapped (`GGUFReader`) and read one tensor at a time, in slices of at most
`CHUNK_VALUES` values, each dequantized with the `gguf` package's numpy dequantizers and copied
into its slot: the full-precision model is never held twice, and no tensor is ever held whole
in fp32 beyond one slice.

llama.cpp's converter stores a Llama's q/k projection rows interleaved per head (its RoPE pairs
dimensions (2i, 2i+1); Hugging Face's pairs (i, i + d/2)); `unpermute_rows` undoes it, as
transformers' GGUF loader (`LlamaTensorProcessor`) does. Qwen files are stored unpermuted.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.loader import check_all_loaded
from kvgate.engine.models.checkpoint import hf_weight_slots

if TYPE_CHECKING:
    from kvgate.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
SUPPORTED_TYPES = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K
)  # fmt: skip
CHUNK_VALUES = 1 << 22  # values dequantized at once: 16 MiB of fp32
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's precomputed Llama 3 RoPE frequency factors; the engine computes RoPE from the
# config (as transformers' GGUF loader does, which also skips this tensor).
SKIPPED = ("rope_freqs.weight",)


def hf_tensor_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (None: unknown)."""
    base, _, kind = name.rpartition(".")
    if base in TOP_LEVEL:
        return f"{TOP_LEVEL[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in PER_LAYER:
        return f"model.layers.{parts[1]}.{PER_LAYER[parts[2]]}.{kind}"
    return None


def unpermute_rows(rows: np.ndarray[Any, Any], head_dim: int) -> np.ndarray[Any, Any]:
    """Whole heads of q/k rows from llama.cpp's interleaved order back to Hugging Face's."""
    heads = rows.shape[0] // head_dim
    split = rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


def load_gguf_weights(
    model: LlamaForCausalLM,
    reader: GGUFReader,
    unpermute_qk: bool,
    keep: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Fill the model's slots; the GGUF tensors named in ``keep`` are not dequantized but
    returned, by GGUF name, as their blocks (``uint8 [rows, bytes per row]``, q/k rows
    unpermuted), their slots left for `kvgate.engine.loading.gguf.quantized.attach` to release."""
    slots = hf_weight_slots(model)
    kept: dict[str, torch.Tensor] = {}
    head_dim = model.config.head_dim
    seen: set[str] = set()
    for tensor in reader.tensors:
        if tensor.name in SKIPPED:
            log.info("GGUF tensor %s not used: RoPE comes from the config", tensor.name)
            continue
        name = hf_tensor_name(tensor.name)
        slot = slots.get(name) if name is not None else None
        if name is None or slot is None:
            raise ModelLoadError(f"unexpected tensor {tensor.name!r} in the GGUF file")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"unsupported GGUF tensor type {tensor.tensor_type.name} of {tensor.name!r}; "
                f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions inner first
        if shape != slot.shape:
            raise ModelLoadError(
                f"shape mismatch for tensor {tensor.name!r} in the GGUF file: "
                f"expected {list(slot.shape)}, got {list(shape)}"
            )
        permuted = unpermute_qk and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))
        if tensor.name in keep:
            kept[tensor.name] = _blocks(tensor, head_dim if permuted else 0)
        else:
            target = slot.param[slot.start : slot.start + shape[0]]
            _copy_dequantized(tensor, target, head_dim if permuted else 0)
        seen.add(name)
    check_all_loaded(slots, seen, "the GGUF file")
    return kept


def _blocks(tensor: ReaderTensor, head_dim: int) -> torch.Tensor:
    """The tensor's quantized rows copied out of the memory map (one tensor at a time: the
    map's pages are the file's, shared and dropped with the reader)."""
    rows = tensor.data.view(np.ndarray)
    if head_dim:
        rows = unpermute_rows(rows, head_dim)
    return torch.from_numpy(np.array(rows, dtype=np.uint8, order="C", copy=True))


def _copy_dequantized(tensor: ReaderTensor, target: torch.Tensor, head_dim: int) -> None:
    """Dequantize `tensor` slice by slice into `target`; `head_dim` > 0 unpermutes q/k rows
    (slices then hold whole heads)."""
    rows = target.shape[0]
    per_row = max(1, target[0].numel()) if target.dim() > 1 else 1
    step = max(1, CHUNK_VALUES // per_row)
    if head_dim:
        step = max(head_dim, step - step % head_dim)
    data = tensor.data.view(np.ndarray)  # a plain view: numpy's memmap slices cost per call
    with torch.no_grad():
        for start in range(0, rows, step):
            values = dequantize(data[start : start + step], tensor.tensor_type)
            values = values.reshape(-1, *target.shape[1:])
            if head_dim:
                values = unpermute_rows(values, head_dim)
            values = np.require(values, requirements=["C", "W"])  # the memory map is read-only
            target[start : start + step].copy_(torch.from_numpy(values))
