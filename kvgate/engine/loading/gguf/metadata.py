"""A GGUF file's metadata as the `config.json` fields the engine reads, so a GGUF model goes
through the same `ModelConfig.from_hf` checks as a Hugging Face folder.

llama.cpp names each hyperparameter ``<architecture>.<key>`` (``llama.block_count``); the
mapping below follows transformers' GGUF loader (`integrations/ggml.py`) for the families the
engine serves. Gemma's files are refused for now: their vocabulary needs transformers'
Gemma-specific rebuilding, which `kvgate.engine.loading.gguf.vocab` does not do.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.models.model_config import ModelConfig

# general.architecture -> the Hugging Face architecture the engine serves it as.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 1-3, Mistral 7B, SmolLM: llama.cpp files all as llama
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# <architecture>.<key> -> config.json field (same for every family above).
CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
# general.file_type (llama_ftype) -> the dtype "auto" means: the file's own for unquantized
# files; bfloat16 for quantized ones (what their weights are dequantized to).
FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, int, float, bool or a list of them)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    """The file's `general.architecture`, refused unless the engine serves it."""
    name = field_value(reader, "general.architecture", "<none>")
    if name not in ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {name!r} (general.architecture); "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    return str(name)


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The `config.json` a Hugging Face folder of this model would have (the fields the
    engine reads)."""
    arch = gguf_architecture(reader)
    raw: dict[str, Any] = {"architectures": [ARCHITECTURES[arch]]}
    for key, name in CONFIG_KEYS.items():
        value = field_value(reader, f"{arch}.{key}")
        if value is None and key in REQUIRED_KEYS:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):  # per-layer values: llama.cpp's hybrid models
            if len(set(value)) != 1:
                raise ModelLoadError(f"unsupported per-layer {arch}.{key} = {value}")
            value = value[0]
        if value is not None:
            raw[name] = value
    if "vocab_size" not in raw:
        raw["vocab_size"] = len(field_value(reader, "tokenizer.ggml.tokens", []))
    rotary = field_value(reader, f"{arch}.rope.dimension_count")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if rotary is not None and rotary != head_dim:
        raw["partial_rotary_factor"] = rotary / head_dim
    raw["rope_scaling"] = _rope_scaling(reader, arch)
    raw["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    raw["eos_token_id"] = _end_ids(reader)
    raw["bos_token_id"] = field_value(reader, "tokenizer.ggml.bos_token_id")
    raw["torch_dtype"] = FILE_DTYPES.get(field_value(reader, "general.file_type", -1), "bfloat16")
    return raw


def model_config(reader: GGUFReader) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(reader))


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float(field_value(reader, f"{arch}.rope.scaling.factor", 1.0)),
    }
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _end_ids(reader: GGUFReader) -> list[int]:
    """EOS, then llama.cpp's other end-of-generation ids (end of turn, end of message)."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = field_value(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids
