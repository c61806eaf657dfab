"""Reading Hugging Face config.json files of the supported architectures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model_config import ModelConfig, ModelLoadError

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


def test_mistral_sliding_window_caps_the_context() -> None:
    mistral = {
        **LLAMA,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 4096,
    }
    assert ModelConfig.from_hf(mistral).max_model_len == 4096
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).max_model_len == 8192


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
