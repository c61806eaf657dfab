"""The architecture facts the engine needs, read once from a Hugging Face `config.json`.

Llama, Mistral and Qwen2 share one decoder; everything that differs between them is a field
here, so the model code never branches on the architecture name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A checkpoint folder the engine cannot use; the message names the offending piece."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: str

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for extra EOS ids) from a folder."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"missing config.json in {path}")
        try:
            raw = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"config.json in {path} is not valid JSON: {exc}") from exc
        generation_file = path / "generation_config.json"
        generation = {}
        if generation_file.is_file():
            generation = json.loads(generation_file.read_text(encoding="utf-8"))
        return cls.from_hf(raw, generation)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else raw.get("model_type", "<none>")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            rope_theta, rope_scaling = _rope(raw)
            config = cls(
                architecture=architecture,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_model_len=_max_model_len(raw),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=architecture == "Qwen2ForCausalLM"
                or bool(raw.get("attention_bias", False)),
                eos_token_ids=_eos_ids(raw, generation or {}),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from exc
        if config.num_heads % config.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({config.num_kv_heads})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu'")
        if raw.get("mlp_bias"):
            raise ModelLoadError("unsupported mlp_bias=true")
        return config


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the transformers-5 `rope_parameters` or the older keys."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = params or raw.get("rope_scaling")
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def _max_model_len(raw: dict[str, Any]) -> int:
    """Context limit; a sliding window caps it, since within the window attention is full."""
    limit = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", raw.get("model_type") == "mistral")
    if window and uses_window:
        limit = min(limit, int(window))
    return limit


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids
