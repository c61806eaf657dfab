"""SamplingParams: every bad value is a ValueError naming its field; the greedy threshold."""

from __future__ import annotations

import pytest

from engine.sampling_params import GREEDY_BELOW, MAX_SEED, SamplingParams


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(temperature=-1e-9), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(seed=MAX_SEED + 1), "seed"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=3), "stop_token_ids"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
    ],
)
def test_bad_values_name_their_field(fields: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**fields)


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_the_edges_are_accepted() -> None:
    edges = SamplingParams(
        max_tokens=3,
        min_tokens=3,
        temperature=1e308,
        top_p=5e-324,
        top_k=-1,
        seed=MAX_SEED,
        presence_penalty=-2,
        frequency_penalty=2.0,
        repetition_penalty=5e-324,
        stop="x",
        logprobs=20,
    )
    assert edges.top_k == 0 and edges.stop == ["x"] and edges.penalized


def test_below_the_epsilon_is_greedy_as_in_vllm() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    assert not SamplingParams().penalized
    assert SamplingParams(repetition_penalty=1.1).penalized
