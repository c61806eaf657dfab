"""Shared pytest setup: keep torch to the two cores CI has, deterministically."""

import torch

torch.set_num_threads(2)
