"""A model's parameters, allocated uninitialised (the loader fills them from the checkpoint)."""

from __future__ import annotations

import torch
from torch import nn


def new_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def dense(weight: torch.Tensor | None) -> torch.Tensor:
    """A matmul weight that packing has not yet replaced: packing frees the dense copy (its
    module then reads only the packed one), so reaching for it after is a bug, said here."""
    if weight is None:
        raise RuntimeError("a packed module's dense weight was read after packing freed it")
    return weight
