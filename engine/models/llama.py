"""One Llama-family decoder (Llama with GQA, Mistral, Qwen2) over the paged KV cache.

Architectures differ only through `ModelConfig` (qkv bias, tied embeddings, RoPE scaling).
q/k/v and gate/up are fused into single matmuls; the loader fills the fused weights from the
separate Hugging Face tensors. Every layer writes its new K/V into the cache first and then
attends from the cache, so a prefix-cache hit and a miss compute from identical inputs.

`pack_weights()` (called by the loader) moves bf16 CPU matmuls onto oneDNN with prepacked
weights and fused epilogues (see `packed_linear`) and frees the unpacked matmul weights, so
the model holds one copy; other dtypes and devices keep their parameters and use `F.linear`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, KVCache
from engine.model_config import ModelConfig
from engine.models import packed_linear as pl


class WeightSlot(NamedTuple):
    """Where one checkpoint tensor lands: rows [start, start + shape[0]) of `param`."""

    param: torch.Tensor
    start: int
    shape: tuple[int, ...]


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """torch's fused RMSNorm: one kernel instead of six (it accumulates in float32, like
    transformers; in bfloat16 the two may differ by one rounding step)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with "linear" or "llama3" scaling applied when configured."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (half-split layout) to [T, H, D] with per-token tables [T, 1, D].

    `signed_sin` carries the sign of transformers' rotate_half (-sin on the first half), so
    the rotation is one copy and one fused multiply-add.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.scale = config.head_dim**-0.5
        self.qkv_weight: nn.Parameter | None = _param(
            sum(self.sizes), config.hidden_size, dtype=dtype, device=device
        )
        self.qkv_bias = (
            _param(sum(self.sizes), dtype=dtype, device=device) if config.attention_bias else None
        )
        self.o_weight: nn.Parameter | None = _param(
            config.hidden_size, config.q_size, dtype=dtype, device=device
        )
        self.packed: dict[str, torch.Tensor] = {}

    def pack_weights(self) -> None:
        """Replace the weights by packed copies; the forward then reads only those."""
        self.packed = {"qkv": pl.pack(self.qkv_weight), "o": pl.pack(self.o_weight)}
        self.qkv_weight = self.o_weight = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """``residual`` plus the attention output."""
        tokens, q_size, kv_size = x.shape[0], self.sizes[0], self.sizes[1]
        packed = self.packed
        if packed:
            qkv = pl.linear(x, packed["qkv"], self.qkv_bias)
        else:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        qk = qkv[:, : q_size + kv_size].view(tokens, self.num_heads + self.num_kv_heads, -1)
        qk = rotate(qk, cos, sin)  # q and k heads rotated together
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        backend.write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = backend.paged_attention(q.contiguous(), kv_cache, metadata, self.scale)
        out = out.reshape(tokens, -1)
        if packed:
            return pl.linear_add(out, packed["o"], residual)
        return residual + F.linear(out, self.o_weight)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        size, hidden = config.intermediate_size, config.hidden_size
        self.gate_up_weight: nn.Parameter | None = _param(
            2 * size, hidden, dtype=dtype, device=device
        )
        self.down_weight: nn.Parameter | None = _param(hidden, size, dtype=dtype, device=device)
        self.packed: dict[str, torch.Tensor] = {}

    def pack_weights(self) -> None:
        """Replace the weights by packed copies; the forward then reads only those."""
        # Gate and up packed apart: SiLU and the product then run in the matmul epilogues.
        gate, up = self.gate_up_weight.chunk(2, dim=0)
        self.packed = {"gate": pl.pack(gate), "up": pl.pack(up), "down": pl.pack(self.down_weight)}
        self.gate_up_weight = self.down_weight = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` plus the SwiGLU MLP of ``x``."""
        packed = self.packed
        if packed:
            hidden = pl.linear_mul(x, packed["up"], pl.linear_silu(x, packed["gate"]))
            return pl.linear_add(hidden, packed["down"], residual)
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return residual + F.linear(F.silu(gate) * up, self.down_weight)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.attn = Attention(config, dtype, device)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.attn(self.input_norm(x), x, cos, sin, kv_cache, metadata, backend)
        return self.mlp(self.post_attention_norm(x), x)


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states [T, hidden]; `compute_logits` projects chosen rows."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = config
        self.embed_weight = _param(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head_weight: nn.Parameter | None = (
            None
            if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        positions = torch.arange(config.max_model_len, dtype=torch.float32)
        angles = torch.outer(positions, rope_inv_freq(config))
        cos, sin = angles.cos(), angles.sin()
        cos, signed_sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_signed_sin", signed_sin.to(device, dtype), persistent=False)
        self.lm_head_packed: torch.Tensor | None = None

    def pack_weights(self) -> None:
        """Prepack the matmul weights for oneDNN where that helps (bf16 on CPU), after loading.

        The unpacked matmul weights are freed (an untied lm_head's too), so the parameters
        left are the embedding and the norms. A tied lm_head is the embedding, which the
        lookup still needs."""
        if not pl.packing_helps(self.embed_weight):
            return
        for layer in self.layers:
            layer.attn.pack_weights()
            layer.mlp.pack_weights()
        self.lm_head_packed = pl.pack(self._lm_head_weight())
        self.lm_head_weight = None

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_weight if self.config.tie_word_embeddings else self.lm_head_weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_signed_sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed_weight)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, metadata, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_packed is not None:
            return pl.linear(hidden, self.lm_head_packed).float()
        return F.linear(hidden, self._lm_head_weight()).float()

    def hf_weight_slots(self) -> dict[str, WeightSlot]:
        """Every Hugging Face tensor name this model expects, and where it is stored."""
        if self.lm_head_packed is not None:
            raise RuntimeError("the checkpoint weights were released when they were packed")
        c = self.config
        slots = {
            "model.embed_tokens.weight": _whole(self.embed_weight),
            "model.norm.weight": _whole(self.norm.weight),
        }
        if not c.tie_word_embeddings:
            slots["lm_head.weight"] = _whole(self.lm_head_weight)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.attn, layer.mlp
            offsets = {
                "q": (0, c.q_size),
                "k": (c.q_size, c.kv_size),
                "v": (c.q_size + c.kv_size, c.kv_size),
            }
            for name, (start, rows) in offsets.items():
                slots[f"{prefix}self_attn.{name}_proj.weight"] = WeightSlot(
                    attn.qkv_weight, start, (rows, c.hidden_size)
                )
                if attn.qkv_bias is not None:
                    slots[f"{prefix}self_attn.{name}_proj.bias"] = WeightSlot(
                        attn.qkv_bias, start, (rows,)
                    )
            slots[f"{prefix}self_attn.o_proj.weight"] = _whole(attn.o_weight)
            size = c.intermediate_size
            slots[f"{prefix}mlp.gate_proj.weight"] = WeightSlot(
                mlp.gate_up_weight, 0, (size, c.hidden_size)
            )
            slots[f"{prefix}mlp.up_proj.weight"] = WeightSlot(
                mlp.gate_up_weight, size, (size, c.hidden_size)
            )
            slots[f"{prefix}mlp.down_proj.weight"] = _whole(mlp.down_weight)
            slots[f"{prefix}input_layernorm.weight"] = _whole(layer.input_norm.weight)
            slots[f"{prefix}post_attention_layernorm.weight"] = _whole(
                layer.post_attention_norm.weight
            )
        return slots


def _whole(param: torch.Tensor) -> WeightSlot:
    return WeightSlot(param, 0, tuple(param.shape))
