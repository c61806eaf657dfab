"""Load a Hugging Face checkpoint folder into the engine's model, tokenizer and identity.

Every tensor is checked against what the model expects, so a broken checkpoint fails at load
time with a message naming the file or tensor instead of producing garbage later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.models.checkpoint import hf_weight_slots
from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.model_config import ModelConfig
from kvgate.engine.models.registry import build_model
from kvgate.engine.tokenization.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_dtype"]

INDEX_FILE = "model.safetensors.index.json"
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
IDENTITY_SAMPLE = 1 << 20  # bytes hashed from each of three places in a weight file
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    model_id: str
    path: Path
    dtype: torch.dtype


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """ "auto" means the checkpoint's own dtype (float32 when it does not say)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype == "auto" else dtype
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[name]


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
) -> LoadedModel:
    """``max_model_len`` bounds the context below the checkpoint's own (RoPE tables and the
    cache are sized to it: a 1M-position config need not precompute 1M positions)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    config = bounded_context(ModelConfig.from_dir(path), max_model_len)
    torch_dtype = resolve_dtype(dtype, config)
    files = safetensors_files(path)
    tokenizer = Tokenizer.from_dir(path)
    model = build_model(config, torch_dtype, device)
    load_weights(model, files)
    model.pack_weights()
    model.eval()
    return LoadedModel(
        model, config, tokenizer, model_identity(path, files, torch_dtype), path, torch_dtype
    )


def bounded_context(config: ModelConfig, max_model_len: int | None) -> ModelConfig:
    """``config`` with its context bounded by ``max_model_len`` when that is smaller (RoPE
    tables and the cache are sized to it: a 1M-position config need not precompute 1M)."""
    if max_model_len is not None and max_model_len < config.max_model_len:
        return dataclasses.replace(config, max_model_len=max_model_len)
    return config


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the sharded index names, else every `*.safetensors`."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"missing safetensors shard {file.name} named in {INDEX_FILE}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"missing *.safetensors weights in {path}")
    return files


def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    slots = hf_weight_slots(model)
    tied = model.config.tie_word_embeddings
    seen: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.endswith(IGNORED_TENSOR_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                slot = slots.get(name)
                if slot is None:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {file.name}")
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != slot.shape:
                    raise ModelLoadError(
                        f"shape mismatch for tensor {name!r} in {file.name}: "
                        f"expected {list(slot.shape)}, got {list(tensor.shape)}"
                    )
                if slot.offset:
                    tensor = tensor.float() + slot.offset
                with torch.no_grad():
                    slot.param[slot.start : slot.start + slot.shape[0]].copy_(tensor)
                seen.add(name)
    check_all_loaded(slots, seen, "the safetensors files")


def check_all_loaded(slots: Mapping[str, object], seen: set[str], source: str) -> None:
    """ModelLoadError naming the first tensors the model expects that `source` lacked."""
    missing = sorted(set(slots) - seen)
    if missing:
        shown = ", ".join(repr(name) for name in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"missing tensor {shown}{more} in {source}")


def model_identity(path: Path, files: list[Path], dtype: torch.dtype) -> str:
    """A stable id for what the model computes: config, compute dtype, and weight content.

    It roots the prefix-cache block hashes, so two models never share KV blocks. Hashing every
    byte of a large checkpoint is slow, so each file contributes its size and samples of its
    bytes (start, middle, end): any two real checkpoints differ there.
    """
    return sampled_digest((path / "config.json").read_bytes(), files, dtype)


def sampled_digest(header: bytes, files: list[Path], dtype: torch.dtype) -> str:
    """sha256 of `header`, the dtype, and each file's name, size and sampled bytes."""
    digest = hashlib.sha256(header)
    digest.update(f"\0dtype={dtype}".encode())
    for file in files:
        size = file.stat().st_size
        digest.update(f"\0{file.name}\0{size}\0".encode())
        with file.open("rb") as handle:
            for offset in sorted(
                {0, max(size // 2 - IDENTITY_SAMPLE // 2, 0), max(size - IDENTITY_SAMPLE, 0)}
            ):
                handle.seek(offset)
                digest.update(handle.read(IDENTITY_SAMPLE))
    return digest.hexdigest()
