"""Tiny PEFT LoRA adapters for the tests, made by ``peft`` itself on a base model folder, from
fixed seeds; and the reference: transformers + peft greedy tokens with an adapter."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

# peft 0.21 calls a transformers property that transformers 5 deprecates.
PEFT_DEPRECATION = "`is_gradient_checkpointing` is deprecated"

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Adapter A: every projection, r 8, alpha 16 (scaling 2). B: q and v only, rsLoRA (alpha/sqrt r).
ADAPTER_A = dict(seed=1, targets=ALL_TARGETS, r=8, alpha=16, rslora=False)
ADAPTER_B = dict(seed=2, targets=("q_proj", "v_proj"), r=4, alpha=8, rslora=True)


def _peft_model(
    base: Path, seed: int, targets: tuple[str, ...], r: int, alpha: float, rslora: bool
):  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=rslora
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", PEFT_DEPRECATION, FutureWarning)
        peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts B at zero (no effect): random A and B so it shows
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.08)
    return peft_model.eval()


def make_adapter(
    base: Path, out: Path, seed: int, targets: tuple[str, ...], r: int, alpha: float, rslora: bool
) -> Path:
    """Write a PEFT adapter folder for the model at ``base`` into ``out``."""
    _peft_model(base, seed, targets, r, alpha, rslora).save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """transformers (+ peft with ``adapter``) in fp32: argmax over the whole sequence, n times."""
    model = _reference(base, adapter)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@functools.cache
def _reference(base: Path, adapter: Path | None) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is None:
        return model
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", PEFT_DEPRECATION, FutureWarning)
        return PeftModel.from_pretrained(model, adapter).eval()
