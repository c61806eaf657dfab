"""Sampling: greedy, filters, per-request seeds independent of the batch, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import filtered_probs, sample
from engine.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_with_first_index_on_ties() -> None:
    logits = _logits(4)
    logits[3] = 0.0
    logits[3, [7, 11]] = 5.0
    result = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert result.token_ids[:3] == logits[:3].argmax(-1).tolist()
    assert result.token_ids[3] == 7
    assert result.logprobs == [None] * 4


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 3 + [SamplingParams(top_p=1e-6)] * 3
    result = sample(logits, params, [_gen(i) for i in range(6)])
    assert result.token_ids == logits.argmax(-1).tolist()


def test_filters_keep_the_right_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = filtered_probs(logits, [SamplingParams(top_k=3)])
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]
    full = logits.softmax(-1)[0]  # top_p just above p0 + p1 keeps exactly three tokens
    probs = filtered_probs(logits, [SamplingParams(top_p=float(full[:2].sum()) + 1e-3)])
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]
    torch.testing.assert_close(probs[0, :3], full[:3] / full[:3].sum())
    hot = filtered_probs(logits, [SamplingParams(temperature=2.0)])
    torch.testing.assert_close(hot[0], (logits[0] / 2).softmax(-1))


def _seeded_draws(params: SamplingParams, position: int | None, steps: int = 8) -> list[int]:
    """Draw `steps` tokens for one seeded request, alone or at `position` in a batch of 3."""
    row, gen, draws = _logits(1, seed=5), _gen(1234), []
    for step in range(steps):
        batch = [(row, params, gen)]
        if position is not None:
            others = _logits(2, seed=100 + step)
            batch = [
                (others[:1], SamplingParams(temperature=0.7, top_k=5), _gen(step)),
                (others[1:], SamplingParams(temperature=0), None),
            ]
            batch.insert(position, (row, params, gen))
        logits, batch_params, gens = zip(*batch, strict=True)
        result = sample(torch.cat(logits), list(batch_params), list(gens))
        draws.append(result.token_ids[position or 0])
    return draws


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234), SamplingParams(seed=1234)],
)
def test_same_seed_same_tokens_whatever_the_batch(params: SamplingParams) -> None:
    alone = _seeded_draws(params, None)
    assert _seeded_draws(params, 0) == _seeded_draws(params, 1) == alone
    assert _seeded_draws(params, 2) == alone
    assert len(set(alone)) > 1  # really sampling, not stuck on the argmax


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = _gen(0)
    draws = [sample(logits, [SamplingParams()], [gen]).token_ids[0] for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_logprobs_top_n_plus_sampled_token() -> None:
    logits = _logits(3)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=0),
    ]
    result = sample(logits, params, [None, _gen(3), None])
    reference = logits.log_softmax(-1)
    top = reference[0].topk(3)
    assert list(result.logprobs[0]) == top.indices.tolist()
    assert list(result.logprobs[0].values()) == top.values.tolist()
    assert result.token_ids[0] in result.logprobs[0]
    assert list(result.logprobs[1]) == [result.token_ids[1]]
    assert result.logprobs[1][result.token_ids[1]] == float(reference[1, result.token_ids[1]])
    assert result.logprobs[2] is None
