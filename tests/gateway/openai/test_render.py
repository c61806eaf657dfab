"""vLLM's render endpoints: the prompt ids the engine would prefill, in the shape of vLLM's
``GenerateRequest`` (the top-level fields vLLM 0.32's render server answers, recorded below),
and bad input refused in OpenAI's error JSON; against vLLM's own render server when its CPU
build is installed (skipped otherwise)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvgate.engine import AsyncLLM, EngineConfig, SamplingParams
from kvgate.engine.loading.tiny_model import default_model_dir
from kvgate.gateway.calls.errors import BadInput
from kvgate.gateway.openai import render
from tests.gateway.live_server import LiveServer, free_port
from tests.gateway.upstream.processes import peer
from tests.gateway.upstream.test_fleet_vllm import ENV_SH, VLLM_PYTHON

# What vLLM 0.32's /v1/chat/completions/render answers for a text chat, in its order.
VLLM_FIELDS = [
    "request_id",
    "token_ids",
    "token_offsets",
    "features",
    "content_parts",
    "sampling_params",
    "model",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
    "output_mode",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "ec_transfer_params",
]
CHAT = [{"role": "user", "content": "hi there"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def post(server: LiveServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=30)


def test_request_ids_are_vllms() -> None:
    (one,) = render.request_ids("chatcmpl-", 1)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", one)
    assert re.fullmatch(r"resp_[0-9a-f]{16}", render.request_ids("resp_", 1)[0])
    several = render.request_ids("cmpl-", 3)
    assert [i.rsplit("-", 1)[1] for i in several] == ["0", "1", "2"]
    assert len({i.rsplit("-", 1)[0] for i in several}) == 1


def test_max_tokens_is_what_the_call_would_generate() -> None:
    default = SamplingParams.from_dict({})
    assert render.max_tokens(default, 10, 4096, "prompt") == default.max_tokens
    assert render.max_tokens(default, 4090, 4096, "prompt") == 6  # a default stops at the end
    asked = SamplingParams.from_dict({"max_tokens": 100})
    assert render.max_tokens(asked, 10, 4096, "prompt") == 100
    with pytest.raises(BadInput) as refused:  # one asked for is refused, as the call is
        render.max_tokens(asked, 4000, 4096, "prompt")
    assert refused.value.field == "max_tokens"
    with pytest.raises(BadInput) as full:
        render.max_tokens(default, 4096, 4096, "messages")
    assert full.value.field == "messages"


def test_sampling_params_use_vllms_names() -> None:
    params = SamplingParams.from_dict(
        {"temperature": 0.5, "top_k": 5, "seed": 3, "stop": ["a"], "logprobs": 2}
    )
    fields = render.sampling_params(params, 2, 7)
    assert fields == {
        "n": 2,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": 5,
        "min_p": 0.0,
        "seed": 3,
        "stop": ["a"],
        "stop_token_ids": [],
        "max_tokens": 7,
        "logprobs": 2,
    }
    plain = render.sampling_params(SamplingParams.from_dict({}), 1, 16)
    assert "n" not in plain and "top_k" not in plain and "seed" not in plain


def test_chat_render_is_the_prompt_the_engine_prefills(
    server: LiveServer, engine: AsyncLLM
) -> None:
    answer = post(server, "/v1/chat/completions/render", {"messages": CHAT, "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert list(body) == VLLM_FIELDS
    assert body["token_ids"] == engine.apply_chat_template(CHAT)
    assert body["request_id"].startswith("chatcmpl-")
    assert body["sampling_params"]["max_tokens"] == 4
    assert body["model"] is None and body["stream"] is False and body["output_mode"] == "tokens"
    with_tools = post(server, "/v1/chat/completions/render", {"messages": CHAT, "tools": TOOLS})
    assert with_tools.json()["token_ids"] == engine.apply_chat_template(CHAT, tools=TOOLS)
    streamed = post(
        server,
        "/v1/chat/completions/render",
        {
            "model": engine.model_name,
            "messages": CHAT,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": "s",
        },
    ).json()
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}
    assert streamed["model"] == engine.model_name and streamed["cache_salt"] == "s"


def test_completions_render_one_answer_per_prompt(server: LiveServer, engine: AsyncLLM) -> None:
    one = post(server, "/v1/completions/render", {"prompt": "hello world"}).json()
    assert len(one) == 1 and list(one[0]) == VLLM_FIELDS
    assert one[0]["token_ids"] == engine.tokenizer.encode("hello world")
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", one[0]["request_id"])
    several = post(
        server, "/v1/completions/render", {"prompt": ["a b", "c d"], "n": 2, "max_tokens": 3}
    ).json()
    assert [p["token_ids"] for p in several] == [engine.tokenizer.encode(t) for t in ("a b", "c d")]
    assert [p["request_id"][-2:] for p in several] == ["-0", "-1"]
    assert all(p["sampling_params"]["n"] == 2 for p in several)
    ids = post(server, "/v1/completions/render", {"prompt": [[5, 6], [7]]}).json()
    assert [p["token_ids"] for p in ids] == [[5, 6], [7]]


def test_responses_render_is_the_chat_it_runs(server: LiveServer, engine: AsyncLLM) -> None:
    body = {"input": "hi there", "instructions": "be brief", "max_output_tokens": 4}
    answer = post(server, "/v1/responses/render", body)
    assert answer.status_code == 200, answer.text
    rendered = answer.json()
    assert list(rendered) == VLLM_FIELDS and rendered["request_id"].startswith("resp_")
    system = [{"role": "system", "content": "be brief"}]
    assert rendered["token_ids"] == engine.apply_chat_template(system + CHAT)
    assert rendered["sampling_params"]["max_tokens"] == 4


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions/render", {}, 400, "messages"),
        ("/v1/chat/completions/render", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions/render", {"messages": CHAT, "model": "other"}, 404, "model"),
        ("/v1/chat/completions/render", {"messages": CHAT, "max_tokens": 5000}, 400, "max_tokens"),
        ("/v1/chat/completions/render", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
        ("/v1/completions/render", {}, 400, "prompt"),
        ("/v1/completions/render", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions/render", [1], 400, None),
        ("/v1/responses/render", {"input": 5}, 400, "input"),
    ],
)
def test_bad_input_is_refused_in_openai_errors(
    server: LiveServer, path: str, body: Any, status: int, param: str | None
) -> None:
    answer = post(server, path, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    "prompt_of",
    [lambda v: [v, 5], lambda v: [-7, 5], lambda v: [[5], [v]]],
    ids=["past-the-vocabulary", "negative", "in-the-second-prompt"],
)
def test_completions_render_refuses_the_ids_the_call_refuses(
    server: LiveServer, engine: AsyncLLM, prompt_of: Callable[[int], list[Any]]
) -> None:
    vocab = engine.core.model_config.vocab_size
    body = {"prompt": prompt_of(vocab), "max_tokens": 1}
    call = post(server, "/v1/completions", body)
    rendered = post(server, "/v1/completions/render", body)
    assert call.status_code == rendered.status_code == 400, rendered.text
    error = rendered.json()["error"]
    assert error["param"] == "prompt" and f"token ids must be in [0, {vocab})" in error["message"]
    assert error["message"] == call.json()["error"]["message"]


def test_renders_refuse_a_prompt_over_the_servers_bound_as_the_calls_do(
    tiny_engine_config: dict[str, Any],
) -> None:
    """``--max-prompt-tokens``: a prompt within the context but over the server's bound."""
    engine = AsyncLLM(EngineConfig(**tiny_engine_config, max_prompt_tokens=40))
    long = "word " * 60
    chat = {"messages": [{"role": "user", "content": long}], "max_tokens": 1}
    pairs = [
        ("/v1/chat/completions", chat, "messages"),
        ("/v1/completions", {"prompt": long, "max_tokens": 1}, "prompt"),
        ("/v1/responses", {"input": long, "max_output_tokens": 1}, "input"),
    ]
    try:
        with LiveServer(engine) as live:
            for path, body, field in pairs:
                call, rendered = post(live, path, body), post(live, path + "/render", body)
                assert call.status_code == rendered.status_code == 400, (path, rendered.text)
                error = rendered.json()["error"]
                assert "at most 40 on this server" in error["message"]
                assert error["param"] == field
    finally:
        engine.shutdown()


