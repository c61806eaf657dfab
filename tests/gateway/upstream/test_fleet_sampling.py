"""What fleet mode sends upstream: exactly the sampling fields the caller gave, explicit
defaults included (``temperature: 1.0`` is sent, never left to the upstream's
generation_config), and none it did not give; ``Fleet.tokenize_request``, vLLM's
``/tokenize`` proxied to an upstream and its answer checked; and ``Fleet.embed``, proxied to
the upstream's ``/v1/embeddings``.

The ``request_body`` tests are pure; the others run real processes on loopback: a
``recording_upstream`` (records every body it is sent) behind a ``kvgate serve --upstream``
gateway, and a kvgate engine upstream (the tiny model) for ``/tokenize``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from kvgate.engine.errors import EngineOverloaded, EngineUnavailable
from kvgate.engine.loading.tiny_model import default_model_dir
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.calls.errors import BadInput, UpstreamFailed
from kvgate.gateway.generation import EmbeddingsRequest, GenerationRequest
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet
from kvgate.gateway.upstream.wire import request_body
from tests.gateway.live_server import free_port
from tests.gateway.upstream import recording_upstream
from tests.gateway.upstream.processes import Process, call_tool, gateway, running

SAMPLING = frozenset(f.name for f in fields(SamplingParams) if f.name != "given")
MESSAGES = [{"role": "user", "content": "Hello there"}]
# Every sampling field the OpenAI API (with vLLM's extras) takes, each at kvgate's default.
EXPLICIT_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "ignore_eos": False,
    "skip_special_tokens": True,
}
# ... as the upstream must receive them (numbers as floats; top_k off spelled -1).
SENT_DEFAULTS: dict[str, Any] = {
    **EXPLICIT_DEFAULTS,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k in SAMPLING}


# -- request_body, without a door -------------------------------------------------------------


def test_explicit_defaults_are_sent_as_given() -> None:
    given = {
        **EXPLICIT_DEFAULTS,
        "max_tokens": 16,
        "seed": 0,
        "stop": ["\n"],
        "stop_token_ids": [],
    }
    params = SamplingParams.from_dict(given)
    assert params == SamplingParams(seed=0, stop=["\n"])  # the same values as the defaults
    for request in (
        GenerationRequest(params, prompt="hi"),
        GenerationRequest(params, messages=MESSAGES),
    ):
        _, body = request_body(request, "m")
        assert sampling_of(body) == {**given, "top_k": -1}


def test_fields_not_given_are_left_to_the_upstream() -> None:
    for params in (
        SamplingParams.from_dict({"max_tokens": 5}),
        # generation_config defaults fill the params, but they were not the caller's
        SamplingParams.from_dict({"max_tokens": 5}, {"temperature": 0.6, "top_k": 20}),
    ):
        _, body = request_body(GenerationRequest(params, prompt="hi"), "m")
        assert sampling_of(body) == {"max_tokens": 5}
        assert "logprobs" not in body and "structured_outputs" not in body
    # max_tokens is always sent, given or not (kvgate's default then)
    _, body = request_body(GenerationRequest(SamplingParams.from_dict({}), prompt="hi"), "m")
    assert sampling_of(body) == {"max_tokens": 16}


def test_given_survives_replace_and_counts_what_a_door_sets() -> None:
    params = SamplingParams.from_dict({"temperature": 1.0, "seed": 5})
    seeded = replace(params, seed=6)  # the OpenAI door's n-th choice
    assert seeded.given == params.given
    _, body = request_body(GenerationRequest(seeded, prompt="hi"), "m")
    assert sampling_of(body) == {"max_tokens": 16, "temperature": 1.0, "seed": 6}
    # a field a door sets for the caller (special tokens kept for parsing tool calls)
    kept = SamplingParams.from_dict({"skip_special_tokens": False, "top_k": 0})
    _, body = request_body(GenerationRequest(kept, messages=MESSAGES), "m")
    assert sampling_of(body) == {"max_tokens": 16, "skip_special_tokens": False, "top_k": -1}
    later = params.with_fields(top_p=1.0)
    _, body = request_body(GenerationRequest(later, prompt="hi"), "m")
    assert sampling_of(body) == {"max_tokens": 16, "temperature": 1.0, "seed": 5, "top_p": 1.0}


def test_logit_bias_goes_as_json_object_keys() -> None:
    params = SamplingParams.from_dict({"logit_bias": {5: -100.0, 7: 2.5}})
    _, body = request_body(GenerationRequest(params, prompt="hi"), "m")
    assert orjson.loads(orjson.dumps(body))["logit_bias"] == {"5": -100.0, "7": 2.5}


def test_logprobs_and_constraints_keep_their_own_form() -> None:
    params = SamplingParams.from_dict({"logprobs": 0, "structured_outputs": {"regex": "a+"}})
    path, body = request_body(GenerationRequest(params, prompt="hi"), "m")
    assert path == "/v1/completions"
    assert (body["logprobs"], body["structured_outputs"]) == (0, {"regex": "a+"})
    _, chat = request_body(GenerationRequest(params, messages=MESSAGES), "m")
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 0)
    assert chat["structured_outputs"] == {"regex": "a+"}


# -- through a kvgate gateway process, to a recording upstream ---------------------------------


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet-sampling")


@pytest.fixture(scope="module")
def recorder(log_dir: Path) -> Iterator[Process]:
    command = ("-m", "tests.gateway.upstream.recording_upstream")
    with running([Process(log_dir, command=command)], 30) as (started,):
        yield started


@pytest.fixture(scope="module")
def fleet_gateway(log_dir: Path, recorder: Process) -> Iterator[Process]:
    with running([gateway(log_dir, [recorder])], 60) as (started,):
        yield started


def forwarded(recorder: Process, send: Callable[[], Any]) -> list[dict[str, Any]]:
    """The generation bodies the upstream received while ``send`` ran."""
    assert httpx.delete(recorder.base + "/recorded", timeout=5).status_code == 200
    send()
    received = httpx.get(recorder.base + "/recorded", timeout=5).json()
    return [r["body"] for r in received if r["path"] != "/tokenize"]


def post(g: Process, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(g.base + path, json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_send_every_explicit_default(fleet_gateway: Process, recorder: Process) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "seed": 5, "stop": "\n\n", **EXPLICIT_DEFAULTS}
    (sent,) = forwarded(recorder, lambda: post(fleet_gateway, "/v1/completions", body))
    assert sampling_of(sent) == {**SENT_DEFAULTS, "max_tokens": 3, "seed": 5, "stop": ["\n\n"]}
    assert sent["prompt"] == "hi" and sent["model"] == recording_upstream.MODEL


def test_fields_not_given_do_not_reach_the_upstream(
    fleet_gateway: Process, recorder: Process
) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    (sent,) = forwarded(recorder, lambda: post(fleet_gateway, "/v1/completions", body))
    assert sampling_of(sent) == {"max_tokens": 2}
    assert sent["stream"] is False and "stream_options" not in sent  # one JSON answer
    chat = {"messages": MESSAGES}  # no max_tokens either: the gateway's default is sent
    (sent,) = forwarded(recorder, lambda: post(fleet_gateway, "/v1/chat/completions", chat))
    assert sampling_of(sent).keys() == {"max_tokens"}


def test_chat_sends_every_explicit_default_to_each_choice(
    fleet_gateway: Process, recorder: Process
) -> None:
    body = {
        "messages": MESSAGES,
        "max_completion_tokens": 2,
        "n": 2,
        "seed": 5,
        "stop": ["\n\n"],
        **EXPLICIT_DEFAULTS,
    }
    sent = forwarded(recorder, lambda: post(fleet_gateway, "/v1/chat/completions", body))
    assert len(sent) == 2 and all(s["messages"] == MESSAGES and "n" not in s for s in sent)
    assert sorted(s.pop("seed") for s in map(sampling_of, sent)) == [5, 6]  # n seeded choices
    for s in sent:
        assert {**sampling_of(s), "seed": 0} == {
            **SENT_DEFAULTS,
            "max_tokens": 2,
            "seed": 0,
            "stop": ["\n\n"],
        }


def test_an_openai_client_stream_sends_temperature_one(
    fleet_gateway: Process, recorder: Process
) -> None:
    def stream() -> None:
        with openai.OpenAI(
            base_url=fleet_gateway.base + "/v1", api_key="x", max_retries=0
        ) as client:
            chunks = client.chat.completions.create(
                model=recording_upstream.MODEL,
                messages=MESSAGES,
                max_tokens=2,
                temperature=1.0,
                stream=True,
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == recording_upstream.TEXT

    (sent,) = forwarded(recorder, stream)
    assert sampling_of(sent) == {"max_tokens": 2, "temperature": 1.0}


def test_mcp_generate_sends_temperature_one(fleet_gateway: Process, recorder: Process) -> None:
    arguments = {"prompt": "hi", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 3}
    results: list[dict[str, Any]] = []
    (sent,) = forwarded(
        recorder, lambda: results.append(call_tool(fleet_gateway.base, "generate", arguments))
    )
    assert not results[0].get("isError"), results
    assert results[0]["structuredContent"]["text"] == recording_upstream.TEXT
    # max_tokens: the tool's default (64), always sent (the upstream's own default would differ)
    assert sampling_of(sent) == {
        "max_tokens": 64,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": 3,
    }


# -- Fleet.tokenize_request ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def kvgate_upstream(log_dir: Path) -> Iterator[Process]:
    with running([Process(log_dir)]) as (started,):
        yield started


def tokenize(base: str, *bodies: dict[str, Any], **settings: Any) -> list[Any]:
    """``tokenize_request`` of each body through a fleet of the one upstream at ``base``:
    each answer, or the exception it raised."""
    fleet = Fleet.connect(Settings(upstream=(base,), upstream_health_interval_s=0, **settings))

    async def run() -> list[Any]:
        try:
            return await asyncio.gather(
                *(fleet.tokenize_request(b) for b in bodies), return_exceptions=True
            )
        finally:
            await fleet.aclose()

    return asyncio.run(run())


def test_tokenize_request_answers_what_the_upstream_tokenizes(kvgate_upstream: Process) -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir())
    text = "The quick brown fox jumps over the lazy dog."
    plain, strs, bare, chat = tokenize(
        kvgate_upstream.base,
        {"prompt": text},
        {"prompt": text, "return_token_strs": True, "model": "ignored"},
        {"prompt": text, "add_special_tokens": False},
        {"messages": MESSAGES},
    )
    ids = tokenizer.encode(text)
    models = httpx.get(kvgate_upstream.base + "/v1/models", timeout=5).json()
    max_model_len = models["data"][0]["max_model_len"]
    assert plain == {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    assert strs["tokens"] == ids and strs["token_strs"] == [
        tokenizer.backend.id_to_token(i) for i in ids
    ]
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert chat["count"] == len(chat["tokens"]) > 0 and chat["token_strs"] is None


def test_tokenize_request_passes_on_the_upstreams_refusal(kvgate_upstream: Process) -> None:
    (refused,) = tokenize(kvgate_upstream.base, {"prompt": 5})
    assert isinstance(refused, BadInput) and refused.field == "prompt", refused
    assert "prompt" in str(refused) and len(str(refused)) <= 200


def test_tokenize_request_sends_vllms_fields_only(recorder: Process) -> None:
    body = {
        "model": "someone-else",
        "prompt": "hi",
        "add_special_tokens": False,
        "return_token_strs": True,
        "temperature": 0.5,  # not a /tokenize field
    }
    httpx.delete(recorder.base + "/recorded", timeout=5)
    (answer,) = tokenize(recorder.base, body)
    assert answer == {
        "count": 2,
        "max_model_len": recording_upstream.MAX_MODEL_LEN,
        "tokens": [104, 105],
        "token_strs": ["h", "i"],
    }
    (received,) = httpx.get(recorder.base + "/recorded", timeout=5).json()
    assert received == {
        "path": "/tokenize",
        "body": {
            "model": recording_upstream.MODEL,
            "prompt": "hi",
            "add_special_tokens": False,
            "return_token_strs": True,
        },
    }


def test_tokenize_request_refuses_what_cannot_be_relayed(recorder: Process) -> None:
    faults = recording_upstream.TOKENIZE_FAULTS
    results = tokenize(recorder.base, *({"prompt": p} for p in faults))
    answers = dict(zip(faults, results, strict=True))
    malformed = [p for p, (status, _, _) in faults.items() if status == 200]
    for prompt in [*malformed, "broken"]:
        assert isinstance(answers[prompt], UpstreamFailed), (prompt, answers[prompt])
    assert "over" in str(answers["huge"]) and "bytes" in str(answers["huge"])
    refused = answers["refuse"]
    assert isinstance(refused, BadInput) and refused.field == "prompt"
    assert str(refused) == recording_upstream.LONG_MESSAGE[:200]
    flat = answers["refuse-flat"]
    assert isinstance(flat, BadInput) and str(flat) == "bad prompt" and flat.field is None
    busy = answers["busy"]
    assert isinstance(busy, EngineOverloaded) and busy.retry_after_s == 7


def test_tokenize_request_without_an_answer_marks_the_upstream_failed() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = Settings(upstream=(url,), upstream_unhealthy_after=1, upstream_cooldown_s=60)
    fleet = Fleet(settings, "m", 4096, [url])

    async def run() -> None:
        try:
            with pytest.raises(EngineUnavailable, match="(?i)cannot connect"):
                await fleet.tokenize_request({"prompt": "hi"})
            assert not fleet.upstreams[0].breaker.healthy
            with pytest.raises(EngineUnavailable, match="no healthy upstream"):
                await fleet.tokenize_request({"prompt": "hi"})
        finally:
            await fleet.aclose()

    asyncio.run(run())


def test_the_tokenize_doors_of_a_fleet_without_a_tokenizer_ask_the_upstream(
    log_dir: Path, kvgate_upstream: Process
) -> None:
    """OpenAI ``/tokenize`` and MCP ``tokenize`` on a fleet gateway with no ``--tokenizer``
    answer what the upstream's own ``/tokenize`` does (it was a 501)."""
    body = {"prompt": "The quick brown fox", "return_token_strs": True}
    direct = post(kvgate_upstream, "/tokenize", body)
    with running([gateway(log_dir, [kvgate_upstream])]) as (fleet,):
        via_fleet = post(fleet, "/tokenize", body)
        tool = call_tool(fleet.base, "tokenize", {"text": body["prompt"]})
    assert via_fleet == direct and direct["count"] > 0
    assert tool["structuredContent"]["token_ids"] == direct["tokens"]


