"""A fleet gateway over a real kvgate upstream served in this process (the session-scoped engine):
both front doors give what the upstream gives when called directly, startup refuses a fleet
it cannot serve, and the pure pieces (breaker, routing reasons, prefix keys) behave."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import httpx
import openai
import orjson
import pytest

from kvgate.engine import AsyncLLM, SamplingParams, StructuredOutputs
from kvgate.engine.loading.tiny_model import DEFAULT_MODEL_NAME, default_model_dir, make_tiny_model
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.cli import main
from kvgate.gateway.function_calls.functions import Functions
from kvgate.gateway.generation import GenerationRequest
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet, FleetConfigError
from kvgate.gateway.upstream.health import Breaker
from kvgate.gateway.upstream.routing import (
    AFFINITY_SLACK,
    CHUNK_CHARS,
    KV_FULL,
    QUEUE_SLACK,
    Load,
    PrefixKeys,
    UpstreamRouter,
)
from kvgate.gateway.upstream.wire import StreamError, TokenIds, parse_body, parse_line, request_body
from tests.gateway.live_server import LiveServer, free_port
from tests.gateway.mcp.test_streaming import wait_idle
from tests.gateway.upstream.processes import generate, tool_call
from tests.gateway.wire import modern_headers, modern_meta

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def engine_text(engine: AsyncLLM, prompt: list[int], max_tokens: int) -> str:
    """What the upstream's engine itself generates, greedy."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def run() -> str:
        return [o async for o in engine.generate(prompt, params)][-1].text

    return asyncio.run(run())


@pytest.fixture(scope="module")
def fleet_server(server: LiveServer) -> Iterator[LiveServer]:
    settings = Settings(upstream=(server.base,), upstream_health_interval_s=0)
    with LiveServer(None, backend=Fleet.connect(settings)) as live:
        yield live


def test_both_front_doors_relay_what_the_upstream_answers(
    fleet_server: LiveServer, server: LiveServer, engine: AsyncLLM
) -> None:
    direct = generate(server.base, prompt=PROMPT, max_tokens=12)["structuredContent"]
    relayed = generate(fleet_server.base, prompt=PROMPT, max_tokens=12)["structuredContent"]
    assert relayed["text"] == direct["text"] and relayed["completion_tokens"] == 12
    assert (relayed["replica"], relayed["upstream"]) == (0, server.base)
    assert relayed["cached_tokens"] > 0  # the direct call's prefix, as the upstream reports
    with openai.OpenAI(base_url=fleet_server.base + "/v1", api_key="x", max_retries=0) as client:
        model = client.models.list().data[0].id
        assert model == engine.model_name
        chunks = list(
            client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == direct["text"]
        assert chunks[-1].usage.completion_tokens == 12
        messages = [{"role": "user", "content": "Hello there"}]
        chat = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    prompt = engine.apply_chat_template(messages)
    assert chat.choices[0].message.content == engine_text(engine, prompt, 6)


def test_tokenize_asks_the_upstream_without_a_tokenizer(
    fleet_server: LiveServer, server: LiveServer, engine: AsyncLLM
) -> None:
    response = httpx.post(
        fleet_server.base + "/mcp",
        json={
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {
                "name": "tokenize",
                "arguments": {"text": PROMPT},
                "_meta": modern_meta(),
            },
        },
        headers=modern_headers("tools/call", "tokenize"),
    )
    ids = response.json()["result"]["structuredContent"]["token_ids"]
    assert ids == engine.tokenizer.encode(PROMPT)


def test_startup_refuses_mixed_models_and_no_answering_upstream(
    server: LiveServer, engine: AsyncLLM
) -> None:
    with LiveServer(engine, served_model_name="another-model") as other:
        with pytest.raises(FleetConfigError, match="different models.*another-model"):
            Fleet.connect(Settings(upstream=(server.base, other.base)))
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit, match="no upstream answered GET /v1/models"):
        main(["serve", "--port", "0", "--upstream", dead, "--upstream-connect-timeout", "0.5"])


def test_the_environment_takes_a_comma_list_of_upstreams() -> None:
    settings = Settings.from_env({"KVGATE_UPSTREAM": "http://a:8000/, http://b:8000"})
    assert settings.upstream == ("http://a:8000", "http://b:8000")
    flags = Settings.from_env({}, upstream=["http://c:1/", "http://d:2"])
    assert flags.upstream == ("http://c:1", "http://d:2")


