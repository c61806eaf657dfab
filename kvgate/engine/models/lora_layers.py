"""LoRA deltas for one step's rows: several adapters and the base model in one batch.

The adapters present in a step are stacked per fused site (qkv, o, gate_up, down; see
``kvgate.engine.models.lora``): ``A`` of every adapter one above the other ``[sum r, in]``, ``B`` side by side
``[out, sum r]``, and each stacked column knows its adapter. A site then adds to the base output

    y += ((x @ A.T) * mask) @ B.T        mask[row, col] = (row's adapter == col's adapter)

two dense matmuls and one small elementwise product over ``[T, sum r]``: a row only ever meets
its own adapter's columns, a base row meets none (its delta is exactly zero), and nothing is
gathered or scattered by row. Stacks are built (and packed as the base weights are: see
``gemm``) once per set of adapters and kept for the next steps.

Measured on a 2-core Zen 4 under load, bench55m in bf16 (``benchmarks/lora.py``): gathering
each group's rows and adding its delta back with ``index_add_`` cost 10 ms per call in bf16
(40% of a mixed step), and one ``bmm`` over per-row gathered ``A``/``B`` copies 6.4 ms at 64
rows against 0.33 ms for grouped products; masked stacks need neither gathers nor copies.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kvgate.engine.models.gemm as gemm
from kvgate.engine.models.lora import SITES, LoRAAdapter

MAX_STACKS = 4  # sets of adapters whose stacked weights are kept (LRU)


@dataclass(frozen=True)
class Stacked:
    """One site's adapters stacked: ``A`` and ``B`` (packed where the base weights are) and, per
    stacked column, the index of its adapter in the step's set."""

    a: gemm.LinearWeight
    b: gemm.LinearWeight
    columns: torch.Tensor

    def delta(self, x: torch.Tensor, row_adapter: torch.Tensor) -> torch.Tensor:
        h = self.a.linear(x)
        h.mul_(row_adapter[:, None] == self.columns[None, :])
        return self.b.linear(h)


@dataclass(frozen=True)
class LayerLoRA:
    """One layer's stacked adapters in this step, and each row's adapter (-1: the base)."""

    row_adapter: torch.Tensor
    sites: dict[str, Stacked]

    def select(self, rows: torch.Tensor) -> LayerLoRA:
        """The same adapters for ``rows`` of the step only."""
        return LayerLoRA(self.row_adapter.index_select(0, rows), self.sites)

    def touches(self, *sites: str) -> bool:
        return any(site in self.sites for site in sites)

    def add(self, y: torch.Tensor, x: torch.Tensor, site: str) -> torch.Tensor:
        """``y`` (the base output of ``x``) with each row's adapter delta added in place."""
        stacked = self.sites.get(site)
        if stacked is not None:
            y.add_(stacked.delta(x, self.row_adapter))
        return y


@dataclass(frozen=True)
class StepLoRA:
    row_adapter: torch.Tensor  # [T] int64: the index of the row's adapter, -1 for the base
    layers: list[dict[str, Stacked]]

    @classmethod
    def of(
        cls,
        adapters: Sequence[LoRAAdapter | None],
        rows: Sequence[int],
        stacks: Stacks,
        device: torch.device,
    ) -> StepLoRA | None:
        """From each request's adapter (None: the base) and its row count, in batch order;
        None when no row has an adapter (the step runs the base model alone)."""
        present: dict[LoRAAdapter, int] = {}
        row_adapter: list[int] = []
        for adapter, n in zip(adapters, rows, strict=True):
            index = -1 if adapter is None else present.setdefault(adapter, len(present))
            row_adapter += [index] * n
        if not present:
            return None
        layers = stacks.get(tuple(present), device)
        return cls(torch.tensor(row_adapter, dtype=torch.int64, device=device), layers)

    def layer(self, index: int) -> LayerLoRA | None:
        sites = self.layers[index]
        return LayerLoRA(self.row_adapter, sites) if sites else None


class Stacks:
    """Stacked weights per set of adapters, the ``MAX_STACKS`` most recent (any thread)."""

    def __init__(self) -> None:
        self._stacks: OrderedDict[tuple[LoRAAdapter, ...], list[dict[str, Stacked]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, adapters: tuple[LoRAAdapter, ...], device: torch.device
    ) -> list[dict[str, Stacked]]:
        with self._lock:
            found = self._stacks.get(adapters)
            if found is not None:
                self._stacks.move_to_end(adapters)
                return found
        built = [_stack_layer(adapters, i, device) for i in range(len(adapters[0].sites))]
        with self._lock:
            self._stacks[adapters] = built
            while len(self._stacks) > MAX_STACKS:
                self._stacks.popitem(last=False)
        return built


def _stack_layer(
    adapters: tuple[LoRAAdapter, ...], layer: int, device: torch.device
) -> dict[str, Stacked]:
    sites = {}
    for site in SITES:
        parts = [
            (i, a.sites[layer][site]) for i, a in enumerate(adapters) if site in a.sites[layer]
        ]
        if not parts:
            continue
        a = torch.cat([pair[0] for _, pair in parts])
        b = torch.cat([pair[1] for _, pair in parts], dim=1)
        columns = torch.tensor(
            [i for i, pair in parts for _ in range(pair[0].shape[0])], device=device
        )
        sites[site] = Stacked(gemm.pack(a), gemm.pack(b), columns)
    return sites
