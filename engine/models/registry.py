"""The model class for each supported Hugging Face architecture name."""

from __future__ import annotations

from engine.model_config import SUPPORTED_ARCHITECTURES, ModelLoadError
from engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {architecture!r}") from None
