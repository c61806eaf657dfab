"""The OpenAI-compatible API through the official ``openai`` client, checked against the engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from kvgate.engine import AsyncLLM, SamplingParams
from tests.engine.test_async_llm import all_blocks_released
from tests.gateway.live_server import LiveServer

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def model(engine: AsyncLLM) -> str:
    return engine.model_name


def engine_text(engine: AsyncLLM, prompt: str | list[int], max_tokens: int) -> str:
    async def run() -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return [o async for o in engine.generate(prompt, params)][-1].text

    return asyncio.run(run())


def test_models_lists_the_served_model(client: openai.OpenAI, model: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].object == "model" and models[0].owned_by == "kvgate"


def test_completion_matches_the_engine(client: openai.OpenAI, model: str, engine: AsyncLLM) -> None:
    out = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == engine_text(engine, "Once upon a time", 8)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode("Once upon a time"))
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_token_id_prompts_and_lists_of_prompts(
    client: openai.OpenAI, model: str, engine: AsyncLLM
) -> None:
    ids, more = engine.tokenizer.encode("Hello there"), engine.tokenizer.encode("General Kenobi")
    extra = {"ignore_eos": True}
    single = client.completions.create(
        model=model, prompt=ids, max_tokens=4, temperature=0, extra_body=extra
    )
    assert single.choices[0].text == engine_text(engine, ids, 4)
    out = client.completions.create(
        model=model, prompt=[ids, more], max_tokens=4, temperature=0, extra_body=extra
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [engine_text(engine, p, 4) for p in (ids, more)]
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == len(ids) + len(more)
    texts = client.completions.create(
        model=model,
        prompt=["Hello there", "General Kenobi"],
        max_tokens=4,
        temperature=0,
        extra_body=extra,
    )
    assert [c.text for c in texts.choices] == [c.text for c in out.choices]


def test_echo_prepends_the_prompt(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt="Echo me", max_tokens=3, temperature=0, echo=True
    )
    assert out.choices[0].text.startswith("Echo me")


def test_chat_matches_the_engine_with_its_template(
    client: openai.OpenAI, model: str, engine: AsyncLLM
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    prompt = engine.apply_chat_template(messages)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == engine_text(engine, prompt, 6)
    assert out.usage.prompt_tokens == len(prompt)


def test_text_parts_are_read_as_text(client: openai.OpenAI, model: str) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], max_tokens=2
    )
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_chat_adds_up_to_the_whole_answer(
    client: openai.OpenAI, model: str, include_usage: bool
) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            **options,
        )
    )
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in content if c.choices[0].finish_reason]
    assert reasons == ["length"] and content[-1].choices[0].finish_reason == "length"
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    else:
        assert all(c.choices for c in chunks)


def test_streamed_completion_adds_up(client: openai.OpenAI, model: str) -> None:
    args = dict(model=model, prompt="Streaming along", max_tokens=10, temperature=0)
    whole = client.completions.create(**args).choices[0].text
    text = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert text == whole


def test_n_choices_share_the_prompt_blocks(
    client: openai.OpenAI, model: str, engine: AsyncLLM
) -> None:
    prompt = "Never seen before: " + LONG_PROMPT  # no other test shares its first block
    hits = engine.stats().prefix_hits
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=5, temperature=1.0, n=2, seed=3
    )
    assert [c.index for c in out.choices] == [0, 1]
    prompt_tokens = out.usage.prompt_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # the first choice prefilled
    assert engine.stats().prefix_hits - hits >= (prompt_tokens - 1) // 16 * 16  # the second reused
    again = client.completions.create(
        model=model, prompt=prompt, max_tokens=5, temperature=1.0, n=2, seed=3
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: repeatable


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model: str) -> None:
    args = dict(model=model, prompt="Random words:", max_tokens=8, temperature=1.0, seed=42)
    assert client.completions.create(**args).choices[0].text == (
        client.completions.create(**args).choices[0].text
    )


def test_logprobs_shapes(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    out = client.completions.create(
        model=model, prompt="Hi", max_tokens=3, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    # Streamed, the offsets run on across the chunks (as vLLM's): the same as the whole answer's.
    streamed = client.completions.create(
        model=model,
        prompt="Hi",
        max_tokens=8,
        logprobs=1,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    offsets, tokens = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert len(tokens) == 8
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_stop_strings_end_the_text_before_them(
    client: openai.OpenAI, model: str, engine: AsyncLLM
) -> None:
    free = engine_text(engine, "Once upon a time", 16)
    stop = free[4:7]
    out = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == free[: free.index(stop)]


def test_a_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    args = dict(model=model, prompt=LONG_PROMPT, max_tokens=1)
    client.completions.create(**args)
    assert client.completions.create(**args).usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": "x", "stop": [1]}, 400, "stop"),
        ({"prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
        ({"prompt": "x", "tool_choice": "auto"}, 400, "tool_choice"),
        ({"prompt": "x", "skip_special_tokens": 0}, 400, "skip_special_tokens"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ],
)
def test_bad_completion_requests(server: LiveServer, body: dict, status: int, param: str) -> None:
    response = httpx.post(server.base + "/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert error["type"] == "invalid_request_error"


def test_bad_chat_requests(server: LiveServer) -> None:
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ]:
        response = httpx.post(server.base + "/v1/chat/completions", json=body)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param


def test_the_client_sees_errors_as_its_own_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=None, prompt="x", temperature=5)  # type: ignore[arg-type]


def test_transport_errors_have_the_openai_shape(server: LiveServer) -> None:
    big = httpx.post(server.base + "/v1/completions", content=b"x" * (65 * 1024))
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    text = httpx.post(
        server.base + "/v1/completions", content=b"{}", headers={"content-type": "text/plain"}
    )
    assert text.status_code == 415
    assert httpx.get(server.base + "/v1/completions").status_code == 405
    json_type = {"content-type": "application/json"}
    assert (
        httpx.post(server.base + "/v1/completions", content=b"{", headers=json_type).status_code
        == 400
    )
    deep = b'{"prompt": ' + b"[" * 80 + b"]" * 80 + b"}"
    assert (
        httpx.post(
            server.base + "/v1/completions",
            content=deep,
            headers={"content-type": "application/json"},
        ).status_code
        == 400
    )
    evil = httpx.post(
        server.base + "/v1/completions", json={}, headers={"Origin": "https://evil.example"}
    )
    assert evil.status_code == 403


def test_tokenize_and_detokenize_like_vllm(server: LiveServer, engine: AsyncLLM) -> None:
    out = httpx.post(
        server.base + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}
    ).json()
    assert out["tokens"] == engine.tokenizer.encode("hello world")
    assert out["count"] == len(out["tokens"]) and len(out["token_strs"]) == out["count"]
    assert out["max_model_len"] == engine.max_model_len
    plain = httpx.post(
        server.base + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}
    ).json()
    assert plain["tokens"] == engine.tokenizer.encode("hello world", add_special_tokens=False)
    chat = httpx.post(
        server.base + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert chat["tokens"] == engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    back = httpx.post(server.base + "/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": "hello world"}
    assert httpx.post(server.base + "/detokenize", json={"tokens": [-1]}).status_code == 400


def test_tokenize_renders_a_chat_as_vllm_does(server: LiveServer, engine: AsyncLLM) -> None:
    """The chat form's tools and ``add_generation_prompt`` reach the template, as in vLLM."""
    messages = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = httpx.post(
        server.base + "/tokenize", json={"messages": messages, "tools": tools}
    ).json()
    assert with_tools["tokens"] == engine.apply_chat_template(messages, tools=tools)
    unopened = httpx.post(
        server.base + "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert unopened["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False)
    assert unopened["count"] < with_tools["count"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    counted = httpx.post(server.base + "/tokenize", json={"messages": history, "tools": tools})
    rendered = httpx.post(  # the call's own prompt: the arguments rendered as an object
        server.base + "/v1/chat/completions/render", json={"messages": history, "tools": tools}
    )
    assert counted.json()["tokens"] == rendered.json()["token_ids"]
    bad = httpx.post(
        server.base + "/tokenize", json={"messages": messages, "chat_template_kwargs": [1]}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_a_client_gone_mid_stream_frees_everything(server: LiveServer, engine: AsyncLLM) -> None:
    body = {"prompt": "Run long", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    started = time.monotonic()
    assert asyncio.run(all_blocks_released(engine, timeout=1.0))
    assert time.monotonic() - started < 1.0
    metrics = httpx.get(server.base + "/metrics").text
    assert "vllm:num_requests_running" in metrics


def test_openai_calls_are_counted_with_their_api(server: LiveServer) -> None:
    httpx.get(server.base + "/v1/models")
    for i in range(3):  # unknown paths, each its own 404: one label, however many there are
        assert httpx.get(server.base + f"/v1/no-such-{i}").status_code == 404
    metrics = httpx.get(server.base + "/metrics").text
    assert 'kvgate_requests_total{api="openai",method="/v1/models",outcome="ok",tool=""}' in metrics
    assert "no-such" not in metrics
    assert 'method="unknown"' in metrics


def test_models_carry_the_created_time_the_server_was_given(engine: AsyncLLM) -> None:
    """``--workers`` pass every worker one ``created`` taken before they fork, so that
    ``/v1/models`` answers alike from any of them."""
    from starlette.testclient import TestClient

    from kvgate.gateway.app import create_app
    from kvgate.gateway.settings import Settings

    app = create_app(Settings(), engine, created=1_700_000_000)
    with TestClient(app, base_url="http://127.0.0.1") as client:  # a loopback Host, as served
        (model,) = client.get("/v1/models").json()["data"]
    assert model["created"] == 1_700_000_000