def test_a_chat_the_template_refuses_is_a_400_at_every_door(server: LiveServer) -> None:
    """A variable named like one of the template's own arguments: the call, its render and
    ``/tokenize`` each answer the template's refusal as bad input."""
    body = {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"tools": 5}}
    for path in ("/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"):
        answer = post(server, path, body)
        assert answer.status_code == 400, (path, answer.text)
        assert "the chat template rejected them" in answer.json()["error"]["message"]


def test_render_takes_only_post(server: LiveServer) -> None:
    answer = httpx.get(server.base + "/v1/chat/completions/render")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"


# -- against vLLM's own render server --------------------------------------------------------

RENDER_SERVER = """
import sys, uvloop
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.launchers.render.entry import run_launch_fastapi
from vllm.utils.argparse_utils import FlexibleArgumentParser
uvloop.run(run_launch_fastapi(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])))
"""  # `vllm launch render`: the CPU build's `vllm` script cannot find its own version
SAME = [
    ("/v1/chat/completions/render", {"messages": CHAT, "max_tokens": 4}),
    (
        "/v1/chat/completions/render",
        {"messages": CHAT, "temperature": 0.5, "seed": 3, "n": 2, "max_tokens": 9},
    ),
    ("/v1/completions/render", {"prompt": "hello world", "max_tokens": 4}),
    ("/v1/completions/render", {"prompt": ["a b", "c d"], "stop": ["x"], "max_tokens": 2}),
    ("/v1/completions/render", {"prompt": [[5, 6], [7]], "max_tokens": 1}),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}),
    ("/tokenize", {"prompt": "hello world", "return_token_strs": True}),
]