def test_the_breaker_opens_after_the_threshold_and_a_check_closes_it() -> None:
    now = [0.0]
    breaker = Breaker(unhealthy_after=2, healthy_after=1, cooldown_s=5, clock=lambda: now[0])
    breaker.failure("connect")
    assert breaker.available() and breaker.state == "healthy"
    breaker.failure("timeout")
    assert not breaker.available() and breaker.state == "unhealthy"
    now[0] = 5.0
    assert breaker.available() and breaker.state == "half_open"  # due a trial
    breaker.failure("connect")  # the trial failed: out for another cooldown
    assert not breaker.available()
    breaker.success()
    assert breaker.available() and breaker.state == "healthy" and breaker.last_error is None


URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


def test_routing_reasons_and_the_next_choice_on_failure() -> None:
    router = UpstreamRouter(URLS)
    up = [True, True, True]
    idle = [Load(0)] * 3
    own, reason = router.choose([], "k", idle, up)
    assert reason == "key"

    def with_own(load: Load) -> list[Load]:
        return [load if r == own else Load(0) for r in range(3)]

    # Calls in flight, a batch running, a queue within one step: no pressure, the key stays.
    calm = Load(AFFINITY_SLACK - 1, waiting=QUEUE_SLACK - 1, running=40, kv_usage=0.5)
    assert router.choose([], "k", with_own(calm), up) == (own, "key")
    for pressed in (
        Load(AFFINITY_SLACK),  # this gateway's burst
        Load(0, waiting=QUEUE_SLACK, running=8),  # a queue the upstream reported twice
        Load(1, kv_usage=KV_FULL),  # a full KV cache
    ):
        other, reason = router.choose([], "k", with_own(pressed), up)
        assert other != own and reason == "overflow", pressed
    # Pressed but not over the bound (the others are as loaded): it stays.
    assert router.choose([], "k", [Load(0, waiting=8, running=8)] * 3, up) == (own, "key")
    excluded = [r != own for r in range(3)]  # the key's upstream failed: the next one
    assert router.choose([], "k", idle, excluded) == (other, "key")
    assert router.choose([], None, [Load(3), Load(1), Load(2)], up) == (1, "least_loaded")
    with pytest.raises(Exception, match="no healthy upstream"):
        router.choose([], "k", idle, [False] * 3)
    turns = UpstreamRouter(URLS, "round_robin")
    assert [turns.choose([], "k", idle, up) for _ in range(3)] == [
        (0, "round_robin"),
        (1, "round_robin"),
        (2, "round_robin"),
    ]


def test_the_ring_is_placed_by_url_so_order_and_joins_move_little() -> None:
    keys = [f"session-{i}" for i in range(300)]

    def owners(urls: list[str]) -> dict[str, str]:
        router = UpstreamRouter(urls)
        idle, up = [Load(0)] * len(urls), [True] * len(urls)
        return {k: urls[router.choose([], k, idle, up)[0]] for k in keys}

    before = owners(URLS)
    assert owners(URLS[::-1]) == before  # another listing or resolving order: the same
    joined = owners([*URLS, "http://10.0.0.4:8000"])
    moved = [k for k in keys if joined[k] != before[k]]
    assert all(joined[k] == "http://10.0.0.4:8000" for k in moved)  # only onto the new one
    assert 0.1 < len(moved) / len(keys) < 0.4  # about a quarter of the keys
    left = owners(URLS[1:])
    assert all(left[k] == before[k] for k in keys if before[k] != URLS[0])


