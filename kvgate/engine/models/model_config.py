"""The architecture facts the engine needs, read once from a Hugging Face `config.json`.

One decoder serves every supported family; everything that differs between them is a field
here (q/k norms, Gemma's sandwich norms and soft-capping, per-layer sliding windows and RoPE
bases, mixture-of-experts routing), so the model code never branches on the architecture name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Checkpoint tensor layout per architecture (see kvgate/engine/models/checkpoint.py).
LAYOUTS = {
    "Phi3ForCausalLM": "fused",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen_moe",
}
# Sampling fields generation_config.json may default (vLLM reads the same three).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k")


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
    # Optional structure; the defaults are Llama's.
    layout: str = "llama"
    hidden_act: str = "silu"
    rotary_dim: int = 0  # 0 = head_dim (partial rotary: Phi-4-mini)
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # Gemma's norms scale by (1 + weight)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and MLP as well
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float = 0.0  # 0 = head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    local_rope_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers
    num_experts: int = 0  # > 0: a mixture-of-experts model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse MLP or dense
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` and `generation_config.json` (EOS ids, sampling defaults)."""
        path = Path(path)
        raw = _read_json(path / "config.json", required=True)
        return cls.from_hf(raw, _read_json(path / "generation_config.json", required=False))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else raw.get("model_type", "<none>")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        generation = generation or {}
        try:
            config = cls(**_fields(architecture, raw, generation))
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from exc
        if config.num_heads % config.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({config.num_heads}) is not a multiple of "
                f"num_key_value_heads ({config.num_kv_heads})"
            )
        if config.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(
                f"unsupported hidden_act {config.hidden_act!r}; "
                f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if raw.get("mlp_bias"):
            raise ModelLoadError("unsupported mlp_bias=true")
        return config


def _read_json(file: Path, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise ModelLoadError(f"missing {file.name} in {file.parent}")
        return {}
    try:
        parsed: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
        return parsed
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file.name} in {file.parent} is not valid JSON: {exc}") from exc


def _fields(architecture: str, raw: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    num_layers = int(raw["num_hidden_layers"])
    gemma = architecture in GEMMA
    rope_theta, rope_scaling, local_theta, partial = _rope(raw)
    fields: dict[str, Any] = dict(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        max_model_len=int(raw.get("max_position_embeddings", 2048)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
        eos_token_ids=_eos_ids(raw, generation),
        bos_token_id=raw.get("bos_token_id"),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        layout=LAYOUTS.get(architecture, "llama"),
        hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        layer_windows=_layer_windows(architecture, raw, num_layers),
        local_rope_theta=local_theta,
        generation_defaults={k: generation[k] for k in GENERATION_DEFAULTS if k in generation},
    )
    if gemma:
        fields.update(
            norm_offset=1.0,
            sandwich_norms=True,
            embed_scale=hidden**0.5,
            attn_scale=float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            attn_softcap=_optional_float(raw.get("attn_logit_softcapping")),
            final_softcap=_optional_float(raw.get("final_logit_softcapping")),
        )
    if architecture in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        fields.update(_moe(architecture, raw, num_layers))
    return fields


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _moe(architecture: str, raw: dict[str, Any], num_layers: int) -> dict[str, Any]:
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if architecture == "MixtralForCausalLM":
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
            moe_layers=(True,) * num_layers,
        )
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step") or 1)
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        moe_layers=tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        ),
    )


def _layer_windows(
    architecture: str, raw: dict[str, Any], num_layers: int
) -> tuple[int | None, ...]:
    """Per-layer sliding windows, by transformers' rules for each family's config."""
    window = raw.get("sliding_window")
    if not window:
        return ()
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return (int(window),) * num_layers
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        if not raw.get("use_sliding_window"):
            return ()
        first = int(raw.get("max_window_layers", num_layers))
        default = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    elif architecture in GEMMA:
        pattern = 2 if architecture == "Gemma2ForCausalLM" else raw.get("sliding_window_pattern", 6)
        default = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    else:
        return ()
    types = raw.get("layer_types") or default
    if len(types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in types)
    return windows if any(windows) else ()


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(theta, scaling, local theta, partial rotary factor) from either the transformers-5
    `rope_parameters` (per layer type for Gemma 3) or the older keys."""
    params = dict(raw.get("rope_parameters") or {})
    local_theta = None
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention") or {}
        params = dict(params.get("full_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError("unsupported rope scaling on the sliding-window layers")
        local_theta = float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))
    elif raw.get("rope_local_base_freq") is not None:
        local_theta = float(raw["rope_local_base_freq"])
    partial = float(params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = params or raw.get("rope_scaling")
    if not scaling:
        return theta, None, local_theta, partial
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "su":  # the name early Phi-3 configs used for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None, local_theta, partial
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":
        scaling.setdefault(
            "original_max_position_embeddings", raw.get("original_max_position_embeddings")
        )
        scaling["max_position_embeddings"] = raw.get("max_position_embeddings")
    return theta, scaling, local_theta, partial


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for source in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids
