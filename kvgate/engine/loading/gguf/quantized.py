"""Which of a GGUF file's weights stay quantized in memory, and how the model gets them.

A module is served quantized when all its matmul weights are of a type the kernels compute
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; `kvgate.engine.models.quantized_linear`): an attention's q, k,
v and output, an MLP's gate, up and down (SwiGLU only), the embedding table (looked up row by
row), an untied lm_head. Fused weights (q/k/v, gate/up) of one type are one product; of mixed
types (a Q4_K_M file's Q6_K v beside Q4_K q and k) a product per run of one type. Every other
tensor (norms, F16, ...) is dequantized at load as before, and its module served by the dense
path. The blocks come straight from the file's memory map into the model, one tensor at a
time: no full-precision copy of a quantized weight is ever made, and the model's dense
parameters for them, allocated but never written, are released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from gguf import GGUFReader

from kvgate.engine.models.llama import MLP, Attention
from kvgate.engine.models.quantized_linear import BLOCKS, QuantizedLinear, StackedLinear, concat

if TYPE_CHECKING:
    from kvgate.engine.models.llama import LlamaForCausalLM
    from kvgate.engine.native import Library

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN = ("ffn_gate", "ffn_up", "ffn_down")


def _names(layer: int, parts: tuple[str, ...]) -> list[str]:
    return [f"blk.{layer}.{part}.weight" for part in parts]


def quantized_tensors(reader: GGUFReader, model: LlamaForCausalLM) -> dict[str, int]:
    """The GGUF tensors to keep as blocks for ``model`` (see the module doc): name -> ggml
    type."""
    types = {t.name: int(t.tensor_type) for t in reader.tensors}
    computed = set(BLOCKS)

    def servable(names: list[str]) -> bool:
        return all(types.get(name) in computed for name in names)

    keep: set[str] = set()
    for i, layer in enumerate(model.layers):
        attention = _names(i, ATTENTION)
        if servable(attention):
            keep.update(attention)
        mlp = _names(i, FFN)
        if isinstance(layer.mlp, MLP) and not layer.mlp.gelu and servable(mlp):
            keep.update(mlp)
    for name in ("token_embd.weight", "output.weight"):
        if types.get(name) in computed:
            keep.add(name)
    return {name: types[name] for name in keep}


def attach(
    model: LlamaForCausalLM,
    blocks: dict[str, torch.Tensor],
    types: dict[str, int],
    kernels: Library,
) -> None:
    """Hand ``blocks`` (by GGUF name, from `load_gguf_weights`; ``types`` from
    `quantized_tensors`) to the modules they belong to and release the dense parameters they
    replace."""
    hidden = model.config.hidden_size

    def linear(names: list[str], in_features: int) -> QuantizedLinear | StackedLinear:
        return concat(
            [QuantizedLinear(blocks.pop(n), types[n], in_features, kernels) for n in names]
        )

    def single(name: str) -> QuantizedLinear:
        return QuantizedLinear(blocks.pop(name), types[name], hidden, kernels)

    for i, layer in enumerate(model.layers):
        attention = _names(i, ATTENTION)
        if attention[0] in blocks:
            attn = layer.attn
            assert isinstance(attn, Attention)
            attn.packed = {
                "qkv": linear(attention[:3], hidden),
                "o": linear(attention[3:], model.config.q_size),
            }
            attn.qkv_weight = attn.o_weight = None
        mlp = _names(i, FFN)
        if mlp[0] in blocks and isinstance(layer.mlp, MLP):
            dense = layer.mlp
            size = model.config.intermediate_size
            dense.packed = {"gate_up": linear(mlp[:2], hidden), "down": linear(mlp[2:], size)}
            dense.gate_up_weight = dense.down_weight = None
    if "token_embd.weight" in blocks:
        model.embed_quantized = single("token_embd.weight")
        model.embed_weight = None
        if model.config.tie_word_embeddings:
            model.lm_head_quantized = model.embed_quantized
    if "output.weight" in blocks:
        model.lm_head_quantized = single("output.weight")
        model.lm_head_weight = None
    if blocks:
        raise RuntimeError(f"quantized GGUF tensors left unplaced: {sorted(blocks)}")
