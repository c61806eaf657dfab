"""Sampling: greedy, filters, penalties and min_tokens against reference computations,
per-request seeds independent of the batch, logprobs, and no row able to fail or change
another row."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from kvgate.engine.sampling.sampler import (
    argmax,
    filtered_probs,
    plain_greedy,
    processed_logits,
    sample,
)
from kvgate.engine.sampling_params import MAX_SEED, SamplingParams

VOCAB = 50
EOS = 1
GREEDY = SamplingParams(temperature=0)


@dataclass
class Row:
    """One request as the sampler sees it (kvgate.engine.core.request.Request in the engine)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset({EOS})
    grammar: object = None


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[Row]:
    return [Row(p, g) for p, g in zip(params, generators, strict=True)]


def test_greedy_is_argmax_with_first_index_on_ties() -> None:
    logits = _logits(4)
    logits[3] = 0.0
    logits[3, [7, 11]] = 5.0
    result = sample(logits, _rows([GREEDY] * 4, [None] * 4))
    assert result.token_ids[:3] == logits[:3].argmax(-1).tolist()
    assert result.token_ids[3] == 7
    assert result.logprobs == [None] * 4


def test_top_k_one_tiny_top_p_and_tiny_temperature_are_greedy() -> None:
    logits = _logits(9)
    params = (
        [SamplingParams(temperature=1.5, top_k=1)] * 3
        + [SamplingParams(top_p=1e-6)] * 2
        + [SamplingParams(top_p=5e-324)]  # 0 in fp32
        + [SamplingParams(temperature=t) for t in (1e-300, 5e-324, 9e-6)]  # below 1e-5
    )
    assert all(p.greedy for p in params[-3:])
    result = sample(logits, _rows(params, [_gen(i) for i in range(9)]))
    assert result.token_ids == logits.argmax(-1).tolist()


def test_huge_temperature_is_uniform_and_finite() -> None:
    logits = _logits(2)
    for temperature in (1e30, 1e300, 1.7e308):
        probs = filtered_probs(logits, [SamplingParams(temperature=temperature, top_k=7)] * 2)
        assert torch.isfinite(probs).all()
        assert ((probs > 0).sum(-1) == 7).all()
        torch.testing.assert_close(probs.max(-1).values, torch.full((2,), 1 / 7))


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
    # top_p = 1 next to a filtered row keeps every token, however the cumulative sum rounds
    both = filtered_probs(logits.repeat(2, 1), [SamplingParams(top_p=1.0), SamplingParams(top_k=2)])
    torch.testing.assert_close(both[0], full)


def _seeded_draws(params: SamplingParams, position: int | None, steps: int = 8) -> list[int]:
    """Draw `steps` tokens for one seeded request, alone or at `position` in a batch of 3."""
    row, gen, draws = _logits(1, seed=5), _gen(1234), []
    for step in range(steps):
        batch = [(row, params, gen)]
        if position is not None:
            others = _logits(2, seed=100 + step)
            batch = [
                (
                    others[:1],
                    SamplingParams(temperature=0.7, top_k=5, presence_penalty=1),
                    _gen(step),
                ),
                (others[1:], SamplingParams(temperature=0, repetition_penalty=1.5), None),
            ]
            batch.insert(position, (row, params, gen))
        logits, batch_params, gens = zip(*batch, strict=True)
        result = sample(torch.cat(logits), _rows(list(batch_params), list(gens)))
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
    row = Row(SamplingParams(), _gen(0))
    draws = [sample(logits, [row]).token_ids[0] for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_logprobs_top_n_plus_sampled_token() -> None:
    logits = _logits(3)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.0, logprobs=0),
        GREEDY,
    ]
    result = sample(logits, _rows(params, [None, _gen(3), None]))
    reference = logits.log_softmax(-1)
    top = reference[0].topk(3)
    assert list(result.logprobs[0]) == top.indices.tolist()
    assert list(result.logprobs[0].values()) == top.values.tolist()
    assert result.token_ids[0] in result.logprobs[0]
    assert list(result.logprobs[1]) == [result.token_ids[1]]
    assert result.logprobs[1][result.token_ids[1]] == float(reference[1, result.token_ids[1]])
    assert result.logprobs[2] is None


def test_twenty_logprobs_over_a_smaller_vocabulary_return_all_of_it() -> None:
    logits = torch.randn(2, 8, generator=_gen(0))
    result = sample(logits, _rows([SamplingParams(temperature=0, logprobs=20)] * 2, [None] * 2))
    assert [len(entry) for entry in result.logprobs] == [8, 8]
    torch.testing.assert_close(
        torch.tensor(list(result.logprobs[0].values())).exp().sum(), torch.tensor(1.0)
    )


# -- penalties and min_tokens against references --------------------------------------------

PROMPT = [3, 4, 4, 9, 60]  # 60 is beyond the model's 50 logits: a tokenizer-only id
OUTPUT = [4, 7, 7, 7, 12]


