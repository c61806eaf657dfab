"""Write a small random Llama (or Mixtral) checkpoint in Hugging Face format, deterministically, offline.

It backs the tests, `LLM()` with no model, `--model tiny`, and `kvgate serve` where no real
model is installed (kvgate.gateway.default_model): random weights
from a fixed seed, a byte-level BPE tokenizer trained here on a built-in corpus, a ChatML
chat template. Same seed and preset → the same bytes, and `transformers` can load the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvgate.engine.config import cache_dir
from kvgate.engine.loading.tiny_corpus import CORPUS
from kvgate.engine.models.checkpoint import hf_weight_slots
from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.model_config import ModelConfig

DEFAULT_MODEL_NAME = "tiny-model-v3"  # v2: the template lists tools; v3: writes tool calls
INIT_STD = 0.02
BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\nTools: ' }}"
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{{ '<tool_call>\n' + {'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson + '\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    ),
    "bench55m": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=3328,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    ),
    # A Mixtral-shaped mixture of experts of ~49M parameters (8 experts, top-2; ~15M active
    # per token), for the MoE engine benchmark.
    "bench-moe": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}


def make_tiny_model(path: str | Path, seed: int = 0, preset: str = "tiny") -> Path:
    """Write the checkpoint folder at `path` (created if needed) and return it."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sizes = PRESETS[preset]
    tokenizer = train_tokenizer(sizes["vocab_size"])
    tokenizer.save(str(path / "tokenizer.json"))
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        found = tokenizer.token_to_id(token)
        assert found is not None, token  # trained with the special tokens it declares
        ids[token] = found
    config = hf_config(sizes, bos_id=ids[BOS], eos_id=ids[EOS])
    _write_json(path / "config.json", config)
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": ids[BOS],
            "eos_token_id": [ids[EOS], ids[IM_END]],
        },
    )
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": sizes["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    save_file(
        random_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    return path


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on the built-in corpus, padded with reserved tokens to `vocab_size`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Normal(0, INIT_STD) matrices and unit norms, drawn in a fixed name order."""
    model = LlamaForCausalLM(ModelConfig.from_hf(config), torch.float32, "meta")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, slot in sorted(hf_weight_slots(model).items()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(slot.shape)
        else:
            weights[name] = torch.empty(slot.shape).normal_(0.0, INIT_STD, generator=generator)
    return weights


def default_model_dir() -> Path:
    """The cached default tiny model, built once (atomically) on first use."""
    cache = cache_dir()
    target = cache / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=cache))
    try:
        make_tiny_model(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def hf_config(sizes: dict[str, int], bos_id: int, eos_id: int) -> dict[str, Any]:
    """The `config.json` content of a preset (`sizes` is one of PRESETS); presets with
    experts are Mixtral checkpoints."""
    moe = "num_local_experts" in sizes
    return {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        **sizes,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "initializer_range": INIT_STD,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
