"""Choosing the attention implementation: Triton kernels on CUDA, the PyTorch reference on CPU
with its decode rows and prefills on the native kernels (`kvgate.engine.attention.cpu`) where they
build, and its bf16 prefills on SDPA's fused kernel where the CPU has AMX (`cpu_backend`).

A backend is a small object with the two operations a layer needs, ``write_kv`` and
``paged_attention``; the engine picks one at startup and calls it for every layer.
Triton is imported only when the Triton backend is asked for, so the CPU path never needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kvgate.engine.attention.torch_backend as torch_backend
from kvgate.engine.attention.cpu import native_decode, native_prefill
from kvgate.engine.attention.kv_cache import KVCache
from kvgate.engine.config import cpu_flags

BACKEND_NAMES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[[KVCache, torch.Tensor, torch.Tensor, torch.Tensor], None]
    # paged_attention(q, cache, metadata, scale, window=None, softcap=None)
    paged_attention: Callable[..., torch.Tensor]
    # The kernel paged_attention gives decode rows to, where it is a native one: a model may
    # then run its decode layers natively end to end (`kvgate.engine.models.decode_stack`).
    decode_kernel: torch_backend.DecodeKernel | None = None


TORCH_BACKEND = AttentionBackend("torch", torch_backend.write_kv, torch_backend.paged_attention)


def cpu_backend(
    flags: frozenset[str],
    decode_kernel: torch_backend.DecodeKernel | None = None,
    prefill_kernel: torch_backend.PrefillKernel | None = None,
) -> AttentionBackend:
    """The torch backend for a CPU with ``flags``: bf16 attention on SDPA where there is AMX,
    decode rows on ``decode_kernel``, the other prefills on ``prefill_kernel`` where given."""
    if decode_kernel is None and prefill_kernel is None and "amx_bf16" not in flags:
        return TORCH_BACKEND
    attention = functools.partial(
        torch_backend.paged_attention,
        fused="amx_bf16" in flags,
        decode_kernel=decode_kernel,
        prefill_kernel=prefill_kernel,
    )
    return AttentionBackend("torch", torch_backend.write_kv, attention, decode_kernel)


def _triton_usable(device: torch.device) -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return device.type == "cuda" or (device.type == "cpu" and interpreted)


def get_attention_backend(
    name: str = "auto", device: torch.device | str = "cpu"
) -> AttentionBackend:
    """``auto``: Triton on CUDA, torch elsewhere. ``triton`` on CPU needs ``TRITON_INTERPRET=1``."""
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend: expected one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        if device.type != "cpu":
            return TORCH_BACKEND
        return cpu_backend(cpu_flags(), native_decode(), native_prefill())
    if not _triton_usable(device):
        raise ValueError(
            f"attention_backend: triton needs a CUDA device (or TRITON_INTERPRET=1), got {device}"
        )
    if importlib.util.find_spec("triton") is None:  # a CUDA torch brings it, a CPU one does not
        raise ValueError("attention_backend: triton is not installed (pip install triton)")
    from kvgate.engine.attention.triton import backend as triton_backend

    return AttentionBackend("triton", triton_backend.write_kv, triton_backend.paged_attention)
