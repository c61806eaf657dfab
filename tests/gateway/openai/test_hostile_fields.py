"""Hostile sampling fields over the OpenAI routes (issue 27): ``max_tokens`` past the context,
``logit_bias`` served as vLLM serves it, and JSON Schema references that point outside the
schema — each a 400 naming its field, or honoured."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.live_server import LiveServer

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=30)


@pytest.mark.parametrize("max_tokens", [4097, 10**9, 1e23])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_max_tokens_past_the_context_is_a_400(
    server: LiveServer, route: str, max_tokens: float
) -> None:
    body = {"max_tokens": max_tokens}
    body.update({"messages": MESSAGES} if "chat" in route else {"prompt": "Once upon a time"})
    response = _post(server, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and "context length is 4096 tokens" in error["message"]


def test_prompt_plus_max_tokens_past_the_context_is_a_400(server: LiveServer) -> None:
    prompt = [5] * 4000
    response = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 97})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        error["param"] == "max_tokens" and "4000 in the prompt, 97 to generate" in error["message"]
    )
    fits = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 96, "stop": ["a"]})
    assert fits.status_code == 200, fits.text
    unasked = _post(server, "/v1/completions", {"prompt": [5] * 4090})  # default max_tokens
    assert unasked.status_code == 200, unasked.text
    assert unasked.json()["choices"][0]["finish_reason"] == "length"


def test_logit_bias_steers_the_reply(server: LiveServer) -> None:
    """``{"305": 100}`` on a greedy reply: every token is 305 (it was ignored before)."""
    expected = _post(server, "/detokenize", {"tokens": [305] * 4}).json()["prompt"]
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for route, body in (
        ("/v1/completions", {"prompt": "Once upon a time", **greedy}),
        ("/v1/chat/completions", {"messages": MESSAGES, **greedy}),
    ):
        plain = _post(server, route, body).json()["choices"][0]
        forced = _post(server, route, {**body, "logit_bias": {"305": 100}}).json()["choices"][0]
        assert _text(forced) == expected != _text(plain)


def _text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"abc": 1}, "keys must be token ids"),
        ({"-3": 1}, "keys must be token ids"),
        ({"5": 101}, "between -100 and 100"),
        ({"5": "1"}, "must be a number"),
        ({"5": True}, "must be a number"),
        ([5], "must be an object"),
        ({"1024": 1}, "token id 1024 is out of vocabulary (size 1024)"),
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(server: LiveServer, bias: object, message: str) -> None:
    response = _post(
        server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "logit_bias": bias}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and message in error["message"]


@pytest.mark.parametrize("ref", ["http://127.0.0.1:9/evil.json", "file:///etc/passwd"])
def test_a_json_schema_ref_outside_the_schema_is_a_400(server: LiveServer, ref: str) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
    body = {
        "messages": MESSAGES,
        "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs"
    assert f"json/properties/a/$ref: '{ref}' does not resolve inside the schema" in error["message"]
