"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k softmax routing, packed experts.

The experts' weights live in two packed tensors, ``w13 [E, 2I, H]`` (gate rows then up rows)
and ``w2 [E, H, I]``. A step routes every token, sorts the (token, expert) assignments by
expert, and runs each expert that received tokens once, as one batched matmul over all its
tokens; results are scattered back with their routing weights by ``index_add_``. The only
Python loop is over experts (at most E iterations per layer), never over tokens.

    router:  p = softmax(x W_r^T) (fp32)  ->  top-k (w, e)  ->  w / sum(w) if norm_topk_prob
    expert:  y[t] += w * down(act(gate(x[t])) * up(x[t]))   for the tokens t routed to e
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kvgate.engine.models.gemm as gemm
from kvgate.engine.models.model_config import ModelConfig
from kvgate.engine.models.params import dense, new_param


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        experts, hidden, size = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router_weight = new_param(experts, hidden, dtype=dtype, device=device)
        self.w13: nn.Parameter | None = new_param(
            experts, 2 * size, hidden, dtype=dtype, device=device
        )
        self.w2: nn.Parameter | None = new_param(experts, hidden, size, dtype=dtype, device=device)
        self.packed: list[tuple[gemm.LinearWeight, gemm.LinearWeight]] = []

    def pack_weights(self) -> None:
        """Packed (gate/up pair, down) per expert for CPU (`gemm`); the 3-D tensors are freed."""
        self.packed = [
            (gemm.pack(w13, gated=True), gemm.pack(w2))
            for w13, w2 in zip(dense(self.w13), dense(self.w2), strict=True)
        ]
        self.w13 = self.w2 = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 ``[T, k]``, expert ids ``[T, k]``), as transformers routes."""
        probs = torch.softmax(F.linear(x, self.router_weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def _expert(self, j: int, h: torch.Tensor) -> torch.Tensor:
        if self.packed:
            gate_up, down = self.packed[j]
            return down.linear(gate_up.linear_gated(h, "silu"))
        gate, up = F.linear(h, dense(self.w13)[j]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, dense(self.w2)[j])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """``residual`` plus the MoE output of ``x [T, H]`` (the output alone when None).

        One gather puts the tokens in expert order, so each expert reads a contiguous slice
        and writes its weighted output into the matching slice; one ``index_add_`` then sums
        each token's k expert outputs."""
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = torch.div(order, self.top_k, rounding_mode="floor")
        picked = weights.flatten().index_select(0, order)[:, None]
        counts = torch.bincount(flat, minlength=self.router_weight.shape[0]).tolist()
        routed = x.index_select(0, tokens)
        expert_out = torch.empty_like(routed, dtype=torch.float32)
        start = 0
        for j, count in enumerate(counts):
            if count:
                end = start + count
                rows = slice(start, end)
                torch.mul(self._expert(j, routed[rows]), picked[rows], out=expert_out[rows])
                start = end
        out = torch.zeros_like(x).index_add_(0, tokens, expert_out.to(x.dtype))
        return out if residual is None else residual + out
