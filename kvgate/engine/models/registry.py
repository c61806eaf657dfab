"""The model class for each supported Hugging Face architecture name."""

from __future__ import annotations

import torch

import kvgate.engine.models.decode_stack as decode_stack
from kvgate.engine.errors import ModelLoadError
from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES
}


def build_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> LlamaForCausalLM:
    """The model of ``config``'s architecture, its weights unset, its decode stack wired."""
    model = model_class(config.architecture)(config, dtype, device)
    model.build_layer_stack = decode_stack.build
    return model


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {architecture!r}") from None
