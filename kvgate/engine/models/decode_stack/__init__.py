"""A decode step's layers in one native call (``kvgate/engine/csrc/kernels/decode_stack.cpp``).

On a small model the Python between a decode layer's ~10 kernel calls costs as much as the
kernels: SmolLM2-135M on a 2-core Zen 4 spent ~2 ms of a 10 ms token in its 30 layers outside
the GEMMs and attention (argument checks, fresh views, the module calls). The stack calls the
same kernels (our GEMM or the GGUF blocks' `qgemm`, `cpu_ops`' norm, RoPE and K/V write, the
paged decode attention) back to back from C++, calling them directly (one library), with the
GIL released: the Python path's results, bit for bit, at a fraction of its overhead.

It serves the steps where that path would run exactly those kernels (and, for Qwen3's
per-head q/k norms, the same ATen ops): every row a decode (one query, all wanted), no
adapter in the step, a model without sandwich norms, experts or partial rotary, a bf16/fp32
cache of the model's dtype on the native decode kernel, every matmul on our kernels.
Anything else runs the layers in Python, as does ``KVGATE_DECODE_STACK=0`` (how
`benchmarks/` compare the two).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

import kvgate.engine.models.gemm as gemm
import kvgate.engine.models.quantized_linear as quantized_linear
import kvgate.engine.native as native
from kvgate.engine.attention.cpu import NativeDecode
from kvgate.engine.attention.kv_cache import KVCache
from kvgate.engine.attention.metadata import AttentionMetadata
from kvgate.engine.models.moe import SparseMoE

if TYPE_CHECKING:
    from kvgate.engine.attention.backend import AttentionBackend
    from kvgate.engine.models.llama import LlamaForCausalLM

DISABLE_ENV = "KVGATE_DECODE_STACK"
_ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2}


def enabled() -> bool:
    return native.switched_on(DISABLE_ENV)


class DecodeStack:
    """A model's layers over its caches for the steps whose rows are all decodes."""

    def __init__(self, stack: Any, max_rows: int | None):
        self._stack = stack
        self.max_rows = max_rows

    def serves(self, x: torch.Tensor) -> bool:
        """Whether a decode step of ``x``'s rows is one the stack computes as the Python layers
        would (quantized weights take a dense path from `quantized_linear.DENSE_ROWS` rows)."""
        return self.max_rows is None or x.shape[0] <= self.max_rows

    def run(
        self,
        x: torch.Tensor,
        tables: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The last layer's output of the step's rows ``x``; every layer's K/V written.
        ``tables``: each RoPE table's (cos, sin) rows ``[T, 1, D]`` of the step's positions."""
        return self._stack.run(  # type: ignore[no-any-return]
            x.contiguous(),
            [cos[:, 0].contiguous() for cos, _ in tables],
            [sin[:, 0].contiguous() for _, sin in tables],
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
        )


def build(
    model: LlamaForCausalLM, kv_caches: list[KVCache], backend: AttentionBackend
) -> DecodeStack | None:
    """The stack of ``model``'s layers over ``kv_caches``, or None where some part of a decode
    layer is not one of the kernels it calls (then the Python layers serve every step)."""
    config = model.config
    decode_kernel = backend.decode_kernel
    if (
        not enabled()
        or not isinstance(decode_kernel, NativeDecode)
        or config.rotary_dim not in (0, config.head_dim)  # partial rotary: the torch RoPE
        or config.sandwich_norms
        or config.hidden_act not in _ACTIVATIONS
        or any(config.is_moe_layer(i) for i in range(config.num_layers))
    ):
        return None
    dtype = model.norm.weight.dtype
    probe = torch.empty(1, 1, config.head_dim, dtype=dtype)
    if not all(
        cache.k_scale is None
        and cache.k.dtype == dtype
        and cache.k.is_contiguous()
        and cache.v.is_contiguous()
        and decode_kernel.takes(probe, cache)
        for cache in kv_caches
    ):
        return None
    ops = native.library()
    if ops is None:
        return None
    classes = ops.classes
    act = _ACTIVATIONS[config.hidden_act]
    layers, quantized = [], False
    for i, (layer, cache) in enumerate(zip(model.layers, kv_caches, strict=True)):
        assert not isinstance(layer.mlp, SparseMoE)  # no MoE layer (checked above)
        weights = {**layer.attn.packed, **layer.mlp.packed}
        linears = {name: _linear(classes, weight, act) for name, weight in weights.items()}
        if len(linears) != 4 or any(linear is None for linear in linears.values()):
            return None
        quantized |= any(isinstance(w, quantized_linear.QuantizedLinear) for w in weights.values())
        layers.append(
            classes.Layer(
                layer.input_norm.weight,
                layer.post_attention_norm.weight,
                linears["qkv"],
                layer.attn.qkv_bias,
                *_head_norms(layer.attn),
                linears["o"],
                linears["gate_up"],
                linears["down"],
                act,
                cache.k,
                cache.v,
                model.layer_rope[i],
                config.window(i) or 0,
                config.attn_softcap or 0.0,
            )  # fmt: skip
        )
    stack = classes.DecodeStack(
        layers, config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
        config.scale,
    )  # fmt: skip
    max_rows = quantized_linear.DENSE_ROWS - 1 if quantized else None
    return DecodeStack(stack, max_rows)


def _head_norms(attention: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The per-head q and k norms' weights (Qwen3), or none."""
    if attention.q_norm is None:
        return None, None
    return attention.q_norm.weight, attention.k_norm.weight


def _linear(classes: Any, weight: gemm.LinearWeight, act: int) -> Any:
    """``weight`` as the stack's `Linear`, or None where its kernel is not one the stack calls."""
    if isinstance(weight, gemm.NativeLinear):
        return classes.Linear(weight.packed, weight.n, weight.half, -1)
    if isinstance(weight, quantized_linear.QuantizedLinear) and act == _ACTIVATIONS["silu"]:
        return classes.Linear(weight.blocks, 0, 0, weight.layout)
    return None
