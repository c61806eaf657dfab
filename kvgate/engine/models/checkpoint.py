"""Where each Hugging Face checkpoint tensor lands in the engine's fused parameters.

The engine fuses q/k/v and gate/up into single matmuls and packs MoE experts into one
``[experts, rows, cols]`` tensor per projection; checkpoints store them apart (Llama layout),
already fused (Phi-3), or per expert (Mixtral's ``w1/w2/w3``, Qwen3-MoE's ``experts.j.*``).
Gemma's norms compute ``x * (1 + weight)``: the 1 is added once here, at load time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kvgate.engine.models.moe import SparseMoE
from kvgate.engine.models.params import dense

if TYPE_CHECKING:
    from kvgate.engine.models.llama import MLP, LlamaForCausalLM, RMSNorm


class WeightSlot(NamedTuple):
    """Where one checkpoint tensor lands: rows [start, start + shape[0]) of `param`, plus
    `offset` (Gemma's norms)."""

    param: torch.Tensor
    start: int
    shape: tuple[int, ...]
    offset: float = 0.0


def _whole(weight: torch.Tensor | None, offset: float = 0.0) -> WeightSlot:
    param = dense(weight)  # loading comes before packing
    return WeightSlot(param, 0, tuple(param.shape), offset)


def _rows(weight: torch.Tensor | None, sizes: dict[str, int], names: str) -> dict[str, WeightSlot]:
    """Consecutive row ranges of a fused 2-D `weight`, one per name in `names` (a template
    with ``{}``), in the order of `sizes`."""
    param = dense(weight)
    slots, start = {}, 0
    for part, rows in sizes.items():
        slots[names.format(part)] = WeightSlot(param, start, (rows, *param.shape[1:]))
        start += rows
    return slots


def hf_weight_slots(model: LlamaForCausalLM) -> dict[str, WeightSlot]:
    """Every Hugging Face tensor name ``model`` expects, and where it is stored."""
    if model.lm_head_packed is not None:
        raise RuntimeError("the checkpoint weights were released when they were packed")
    c = model.config
    gemma = c.layout == "gemma"
    norm_offset = c.norm_offset
    slots = {
        "model.embed_tokens.weight": _whole(model.embed_weight),
        "model.norm.weight": _whole(model.norm.weight, norm_offset),
    }
    if not c.tie_word_embeddings:
        slots["lm_head.weight"] = _whole(model.lm_head_weight)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn = layer.attn
        qkv = {"q": c.q_size, "k": c.kv_size, "v": c.kv_size}
        if c.layout == "fused":
            slots[f"{prefix}self_attn.qkv_proj.weight"] = _whole(attn.qkv_weight)
        else:
            slots.update(_rows(attn.qkv_weight, qkv, prefix + "self_attn.{}_proj.weight"))
        if attn.qkv_bias is not None:
            slots.update(_rows(attn.qkv_bias, qkv, prefix + "self_attn.{}_proj.bias"))
        slots[f"{prefix}self_attn.o_proj.weight"] = _whole(attn.o_weight)
        if attn.q_norm is not None and attn.k_norm is not None:
            slots[f"{prefix}self_attn.q_norm.weight"] = _whole(attn.q_norm.weight, norm_offset)
            slots[f"{prefix}self_attn.k_norm.weight"] = _whole(attn.k_norm.weight, norm_offset)
        slots.update(_mlp_slots(c.layout, prefix, layer.mlp))
        norms: dict[str, RMSNorm | None] = {"input_layernorm": layer.input_norm}
        if gemma:
            norms["post_attention_layernorm"] = layer.attn_out_norm
            norms["pre_feedforward_layernorm"] = layer.post_attention_norm
            norms["post_feedforward_layernorm"] = layer.mlp_out_norm
        else:
            norms["post_attention_layernorm"] = layer.post_attention_norm
        for name, norm in norms.items():
            assert norm is not None, name  # the sandwich norms exist where the layout has them
            slots[f"{prefix}{name}.weight"] = _whole(norm.weight, norm_offset)
    return slots


def _mlp_slots(layout: str, prefix: str, mlp: MLP | SparseMoE) -> dict[str, WeightSlot]:
    if isinstance(mlp, SparseMoE):
        return _expert_slots(layout, prefix, mlp)
    if layout == "fused":
        return {
            f"{prefix}mlp.gate_up_proj.weight": _whole(mlp.gate_up_weight),
            f"{prefix}mlp.down_proj.weight": _whole(mlp.down_weight),
        }
    size = dense(mlp.down_weight).shape[1]
    slots = _rows(mlp.gate_up_weight, {"gate": size, "up": size}, prefix + "mlp.{}_proj.weight")
    slots[f"{prefix}mlp.down_proj.weight"] = _whole(mlp.down_weight)
    return slots


def _expert_slots(layout: str, prefix: str, moe: SparseMoE) -> dict[str, WeightSlot]:
    if layout == "mixtral":
        base, names = f"{prefix}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        base, names = f"{prefix}mlp.", ("gate_proj", "up_proj", "down_proj")
    slots = {f"{base}gate.weight": _whole(moe.router_weight)}
    w13, w2 = dense(moe.w13), dense(moe.w2)
    size = w2.shape[2]
    for j in range(w13.shape[0]):
        expert = f"{base}experts.{j}."
        gate_up = {names[0]: size, names[1]: size}
        slots.update(_rows(w13[j], gate_up, expert + "{}.weight"))
        slots[f"{expert}{names[2]}.weight"] = _whole(w2[j])
    return slots
