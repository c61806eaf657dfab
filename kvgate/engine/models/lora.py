"""LoRA adapters in PEFT's format: read, checked against the base model, and kept by name.

An adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``) and
``adapter_model.safetensors`` with one ``lora_A`` ``[r, in]`` and one ``lora_B`` ``[out, r]``
per targeted projection (q/k/v/o, gate/up/down of a dense MLP). Everything read is checked
before it is used — the config's fields and size, the file's size against what the base
model's shapes allow, each tensor's name, shape, dtype and values — and a problem is an
``kvgate.engine.errors.AdapterError`` naming the file or tensor.

The engine fuses q/k/v and gate/up into one matmul each (``models/llama.py``), so an adapter
is stored per fused *site*: the A matrices of the site's targets stacked ``[k*r, in]``, and
a block-diagonal B ``[out, k*r]`` whose rows land on each target's slice of the fused output
(zero rows for a target the adapter leaves alone). The scaling (``lora_alpha / r``, or
``/ sqrt(r)`` with rsLoRA) is folded into B once here; ``models/lora_layers`` adds
``(x @ A.T) @ B.T`` to a step's rows, several adapters at once, never merging a weight.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from kvgate.engine.errors import AdapterError, AdapterNotFound, UnknownAdapter
from kvgate.engine.models.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_NAME_CHARS = 256
MAX_LOADED = 64  # adapters held at once (their weights stay in memory)
HEADER_SLACK = 1 << 20  # a safetensors header's bytes, beyond its tensors' own
ADAPTER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q|k|v|o|gate|up|down)_proj\.lora_(A|B)\.weight"
)
# The fused site each target lands in, and the order of the targets within it.
SITES: dict[str, tuple[str, ...]] = {
    "qkv": ("q", "k", "v"),
    "o": ("o",),
    "gate_up": ("gate", "up"),
    "down": ("down",),
}
SITE_OF = {target: site for site, targets in SITES.items() for target in targets}


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One loaded adapter. ``sites[layer][site]`` is ``(A, B)`` (scaling folded into B), or
    absent where the adapter leaves that site alone. ``identity`` (its name and a sha256 of
    its files) goes into the block-hash root: two adapters never share cached blocks, nor
    does a different adapter reloaded under the same name."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str
    sites: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)

    @property
    def identity(self) -> bytes:
        return f"{self.name}\x00{self.digest}".encode()


def site_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """``target -> (in, out)`` of the projections a LoRA may target in ``layer``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "q": (hidden, config.q_size),
        "k": (hidden, config.kv_size),
        "v": (hidden, config.kv_size),
        "o": (config.q_size, hidden),
    }
    if not config.is_moe_layer(layer):
        shapes.update(gate=(hidden, inter), up=(hidden, inter), down=(inter, hidden))
    return shapes


