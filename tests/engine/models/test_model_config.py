"""Reading Hugging Face config.json files of the supported architectures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.models.model_config import ModelConfig

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def test_llama_fields_and_defaults() -> None:
    config = ModelConfig.from_hf(LLAMA)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 2, 32)
    assert (config.q_size, config.kv_size) == (256, 64)
    assert config.max_model_len == 8192
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert not config.attention_bias and not config.tie_word_embeddings
    assert config.eos_token_ids == [2] and config.bos_token_id == 1
    assert config.torch_dtype == "bfloat16"


def test_rope_from_transformers5_rope_parameters() -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = ModelConfig.from_hf({**LLAMA, "rope_parameters": rope})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["factor"] == 8.0


def test_rope_from_legacy_keys() -> None:
    legacy = {**LLAMA, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    config = ModelConfig.from_hf(legacy)
    assert config.rope_theta == 1e6
    assert config.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}


def test_unsupported_rope_scaling_is_named() -> None:
    with pytest.raises(ModelLoadError, match="yarn"):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_qwen2_has_qkv_bias_and_may_tie_embeddings() -> None:
    qwen = {
        **LLAMA,
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
        "sliding_window": 4096,
        "use_sliding_window": False,
    }
    config = ModelConfig.from_hf(qwen)
    assert config.attention_bias and config.tie_word_embeddings
    assert config.max_model_len == 8192  # the window is configured but not used


def test_mistral_sliding_window_applies_to_every_layer() -> None:
    mistral = {
        **LLAMA,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 4096,
    }
    config = ModelConfig.from_hf(mistral)
    assert config.max_model_len == 8192 and config.layer_windows == (4096, 4096)
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).layer_windows == ()


@pytest.mark.parametrize(
    ("arch", "extra", "windows"),
    [
        ("Gemma2ForCausalLM", {}, (64, None, 64, None)),
        ("Gemma3ForCausalLM", {"sliding_window_pattern": 2}, (64, None, 64, None)),
        ("Gemma3ForCausalLM", {}, (64, 64, 64, 64)),
        (
            "Qwen3ForCausalLM",
            {"use_sliding_window": True, "max_window_layers": 2},
            (None, None, 64, 64),
        ),
        ("Qwen3ForCausalLM", {"use_sliding_window": False}, ()),
        ("Phi3ForCausalLM", {}, (64,) * 4),
    ],
)
def test_layer_windows_follow_transformers_defaults(arch: str, extra: dict, windows: tuple) -> None:
    """Real configs often omit layer_types; transformers then derives them per family."""
    raw = {**LLAMA, "architectures": [arch], "num_hidden_layers": 4, "sliding_window": 64, **extra}
    assert ModelConfig.from_hf(raw).layer_windows == windows


def test_gemma3_rope_per_layer_type_and_softcaps() -> None:
    raw = {
        **LLAMA,
        "architectures": ["Gemma2ForCausalLM"],
        "query_pre_attn_scalar": 144,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    config = ModelConfig.from_hf(raw)
    assert config.scale == 144**-0.5 and config.embed_scale == 256**0.5
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert config.tie_word_embeddings and config.norm_offset == 1.0
    gemma3 = {
        **raw,
        "architectures": ["Gemma3ForCausalLM"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    config = ModelConfig.from_hf(gemma3)
    assert config.rope_theta == 1e6 and config.rope_scaling["factor"] == 8.0
    assert config.local_rope_theta == 1e4 and config.qk_norm


def test_moe_fields() -> None:
    mixtral = {**LLAMA, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
               "num_experts_per_tok": 2}  # fmt: skip
    config = ModelConfig.from_hf(mixtral)
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.norm_topk_prob and config.moe_layers == (True, True)
    qwen = {**LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 64, "mlp_only_layers": [0]}  # fmt: skip
    config = ModelConfig.from_hf(qwen)
    assert config.moe_intermediate_size == 64 and not config.norm_topk_prob
    assert config.moe_layers == (False, True)


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "eos_token_id": [2, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [2, 7, 9]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "bert"}, "bert"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_bad_configs_are_named(change: dict, message: str) -> None:
    raw = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf(raw)


def test_missing_or_invalid_config_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_gemma3_legacy_rope_keys_and_phi3_su_scaling() -> None:
    """Keys as the Hub's gemma-3-1b-it and Phi-3-mini-128k config.json files spell them."""
    gemma3 = {**LLAMA, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
              "rope_local_base_freq": 1e4, "rope_scaling": None, "sliding_window": 512,
              "sliding_window_pattern": 6, "num_hidden_layers": 6}  # fmt: skip
    config = ModelConfig.from_hf(gemma3)
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.layer_windows == (512,) * 5 + (None,)
    phi3 = {**LLAMA, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "sliding_window": 262144,
            "rope_scaling": {"type": "su", "long_factor": [1.0], "short_factor": [1.0]}}  # fmt: skip
    scaling = ModelConfig.from_hf(phi3).rope_scaling
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 4096
