"""The generated tiny model: deterministic, valid Hugging Face format, cached default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvgate.engine.loading.tiny_model import PRESETS, default_model_dir, hf_config, make_tiny_model
from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.model_config import ModelConfig

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _bytes(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in FILES}


def test_same_seed_same_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert _bytes(again) == _bytes(tiny_model_dir)


def test_other_seed_changes_only_the_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = _bytes(make_tiny_model(tmp_path / "other", seed=1))
    base = _bytes(tiny_model_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in base.items() if k != "model.safetensors"
    }


def test_transformers_loads_it_and_generates(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    config = ModelConfig.from_dir(tiny_model_dir)
    assert len(tokenizer) == config.vocab_size == model.config.vocab_size
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tokenizer.eos_token_id,
    )
    assert out.shape[1] == ids.shape[1] + 8
    # Random weights with a small init must not collapse to one repeated token.
    assert len(set(out[0, ids.shape[1] :].tolist())) > 1


def test_chat_template_is_present(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text


def test_bench_preset_has_about_55m_parameters() -> None:
    config = ModelConfig.from_hf(hf_config(PRESETS["bench55m"], bos_id=0, eos_id=1))
    model = LlamaForCausalLM(config, torch.float32, "meta")
    params = sum(p.numel() for p in model.parameters())
    assert 50e6 < params < 60e6 and config.head_dim == 64


def test_moe_bench_preset_is_a_50m_mixtral_with_8_experts_top_2() -> None:
    raw = hf_config(PRESETS["bench-moe"], bos_id=0, eos_id=1)
    config = ModelConfig.from_hf(raw)
    assert raw["architectures"] == ["MixtralForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    model = LlamaForCausalLM(config, torch.float32, "meta")
    params = sum(p.numel() for p in model.parameters())
    assert 45e6 < params < 55e6


def test_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        make_tiny_model(tmp_path, preset="huge")


def test_default_model_dir_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    first = default_model_dir()
    assert first == tmp_path / "tiny-model-v3" and (first / "model.safetensors").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-model-v3"]  # no staging leftovers
