"""Unknown paths under /v1/ and wrong methods on the OpenAI routes (and vLLM's /tokenize,
/detokenize) answer 404 / 405 in OpenAI's error shape, as the rest of the door does; they
were Starlette's plain text before."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.live_server import LiveServer

KEYS = {"message", "type", "param", "code"}


def error_of(response: httpx.Response) -> dict[str, object]:
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == KEYS, body
    return body["error"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/nope"),
        ("POST", "/v1/chat/completion"),
        ("POST", "/v1/embedding"),
        ("GET", "/v1/"),
        ("DELETE", "/v1/models/tiny/and/more"),
    ],
)
def test_an_unknown_openai_path_is_a_404_in_openai_shape(
    server: LiveServer, method: str, path: str
) -> None:
    response = httpx.request(method, server.base + path, timeout=10)
    assert response.status_code == 404
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "not_found"
    assert error["message"] == f"Invalid URL ({method} {path})"


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("GET", "/v1/embeddings", "POST"),
        ("DELETE", "/v1/models", "GET, HEAD"),
        ("GET", "/tokenize", "POST"),
        ("PATCH", "/detokenize", "POST"),
    ],
)
def test_a_wrong_method_is_a_405_in_openai_shape_with_allow(
    server: LiveServer, method: str, path: str, allow: str
) -> None:
    response = httpx.request(method, server.base + path, timeout=10)
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "method_not_allowed"
    assert path in str(error["message"])


def test_the_routes_still_answer_their_methods(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base, timeout=30) as http:
        assert http.get("/v1/models").json()["object"] == "list"
        head = http.head("/v1/models")
        assert head.status_code == 200 and head.content == b""
        tokens = http.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "hi"
        assert http.get("/nope").status_code == 404  # not the OpenAI door's: Starlette's
        assert http.post("/healthz").status_code == 405
