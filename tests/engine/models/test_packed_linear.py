"""oneDNN prepacked bf16 and fp32 matmuls against torch's plain ops, and the packed model's
memory."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvgate.engine.loading.loader import LoadedModel, load_model, load_weights, safetensors_files
from kvgate.engine.models import model_class
from kvgate.engine.models import packed_linear as pl
from kvgate.engine.models.checkpoint import hf_weight_slots
from kvgate.engine.models.gemm import NativeLinear
from tests.engine.models.test_llama import PagedRun

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


def test_row_counts_are_padded_to_few_sizes_with_little_extra_work() -> None:
    sizes = {pl.padded_rows(rows) for rows in range(1, 4097)}
    assert len(sizes) <= 32 + 8 * 7  # oneDNN compiles one kernel per size
    for rows in range(1, 4097):
        assert rows <= pl.padded_rows(rows) <= rows * 9 / 8


@pytest.mark.parametrize("rows", [33, 300, 547])
def test_padded_rows_give_each_row_what_it_gets_alone(rows: int) -> None:
    x, weight = _case(rows, seed=rows)
    packed, other = pl.pack(weight), torch.randn(rows, 96).to(torch.bfloat16)
    assert pl.padded_rows(rows) > rows  # the padded path is the one exercised
    for fused in (
        lambda x, o: pl.linear(x, packed),
        lambda x, o: pl.linear_silu(x, packed),
        lambda x, o: pl.linear_mul(x, packed, o),
        lambda x, o: pl.linear_add(x, packed, o),
    ):
        out = fused(x, other)
        assert out.shape == (rows, 96) and out.is_contiguous()
        torch.testing.assert_close(out[-3:], fused(x[-3:], other[-3:]), atol=0.02, rtol=0.02)


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


def test_fp32_packed_matmuls_match_f_linear_within_fp32_rounding() -> None:
    x, weight = (t.float() for t in _case(8))
    packed, other = pl.pack(weight), torch.randn(8, 96)
    exact = x.double() @ weight.double().T
    for fused, reference in (
        (pl.linear(x, packed), exact),
        (pl.linear_silu(x, packed), F.silu(exact)),
        (pl.linear_mul(x, packed, other), exact * other.double()),
        (pl.linear_add(x, packed, other), exact + other.double()),
    ):
        assert fused.dtype == torch.float32
        torch.testing.assert_close(fused.double(), reference, rtol=1e-5, atol=1e-5)


def test_fp32_and_bf16_cpu_weights_are_packed() -> None:
    assert pl.packing_helps(torch.empty(1, dtype=torch.float32))
    assert not pl.packing_helps(torch.empty(1, dtype=torch.float16))
    assert not pl.packing_helps(torch.empty(1, dtype=torch.bfloat16, device="meta"))


def _unpacked(lm: LoadedModel) -> LoadedModel:
    """The same checkpoint loaded as `lm` was, but without packing: the plain F.linear model."""
    model = model_class(lm.config.architecture)(lm.config, lm.dtype, "cpu")
    load_weights(model, safetensors_files(lm.path))
    return replace(lm, model=model.eval())


def _greedy(
    lm: LoadedModel, ids: list[int], steps: int, fed: list[int] | None = None
) -> tuple[list[int], torch.Tensor, list[float]]:
    """Each step's argmax, the prompt's logits, and each step's margin between its top two
    logits; the next input is the argmax, or the token of ``fed`` (teacher forcing)."""
    run = PagedRun(lm)
    seq = run.add_sequence(len(ids) + steps)
    logits = run.step([seq], [ids], [len(ids)])
    first, tokens, margins = logits, [], []
    for i in range(steps):
        top = logits[-1].float().topk(2)
        tokens.append(int(logits[-1].argmax()))
        margins.append(float(top.values[0] - top.values[1]))
        token = tokens[-1] if fed is None else fed[i]
        logits = run.step([seq], [[token]], [len(ids) + i + 1])
    return tokens, first, margins


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("checkpoint", ["tiny-untied", "qwen2-tied-bias"])
def test_packed_model_keeps_one_copy_of_the_weights_and_decodes_the_same(
    checkpoint: str, dtype: torch.dtype, tiny_model_dir: Path, hf_checkpoint
) -> None:
    path = tiny_model_dir if checkpoint == "tiny-untied" else hf_checkpoint("qwen2")
    lm = load_model(path, dtype=dtype)
    size = dtype.itemsize
    reference = _unpacked(lm)
    c = lm.config

    # Left as parameters: the norms, any qkv bias, and the embedding, but for a tied one that
    # our kernel's lm_head copy holds (and serves the lookup from).
    tied_once = c.tie_word_embeddings and isinstance(lm.model.lm_head_packed, NativeLinear)
    elements = (0 if tied_once else c.vocab_size * c.hidden_size) + (
        2 * c.num_layers + 1
    ) * c.hidden_size
    if c.attention_bias:
        elements += c.num_layers * (c.q_size + 2 * c.kv_size)
    held = sum(p.untyped_storage().nbytes() for p in lm.model.parameters())
    unpacked = sum(p.untyped_storage().nbytes() for p in reference.model.parameters())
    assert held == size * elements
    assert unpacked > 2 * held  # the matmul weights dominate even in these small models

    hidden = torch.randn(5, c.hidden_size).to(dtype)
    lm_head = (
        reference.model.embed_weight if c.tie_word_embeddings else reference.model.lm_head_weight
    )
    # Each rounds an fp32 sum once to the dtype, summed in another order: in bf16 one unit in
    # the last place apart now and then (oneDNN's AMX kernels on a Xeon).
    rtol = 2**-7 if dtype == torch.bfloat16 else 0
    torch.testing.assert_close(
        lm.model.compute_logits(hidden), F.linear(hidden, lm_head).float(), rtol=rtol, atol=1e-5
    )

    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    expected_tokens, expected_logits, margins = _greedy(reference, ids, steps=12)
    tokens, logits, _ = _greedy(lm, ids, steps=12, fed=expected_tokens)
    # On the reference's path, the same token wherever its top two logits are apart by more
    # than rounding can move them (these random models often tie in bf16).
    clear = [i for i, margin in enumerate(margins) if margin > (0.03 if size == 2 else 1e-4)]
    assert len(clear) >= 6
    assert [tokens[i] for i in clear] == [expected_tokens[i] for i in clear]
    # Fused epilogues: bf16 rounding only; fp32: another summation order.
    assert (logits - expected_logits).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-4)
    with pytest.raises(RuntimeError, match="released"):
        hf_weight_slots(lm.model)
