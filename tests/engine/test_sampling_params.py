"""SamplingParams: every bad value is an ``InvalidArgument`` (a ValueError) naming its field;
the greedy threshold; ``given``, the fields the caller chose."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgate.engine.errors import InvalidArgument, TooManyTokens
from kvgate.engine.sampling_params import GREEDY_BELOW, MAX_SEED, SamplingParams, StructuredOutputs


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
    with pytest.raises(InvalidArgument, match=field) as raised:
        SamplingParams(**fields)
    assert raised.value.field == field and isinstance(raised.value, ValueError)
    with pytest.raises(InvalidArgument, match=field) as raised:
        SamplingParams.from_dict(fields)
    assert raised.value.field == field


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"regex": "a", "choice": ["b"]},
        {"json": 5},
        {"structural_tag": 5},
        {"json_object": 1},
        {"regex": ""},
        {"grammar": 5},
        {"choice": []},
        {"choice": ["a", ""]},
        {"regexp": "a"},
        {"json": "{not json"},
        {"structural_tag": "{not json"},
        {"json": "[" * 5000},
        "a+",
    ],
)
def test_bad_constraints_name_structured_outputs(spec: object) -> None:
    with pytest.raises(InvalidArgument, match="structured_outputs") as raised:
        SamplingParams.from_dict({"structured_outputs": spec})
    assert raised.value.field == "structured_outputs"
    if isinstance(spec, dict) and "regexp" not in spec:
        with pytest.raises(InvalidArgument, match="structured_outputs"):
            StructuredOutputs(**spec)


def test_json_text_is_read_once_as_its_document() -> None:
    text = StructuredOutputs(json='{"type": "object"}')
    assert text.document == {"type": "object"} and text.value == '{"type": "object"}'
    assert StructuredOutputs(regex="[a-z]").document == "[a-z]"  # not JSON text: as given


def test_an_unknown_field_is_named() -> None:
    for name in ("temprature", "given"):  # ``given`` is not the caller's to set
        with pytest.raises(InvalidArgument, match=f"unknown sampling field '{name}'") as raised:
            SamplingParams.from_dict({name: 0.5})
        assert raised.value.field == name


def test_too_many_tokens_is_still_a_value_error() -> None:
    error = TooManyTokens("too long", at_least=10, limit=5)
    assert isinstance(error, ValueError) and (error.at_least, error.limit) == (10, 5)


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


def test_given_is_the_callers_fields_explicit_defaults_included() -> None:
    params = SamplingParams.from_dict(
        {"temperature": 1.0, "top_k": -1, "seed": 3}, defaults={"top_p": 0.9, "temperature": 0.6}
    )
    assert params.given == {"temperature", "top_k", "seed"}  # not the defaults' top_p
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.9, 0)
    assert params == SamplingParams(top_p=0.9, seed=3)  # given is not compared
    assert "given" not in repr(params)
    assert SamplingParams.from_dict({}).given == frozenset()


def test_given_of_direct_construction_is_what_differs_from_the_defaults() -> None:
    assert SamplingParams().given == frozenset()
    assert SamplingParams(temperature=0, top_k=-1, stop="x").given == {"temperature", "stop"}
    assert SamplingParams(given=frozenset({"top_p"})).given == {"top_p"}
    with pytest.raises(InvalidArgument, match="given") as raised:
        SamplingParams(given=frozenset({"temprature"}))
    assert raised.value.field == "given"


def test_given_survives_replace_and_with_fields_adds_to_it() -> None:
    params = SamplingParams.from_dict({"seed": 1})
    assert replace(params, seed=2).given == {"seed"}
    changed = params.with_fields(temperature=1.0, top_p=1.0)
    assert changed.given == {"seed", "temperature", "top_p"}
    assert type(changed.given) is frozenset and changed.temperature == 1.0


@pytest.mark.parametrize(
    "bias",
    [
        {5: 100.5},
        {5: -101},
        {5: float("nan")},
        {5: float("inf")},
        {5: "1"},
        {5: True},
        {"5": 1.0},
        {-1: 1.0},
        {True: 1.0},
        [5, 1.0],
    ],
)
def test_bad_logit_bias_is_named(bias: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    assert caught.value.field == "logit_bias"


def test_logit_bias_edges_and_arrays() -> None:
    params = SamplingParams.from_dict({"logit_bias": {3: 100, 7: -100.0, 9: 0.5}})
    assert "logit_bias" in params.given
    ids, values = params.logit_bias_arrays
    assert list(ids) == [3, 7, 9] and list(values) == [100.0, -100.0, 0.5]