def test_prefix_keys_chunk_text_or_tokens(tmp_path) -> None:
    params = SamplingParams()
    text = PrefixKeys(None)
    short = GenerationRequest(params, prompt="x" * (CHUNK_CHARS - 1))
    assert text(short) == []  # no full chunk: least loaded
    a = text(GenerationRequest(params, prompt=PROMPT + "one ending"))
    b = text(GenerationRequest(params, prompt=PROMPT + "another ending, longer"))
    assert a == b[: len(a)] and len(a) == len(PROMPT) // CHUNK_CHARS
    chat = GenerationRequest(params, messages=[{"role": "user", "content": PROMPT}])
    assert text(chat) != a and len(text(chat)) >= 1
    tokenizer = Tokenizer.from_dir(make_tiny_model(tmp_path / "tiny"))
    tokens = PrefixKeys(tokenizer)
    ids = tokenizer.encode(PROMPT)
    assert tokens(GenerationRequest(params, prompt=PROMPT)) == tokens(
        GenerationRequest(params, prompt=ids)
    )
    assert len(tokens(GenerationRequest(params, prompt=PROMPT))) == min(len(ids) // 16, 8)


def test_the_upstream_body_carries_only_what_was_set() -> None:
    request = GenerationRequest(
        SamplingParams(max_tokens=7, temperature=0.5, stop=["\n"]),
        messages=[{"role": "user", "content": "hi"}],
        cache_key="s1",
    )
    path, body = request_body(request, "m")
    assert path == "/v1/chat/completions"
    assert {k: body[k] for k in ("model", "max_tokens", "temperature", "stop", "cache_key")} == {
        "model": "m",
        "max_tokens": 7,
        "temperature": 0.5,
        "stop": ["\n"],
        "cache_key": "s1",
    }
    assert "top_p" not in body and body["stream"] is True and "logprobs" not in body
    _, chat = request_body(replace(request, params=SamplingParams(logprobs=2)), "m")
    assert (chat["logprobs"], chat["top_logprobs"], chat["return_tokens_as_token_ids"]) == (
        True,
        2,
        True,
    )
    path, text = request_body(GenerationRequest(SamplingParams(logprobs=0), prompt="hi"), "m")
    assert (path, text["logprobs"]) == ("/v1/completions", 0)


def test_tools_go_upstream_as_the_openai_fields_and_constraints_in_vllms_form() -> None:
    """The upstream renders and parses tool calls itself: a forced choice is sent as the
    choice, never as a grammar; a constraint goes as vLLM takes it (the one given, a
    structural tag as text)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    named = {"type": "function", "function": {"name": "f"}}
    request = GenerationRequest(
        SamplingParams(),
        messages=[{"role": "user", "content": "hi"}],
        functions=Functions.of(tools, named, False),
    )
    _, body = request_body(request, "m")
    assert (body["tools"], body["tool_choice"], body["parallel_tool_calls"]) == (
        tools,
        named,
        False,
    )
    assert "structured_outputs" not in body and "skip_special_tokens" not in body
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    for spec, sent in (
        (StructuredOutputs(json={"type": "object"}), {"json": {"type": "object"}}),
        (StructuredOutputs(structural_tag=tag), {"structural_tag": orjson.dumps(tag).decode()}),
    ):
        params = SamplingParams(structured_outputs=spec)
        assert request_body(replace(request, params=params), "m")[1]["structured_outputs"] == sent


def test_a_client_gone_closes_the_upstream_stream(
    fleet_server: LiveServer, engine: AsyncLLM
) -> None:
    arguments = {"prompt": "A long story begins", "max_tokens": 3000, "temperature": 0}
    body = orjson.dumps(tool_call(arguments, progress=True))
    headers = modern_headers("tools/call", "generate")
    with httpx.stream("POST", fleet_server.url, content=body, headers=headers) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data:"))
        assert "notifications/progress" in first
        assert engine.stats().num_running == 1  # running upstream, on the session-scoped engine
    wait_idle(engine, 2.0)  # the upstream saw its connection drop and aborted the request


def test_a_call_closed_before_it_is_read_releases_its_upstream(
    fleet_server: LiveServer, engine: AsyncLLM
) -> None:
    fleet = fleet_server.app.state.openai.generations.backend

    async def start_and_drop() -> None:
        request = GenerationRequest(SamplingParams(max_tokens=3000), prompt="A long story")
        stream = await fleet.start(request)
        assert fleet.upstreams[0].in_flight == 1
        await stream.aclose()  # never iterated (a refused sibling choice, a client gone)

    fleet_server.run(start_and_drop())
    assert fleet.upstreams[0].in_flight == 0
    wait_idle(engine, 2.0)  # the upstream request was aborted too


def test_logprobs_through_the_fleet_match_the_upstream(server: LiveServer) -> None:
    """The upstream (kvgate) sends token strings; the gateway maps them to ids through its
    tokenizer and renders them back: the same tokens and logprobs as calling it directly."""
    settings = Settings(
        upstream=(server.base,), upstream_health_interval_s=0, tokenizer=str(default_model_dir())
    )
    with LiveServer(None, backend=Fleet.connect(settings)) as fleet:
        for path, body in (
            ("/v1/completions", {"prompt": PROMPT, "logprobs": 3}),
            (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "logprobs": True,
                    "top_logprobs": 3,
                },
            ),
        ):
            body = {
                **body,
                "model": DEFAULT_MODEL_NAME,
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
            }
            direct = httpx.post(server.base + path, json=body, timeout=30).json()
            relayed = httpx.post(fleet.base + path, json=body, timeout=30).json()
            assert relayed["choices"][0]["logprobs"] == direct["choices"][0]["logprobs"], path
            assert relayed["choices"][0]["logprobs"] is not None
            streamed = stream_logprobs(fleet.base + path, body)
            assert streamed == stream_logprobs(server.base + path, body), path
            assert streamed["token_logprobs" if "tokens" in streamed else "content"]


def stream_logprobs(url: str, body: dict) -> dict:
    """A streamed answer's per-chunk logprobs joined into one non-streamed-shaped object."""
    joined: dict = {}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in orjson.loads(line[5:])["choices"]:
                for key, value in (choice.get("logprobs") or {}).items():
                    joined.setdefault(key, []).extend(value)
    return joined


def test_fleet_logprobs_without_a_tokenizer_are_a_clear_400(fleet_server: LiveServer) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "prompt": "hi", "max_tokens": 2, "logprobs": 1}
    response = httpx.post(fleet_server.base + "/v1/completions", json=body, timeout=10)
    assert response.status_code == 400 and "--tokenizer" in response.json()["error"]["message"]


