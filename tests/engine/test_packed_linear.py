"""oneDNN prepacked bf16 matmuls against torch's plain ops."""

import pytest
import torch
import torch.nn.functional as F

from engine.models import packed_linear as pl

pytestmark = pytest.mark.skipif(
    not pl.packing_helps(torch.empty(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 on this CPU"
)


def _case(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(96, 64, generator=gen) / 8).to(torch.bfloat16)
    return x, weight


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_packed_linear_is_bit_identical_to_f_linear(rows: int) -> None:
    x, weight = _case(rows)
    bias = torch.randn(96).to(torch.bfloat16)
    packed = pl.pack(weight)
    assert torch.equal(pl.linear(x, packed), F.linear(x, weight))
    assert torch.equal(pl.linear(x, packed, bias), F.linear(x, weight, bias))


def test_fused_epilogues_match_the_unfused_ops_within_bf16_rounding() -> None:
    x, weight = _case(17)
    packed, other = pl.pack(weight), torch.randn(17, 96).to(torch.bfloat16)
    exact = x.float() @ weight.float().T  # fp32 product of the same bf16 inputs
    for fused, reference in (
        (pl.linear_silu(x, packed), F.silu(exact)),
        (pl.linear_mul(x, packed, other), exact * other.float()),
        (pl.linear_add(x, packed, other), exact + other.float()),
    ):
        assert fused.dtype == torch.bfloat16
        torch.testing.assert_close(fused.float(), reference, rtol=2**-7, atol=2**-7)


def test_only_bf16_cpu_weights_are_packed() -> None:
    assert not pl.packing_helps(torch.empty(1, dtype=torch.float32))
    assert not pl.packing_helps(torch.empty(1, dtype=torch.bfloat16, device="meta"))
