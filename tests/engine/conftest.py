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

from kvgate.engine.loading.tiny_model import make_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


# Small random configs keeping every structural flag of the real checkpoints named beside
# them. Windows are short (WINDOW tokens) so the test prompts run past them; soft-caps are
# low enough to bite at these weight scales.
WINDOW = 12
INIT_RANGE = 0.15  # larger than transformers' 0.02, so the soft-caps and the routing matter
LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0 + 0.1 * i for i in range(8)],
    long_factor=[1.5 + 0.5 * i for i in range(8)],
    original_max_position_embeddings=128,  # above the test prompts: transformers then uses
)  # the short factors throughout, as the engine does below 128 positions
FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    # Qwen/Qwen3-0.6B: explicit head_dim, per-head q/k norms, tied embeddings, no qkv bias.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6)),
    # Qwen3 with its sliding-window options switched on (layers >= max_window_layers).
    "qwen3-window": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    # google/gemma-2-2b-it: alternating sliding/global, soft-capped attention and logits,
    # query_pre_attn_scalar != head_dim (as in gemma-2-27b), GeGLU, sandwich norms.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    # google/gemma-3-1b-it: q/k norms, local layers with their own RoPE base, linear-scaled
    # global RoPE (gemma-3-4b+), no soft-capping.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # microsoft/Phi-3-mini-4k-instruct: fused qkv_proj/gate_up_proj, sliding window.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW, pad_token_id=0)),
    # microsoft/Phi-3-mini-128k-instruct: longrope; Phi-4-mini: partial rotary.
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(rope_parameters=LONGROPE, original_max_position_embeddings=128, pad_token_id=0),
    ),
    "phi4-partial": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.75,
            },
            pad_token_id=0,
        ),
    ),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts top-2, renormalised, per-expert w1/w2/w3.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    ),
    # Qwen/Qwen3-30B-A3B: 8 of 128 experts (here 2 of 8), norm_topk_prob, q/k norms, one
    # dense layer (mlp_only_layers) to keep both paths.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
}


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
    elif arch in FAMILY_CONFIGS:
        config_cls, model_cls, extra = FAMILY_CONFIGS[arch]
        config_cls, model_cls = getattr(transformers, config_cls), getattr(transformers, model_cls)
        config = config_cls(**{**common, "initializer_range": INIT_RANGE, **extra})
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