def test_repetition_penalty_matches_transformers() -> None:
    logits = _logits(3, seed=1)
    rows = [
        Row(SamplingParams(temperature=0, repetition_penalty=1.7), None, PROMPT + OUTPUT, 5),
        Row(SamplingParams(temperature=0, repetition_penalty=0.6), None, PROMPT + OUTPUT, 5),
        Row(GREEDY, None, PROMPT + OUTPUT, 5),
    ]
    got = processed_logits(logits, rows)
    for i, penalty in enumerate((1.7, 0.6)):
        reference = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([PROMPT + OUTPUT]), logits[i : i + 1].clone()
        )
        torch.testing.assert_close(got[i : i + 1], reference, rtol=0, atol=0)
    assert torch.equal(got[2], logits[2])  # the unpenalized row is untouched


def test_presence_and_frequency_penalties_follow_openai() -> None:
    """OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c counting generated tokens."""
    logits = _logits(2, seed=2)
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=-1.25)
    rows = [Row(params, None, PROMPT + OUTPUT, 5), Row(GREEDY, None, PROMPT + OUTPUT, 5)]
    got = processed_logits(logits, rows)
    expected = logits[0].clone()
    for token, count in Counter(OUTPUT).items():
        expected[token] -= count * -1.25 + 0.5
    torch.testing.assert_close(got[0], expected)
    assert got[0, 3] == logits[0, 3]  # prompt-only tokens carry no OpenAI penalty
    assert torch.equal(got[1], logits[1])


def test_all_penalties_compose_in_vllm_order() -> None:
    logits = _logits(1, seed=3)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3)
    got = processed_logits(logits, [Row(params, None, PROMPT + OUTPUT, 5)])
    reference = RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor([PROMPT + OUTPUT]), logits.clone()
    )
    for token, count in Counter(OUTPUT).items():
        reference[0, token] -= count * 0.5 + 1.0
    torch.testing.assert_close(got, reference)


def test_min_tokens_masks_eos_and_stop_ids_like_transformers_until_reached() -> None:
    logits = _logits(1, seed=4)
    logits[0, EOS] = 50.0  # EOS would win
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5, 999])
    stops = [EOS, 5]
    for generated in range(5):
        row = Row(params, None, PROMPT + OUTPUT[:generated], 5)
        got = processed_logits(logits, [row])
        reference = MinNewTokensLengthLogitsProcessor(5, 3, stops)(
            torch.tensor([row.token_ids]), logits.clone()
        )
        assert torch.equal(got, reference)
        assert (sample(logits, [row]).token_ids[0] == EOS) == (generated >= 3)
    ignoring = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    got = processed_logits(logits, [Row(ignoring, None, PROMPT, 5)])
    assert got[0, EOS] == 50.0 and got[0, 5] == float("-inf")


def test_features_off_cost_nothing_and_change_nothing() -> None:
    logits = _logits(4)
    rows = [Row(SamplingParams(min_tokens=0), None, PROMPT + OUTPUT, 5) for _ in range(4)]
    assert processed_logits(logits, rows) is logits  # no copy on the plain path


# -- nothing one row asks for can fail or change another row --------------------------------


def test_a_row_with_non_finite_logits_degrades_alone() -> None:
    logits = _logits(4)
    logits[1, 3] = float("inf")
    logits[2, :] = float("nan")
    params = [GREEDY, SamplingParams(top_p=0.5), SamplingParams(top_k=3), GREEDY]
    result = sample(logits, _rows(params, [None, _gen(1), _gen(2), None]))
    assert result.token_ids[0] == int(logits[0].argmax()) and result.token_ids[1] == 3
    assert result.token_ids[3] == int(logits[3].argmax())