def load_adapter(
    name: str,
    path: str | Path,
    config: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> LoRAAdapter:
    """Read and check the PEFT folder at ``path`` for the base model ``config``."""
    check_name(name)
    folder = Path(path)
    try:  # the path is the caller's: any error reading it (too long, no access) is theirs
        if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
            raise AdapterNotFound(f"Loading lora {name} failed: No adapter found for {path}")
        if config.layout == "fused":
            raise AdapterError(
                f"{path}: LoRA needs separate q/k/v and gate/up projections in the base model "
                f"(its {config.architecture} checkpoint fuses them)"
            )
        raw_config = _read_bounded(folder / CONFIG_FILE, MAX_CONFIG_BYTES)
        rank, scaling = _read_config(raw_config, folder / CONFIG_FILE, max_rank)
        weights = folder / WEIGHTS_FILE
        limit = HEADER_SLACK + _max_weight_bytes(config, rank)
        raw_weights = _read_bounded(weights, limit)
    except OSError as exc:  # its message would quote the path, however long: the cause only
        raise AdapterError(
            f"Loading lora {name} failed: lora_path cannot be read ({exc.strerror or exc})"
        ) from None
    tensors = _read_tensors(weights, raw_weights, config, rank)
    digest = hashlib.sha256(raw_config + b"\x00" + raw_weights).hexdigest()
    return LoRAAdapter(
        name, str(path), rank, scaling, digest, _stack(tensors, config, scaling, dtype, device)
    )


def check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise AdapterError(f"lora_name must be a non-empty string of at most {MAX_NAME_CHARS}")


def _read_bounded(file: Path, limit: int) -> bytes:
    size = file.stat().st_size
    if size > limit:
        raise AdapterError(f"{file}: {size} bytes, more than this base model allows ({limit})")
    return file.read_bytes()


def _read_config(raw: bytes, file: Path, max_rank: int) -> tuple[int, float]:
    """(r, scaling) from ``adapter_config.json``; a LoRA variant not served is refused."""
    try:
        fields: Any = json.loads(raw)
    except ValueError as exc:
        raise AdapterError(f"{file}: not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise AdapterError(f"{file}: not a JSON object")
    if fields.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type {fields['peft_type']!r} is not LORA")
    rank, alpha = fields.get("r"), fields.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{file}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{file}: r is {rank}, above this server's max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise AdapterError(f"{file}: lora_alpha must be a positive number, got {alpha!r}")
    for key, allowed in (("use_rslora", (False, True)), ("use_dora", (False, None))):
        if fields.get(key, False) not in allowed:
            raise AdapterError(f"{file}: {key} {fields[key]!r} is not served")
    if fields.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias {fields['bias']!r} is not served (only 'none')")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out"):
        if fields.get(key):
            raise AdapterError(f"{file}: {key} is not served")
    root = math.sqrt(rank) if fields.get("use_rslora") else rank
    return rank, float(alpha) / root


def _max_weight_bytes(config: ModelConfig, rank: int) -> int:
    """The most bytes the tensors of an adapter of ``rank`` can take on this model (fp32)."""
    per_layer = [
        sum(a + b for a, b in site_shapes(config, i).values()) for i in range(config.num_layers)
    ]
    return 4 * rank * sum(per_layer)


def _read_tensors(
    file: Path, raw: bytes, config: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, target) -> (A, B)`` in fp32, every name, pair, shape, dtype and value checked."""
    try:
        tensors = load_safetensors(raw)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{file}: not a readable safetensors file ({exc})") from None
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = TENSOR_NAME.fullmatch(key)
        if match is None:
            raise AdapterError(
                f"{file}: tensor {key!r} is not a LoRA A/B of a q/k/v/o/gate/up/down "
                "projection of a decoder layer"
            )
        layer, target, half = int(match[1]), match[2], match[3]
        shapes = site_shapes(config, layer) if layer < config.num_layers else {}
        if target not in shapes:
            raise AdapterError(f"{file}: tensor {key!r}: the base model has no such projection")
        size_in, size_out = shapes[target]
        want = (rank, size_in) if half == "A" else (size_out, rank)
        if tensor.dtype not in ADAPTER_DTYPES or tuple(tensor.shape) != want:
            raise AdapterError(
                f"{file}: tensor {key!r} is {tensor.dtype} {list(tensor.shape)}; this base "
                f"model needs a float tensor of shape {list(want)}"
            )
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{file}: tensor {key!r} holds NaN or infinite values")
        halves[(layer, target, half)] = tensor.float()
    pairs = {}
    for layer, target, half in halves:
        other = "B" if half == "A" else "A"
        if (layer, target, other) not in halves:
            raise AdapterError(
                f"{file}: layer {layer} {target}_proj has lora_{half} but no lora_{other}"
            )
        pairs[(layer, target)] = (halves[(layer, target, "A")], halves[(layer, target, "B")])
    if not pairs:
        raise AdapterError(f"{file}: no LoRA tensors")
    return pairs


def _stack(
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    config: ModelConfig,
    scaling: float,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer and site: A stacked over the site's targets, B block-diagonal over them."""
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for layer in range(config.num_layers):
        shapes = site_shapes(config, layer)
        sites = {}
        for site, targets in SITES.items():
            present = [t for t in targets if (layer, t) in pairs]
            if not present:
                continue
            a = torch.cat([pairs[(layer, t)][0] for t in present])
            out = sum(shapes[t][1] for t in targets)
            b = torch.zeros(out, a.shape[0])
            row, col = 0, 0
            for target in targets:
                if target in present:
                    lora_b = pairs[(layer, target)][1]
                    b[row : row + lora_b.shape[0], col : col + lora_b.shape[1]] = lora_b * scaling
                    col += lora_b.shape[1]
                row += shapes[target][1]
            sites[site] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
        layers.append(sites)
    return layers


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for ``LLM.generate``, as vLLM names one: loaded on first use."""

    lora_name: str
    lora_path: str


class LoRARegistry:
    """The adapters an engine serves, by name (any thread may read or change it)."""

    def __init__(self) -> None:
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()

    def add(self, adapter: LoRAAdapter, replace: bool = False) -> None:
        with self._lock:
            if adapter.name in self._adapters and not replace:
                raise AdapterError(f"The lora adapter '{adapter.name}' has already been loaded.")
            if adapter.name not in self._adapters and len(self._adapters) >= MAX_LOADED:
                raise AdapterError(f"at most {MAX_LOADED} LoRA adapters may be loaded at once")
            self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRAAdapter:
        with self._lock:
            adapter = self._adapters.get(name)
        if adapter is None:
            raise UnknownAdapter(name)
        return adapter

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._adapters

    def list(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._adapters.values())
