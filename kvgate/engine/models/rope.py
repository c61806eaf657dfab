"""Rotary position embeddings: inverse frequencies per scaling type, and the cos/sin tables.

Tables are precomputed for ``max_model_len`` positions (the engine's bound, which may be far
below the checkpoint's), in the half-split layout transformers uses. ``longrope`` (Phi-3)
keeps two sets of frequencies; transformers switches the whole sequence to the long set once
it passes ``original_max_position_embeddings``, which would change the keys already cached,
so here each position uses the set its own index calls for (as vLLM does): identical to
transformers for every sequence that stays within the original length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvgate.engine.models.model_config import ModelConfig


def rotary_dim(config: ModelConfig) -> int:
    return config.rotary_dim or config.head_dim


def rope_inv_freq(
    config: ModelConfig, theta: float | None = None, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies, with "linear", "llama3" or "longrope" scaling when configured.
    ``theta`` overrides the base (and drops the scaling: Gemma 3's local layers)."""
    dim = rotary_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = config.rope_theta if theta is None else theta
    scaling = config.rope_scaling if theta is None else None
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)
    inv_freq = 1.0 / (base**exponents)
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


def _longrope_attention_factor(scaling: dict[str, Any]) -> float:
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or float(scaling["max_position_embeddings"]) / original
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(
    config: ModelConfig, num_positions: int, theta: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) ``[num_positions, rotary_dim]`` in fp32; the sign of
    transformers' rotate_half is folded into the sine (-sin on the first half)."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    scaling = config.rope_scaling if theta is None else None
    angles = torch.outer(positions, rope_inv_freq(config, theta))
    factor = 1.0
    if scaling is not None and scaling["rope_type"] == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        if num_positions > original:
            long = torch.outer(positions[original:], rope_inv_freq(config, long=True))
            angles = torch.cat((angles[:original], long))
        factor = _longrope_attention_factor(scaling)
    cos, sin = angles.cos() * factor, angles.sin() * factor
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (half-split layout) to [T, H, D] with per-token tables [T, 1, R], R <= D
    (the dims past R pass through: partial rotary). One copy and one fused multiply-add."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((rotate(x[..., :dim], cos, signed_sin), x[..., dim:]), dim=-1)
    half = dim // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