def test_banning_every_token_falls_back_to_the_raw_argmax() -> None:
    logits = _logits(2)
    everything = SamplingParams(min_tokens=1, stop_token_ids=list(range(VOCAB)))
    rows = [Row(everything, _gen(0), [5], 1), Row(GREEDY, None, [5], 1)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def _floats(low: float, high: float, extremes: list[float]) -> st.SearchStrategy[float]:
    return st.one_of(
        st.floats(low, high, allow_nan=False, allow_infinity=False), st.sampled_from(extremes)
    )


ANY_MAX_TOKENS = st.integers(1, 10**9)


@st.composite
def valid_params(
    draw: st.DrawFn, max_tokens: st.SearchStrategy[int] = ANY_MAX_TOKENS
) -> SamplingParams:
    """Anything SamplingParams accepts, the numeric corners weighted in."""
    max_tokens = draw(max_tokens)
    stop_ids = st.lists(st.integers(0, 10**30), max_size=6) | st.just(list(range(VOCAB)))
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(max_tokens, 8)) | st.just(max_tokens)),
        temperature=draw(_floats(0, 1e308, [0.0, 5e-324, 1e-300, 1e-5, 1e30, 1.7e308])),
        top_p=draw(_floats(5e-324, 1.0, [5e-324, 1e-300, 1e-8, 1.0 - 1e-16, 1.0])),
        top_k=draw(st.integers(-1, 10**30) | st.sampled_from([-1, 0, 1, VOCAB - 1, VOCAB])),
        seed=draw(st.none() | st.integers(0, MAX_SEED)),
        presence_penalty=draw(_floats(-2, 2, [-2.0, 2.0])),
        frequency_penalty=draw(_floats(-2, 2, [-2.0, 2.0])),
        repetition_penalty=draw(_floats(5e-324, 1.7e308, [5e-324, 1e-300, 1.0, 1e300, 1.7e308])),
        stop=draw(st.lists(st.text(min_size=1, max_size=3), max_size=2)),
        stop_token_ids=draw(stop_ids),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, 20)),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=valid_params(),
    history=st.lists(st.integers(0, VOCAB + 10), min_size=1, max_size=40),
    prompt_len=st.integers(1, 40),
    scale=st.sampled_from([1e-3, 3.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_no_valid_arguments_can_fail_or_change_a_neighbours_greedy_token(
    params: SamplingParams, history: list[int], prompt_len: int, scale: float, seed: int
) -> None:
    logits = torch.randn(3, VOCAB, generator=_gen(seed)) * scale
    generator = _gen(params.seed or 0) if not params.greedy else None
    neighbour = Row(GREEDY, None, history, min(prompt_len, len(history)))
    hostile = Row(params, generator, history, min(prompt_len, len(history)))
    result = sample(logits, [neighbour, hostile, neighbour])
    assert result.token_ids[0] == int(logits[0].argmax())
    assert result.token_ids[2] == int(logits[2].argmax())
    token = result.token_ids[1]
    assert 0 <= token < VOCAB
    entry = result.logprobs[1]
    assert (entry is None) == (params.logprobs is None)
    if entry is not None:
        assert token in entry and len(entry) <= min(params.logprobs, VOCAB) + 1
        assert all(math.isfinite(v) and v <= 0 for v in entry.values())


def test_logit_bias_is_added_before_temperature_and_leaves_bans_and_logprobs() -> None:
    logits = _logits(3)
    top = int(logits[0].argmax())
    low = int(logits[0].argmin())
    biased = SamplingParams(temperature=0, logit_bias={low: 100.0, top: -100.0}, logprobs=0)
    banned = SamplingParams(temperature=0, min_tokens=2, logit_bias={EOS: 100.0})
    rows = [Row(biased), Row(GREEDY), Row(banned)]
    processed = processed_logits(logits, rows)
    expected = logits[0].clone()
    expected[low] += 100.0
    expected[top] -= 100.0
    assert torch.equal(processed[0], expected) and torch.equal(processed[1], logits[1])
    assert processed[2, EOS] == float("-inf")  # min_tokens still bans what the bias favours
    result = sample(logits, rows)
    assert result.token_ids[0] == low and result.token_ids[1] == int(logits[1].argmax())
    raw = logits[0].log_softmax(-1)[low].item()
    assert result.logprobs[0] == {low: pytest.approx(raw)}  # logprobs stay the raw ones
    # Before temperature: a bias of 1 at temperature 0.5 is a factor e**2 in probability.
    warm = SamplingParams(temperature=0.5, logit_bias={0: 1.0})
    flat = torch.zeros(1, VOCAB)
    probs = filtered_probs(processed_logits(flat, [Row(warm)]), [warm])
    assert probs[0, 0] / probs[0, 1] == pytest.approx(math.e**2)


@pytest.mark.parametrize(
    "params, history, plain",
    [
        (GREEDY, [], True),
        (SamplingParams(temperature=0, min_tokens=2), [5], False),  # stops still banned
        (SamplingParams(temperature=0, min_tokens=1), [5], True),  # the ban is over
        (SamplingParams(temperature=0, logprobs=0), [], False),
        (SamplingParams(temperature=0, repetition_penalty=1.2), [], False),
        (SamplingParams(temperature=0, logit_bias={3: 1.0}), [], False),
        (SamplingParams(temperature=0.8), [], False),
    ],
)
def test_plain_greedy_only_where_sample_would_take_the_raw_argmax(
    params: SamplingParams, history: list[int], plain: bool
) -> None:
    row = Row(params, token_ids=history, num_prompt_tokens=0)
    assert plain_greedy([Row(GREEDY), row]) is plain
    if plain:  # then the raw argmax, in the model dtype too, is what sample picks
        logits = _logits(2)
        want = sample(logits, [Row(GREEDY), row]).token_ids
        assert argmax(logits).tolist() == want
        assert argmax(logits.bfloat16()).tolist() == logits.bfloat16().argmax(-1).tolist()


def test_plain_greedy_excludes_a_grammar_row() -> None:
    assert not plain_greedy([Row(GREEDY, grammar=object())])
