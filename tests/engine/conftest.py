"""Model fixtures shared by the engine tests: the tiny model and small random HF checkpoints.

Checkpoints are built with `transformers` itself (the reference), session-scoped and cached,
with the tiny model's tokenizer copied in so every architecture shares one vocabulary.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.tiny_model import make_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


def _hf_model(arch: str, vocab_size: int) -> torch.nn.Module:
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "llama3":
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        config = transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, rope_theta=1e6, sliding_window=256)
        model_cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown test architecture {arch!r}")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: perturb them so loading shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Callable[..., Path]:
    """`hf_checkpoint(arch, sharded=False)` → folder of a small random transformers model."""
    built: dict[tuple[str, bool], Path] = {}

    def build(arch: str, sharded: bool = False) -> Path:
        key = (arch, sharded)
        if key not in built:
            vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
            path = tmp_path_factory.mktemp(f"hf-{arch}{'-sharded' if sharded else ''}")
            _hf_model(arch, vocab).save_pretrained(
                path, safe_serialization=True, max_shard_size="100KB" if sharded else "5GB"
            )
            for name in TOKENIZER_FILES:
                shutil.copy(tiny_model_dir / name, path / name)
            built[key] = path
        return built[key]

    return build