@pytest.fixture(scope="module")
def vllm_render(tmp_path_factory: pytest.TempPathFactory, engine: AsyncLLM) -> Iterator[str]:
    if not (VLLM_PYTHON.exists() and ENV_SH.exists()):
        pytest.skip("vLLM CPU build not installed")
    base = f"http://127.0.0.1:{free_port()}"
    command = [str(ENV_SH), str(VLLM_PYTHON), "-c", RENDER_SERVER, "--model"]
    command += [str(default_model_dir()), "--served-model-name", engine.model_name]
    command += ["--host", "127.0.0.1", "--port", base.rsplit(":", 1)[1]]
    command += ["--max-model-len", str(engine.max_model_len)]
    log = tmp_path_factory.mktemp("vllm-render") / "render.log"
    with peer(command, log, base + "/health", 240, poll_s=1):
        yield base


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body"), SAME)
def test_answers_as_vllms_render_server(
    vllm_render: str, server: LiveServer, path: str, body: dict[str, Any]
) -> None:
    theirs = httpx.post(vllm_render + path, json=body, timeout=30)
    ours = post(server, path, body)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    if path == "/tokenize":
        assert ours.json() == theirs.json()
        return
    mine, vllms = _listed(ours.json()), _listed(theirs.json())
    assert [list(a) for a in mine] == [list(a) for a in vllms]  # the same fields, in order
    for a, b in zip(mine, vllms, strict=True):  # vLLM's own sampling fields aside
        assert {k: v for k, v in a.items() if k != "request_id"} == {
            k: b["sampling_params"] if k == "sampling_params" else b[k]
            for k in b
            if k != "request_id"
        } | {"sampling_params": a["sampling_params"]}
        shared = a["sampling_params"].keys() & b["sampling_params"].keys()
        assert {k: a["sampling_params"][k] for k in shared} == {
            k: b["sampling_params"][k] for k in shared
        }
        assert a["request_id"].count("-") == b["request_id"].count("-")


def _listed(answer: Any) -> list[dict[str, Any]]:
    return answer if isinstance(answer, list) else [answer]