def test_upstream_logprobs_parse_as_ids_or_strings() -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir())
    ids = TokenIds(tokenizer)
    vllm = parse_line(
        'data: {"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["token_id:7",'
        ' "token_id:9"], "token_logprobs": [-0.5, -1.0], "top_logprobs": [{"token_id:7": -0.5,'
        ' "token_id:3": -2.0}, {"token_id:9": -1.0}], "text_offset": [0, 1]}}]}'
    )
    assert ids.entries(vllm.logprobs) == ([7, 9], [{7: -0.5, 3: -2.0}, {9: -1.0}])
    word = tokenizer.decode([tokenizer.encode("hello", add_special_tokens=False)[0]])
    chat = parse_line(
        'data: {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": {"content": '
        f'[{{"token": "{word}", "logprob": -0.25, "top_logprobs": []}}]}}}}]}}'
    )
    (token_id,), (entry,) = ids.entries(chat.logprobs)
    assert tokenizer.decode([token_id]) == word and entry == {token_id: -0.25}
    with pytest.raises(StreamError, match="malformed logprobs"):
        parse_line('data: {"choices": [{"text": "x", "logprobs": {"tokens": ["a"]}}]}')


def test_a_whole_answer_is_read_and_checked_as_its_chunks_would_be() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    chat = parse_body(orjson.dumps({"choices": [choice], "usage": usage}))
    assert (chat.text, chat.finish_reason, chat.tokens) == ("", "tool_calls", 3)
    assert chat.tool_calls == [{"index": 0, **call}]
    text = parse_body(b'{"choices": [{"text": "ab", "finish_reason": "length"}]}')
    assert (text.text, text.finish_reason, text.tokens) == ("ab", "length", 1)
    for bad, says in (
        (b"[1, 2]", "malformed chunk"),
        (b'{"choices": [{"message": "x"}]}', "not an object"),
        (b'{"choices": [{"message": {"content": 7}}]}', "not a string"),
        (b'{"choices": [{"text": "a", "finish_reason": "DROP TABLE"}]}', "finish_reason"),
        (b'{"choices": [], "usage": {"completion_tokens": -1}}', "usage"),
        (b'{"choices": [{"message": {"tool_calls": [{"type": "x"}]}}]}', "tool_calls"),
        (b'{"error": {"message": "out of memory"}}', "out of memory"),
    ):
        with pytest.raises(StreamError, match=says):
            parse_body(bad)