def test_a_fleet_without_a_tokenizer_renders_a_chat_through_the_upstream(
    log_dir: Path, kvgate_upstream: Process
) -> None:
    """vLLM's render and the chat form of ``/tokenize`` on a fleet gateway with no
    ``--tokenizer``: the upstream's ``/tokenize`` renders the tools and template options."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools}
    unopened = {**chat, "add_generation_prompt": False}
    direct = [
        post(kvgate_upstream, path, body)
        for path, body in (("/v1/chat/completions/render", chat), ("/tokenize", unopened))
    ]
    with running([gateway(log_dir, [kvgate_upstream])]) as (fleet,):
        rendered = post(fleet, "/v1/chat/completions/render", chat)
        tokenized = post(fleet, "/tokenize", unopened)
    assert rendered["token_ids"] == direct[0]["token_ids"]
    assert tokenized == direct[1] and tokenized["count"] < len(rendered["token_ids"])


# -- Fleet.embed ----------------------------------------------------------------------------------


def test_embed_is_proxied_to_the_upstreams_embeddings(kvgate_upstream: Process) -> None:
    fleet = Fleet.connect(Settings(upstream=(kvgate_upstream.base,), upstream_health_interval_s=0))
    inputs: list[str | list[int]] = ["Hi", "The quick brown fox jumps over the lazy dog."]

    async def run() -> list[Any]:
        try:
            return await asyncio.gather(
                fleet.embed(EmbeddingsRequest(inputs)),
                fleet.embed(EmbeddingsRequest([[10**9]])),
                return_exceptions=True,
            )
        finally:
            await fleet.aclose()

    proxied, refused = asyncio.run(run())
    direct = httpx.post(
        kvgate_upstream.base + "/v1/embeddings", json={"input": inputs}, timeout=30
    ).json()
    assert proxied.vectors == [d["embedding"] for d in direct["data"]]
    assert proxied.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert isinstance(refused, BadInput) and refused.field == "input", refused
