"""A model's parameters, allocated uninitialised (the loader fills them from the checkpoint)."""

from __future__ import annotations

import torch
from torch import nn


def new_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
