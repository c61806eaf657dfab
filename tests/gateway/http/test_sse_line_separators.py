"""Text holding U+2028, U+2029 or U+0085 streams as SSE events that line readers splitting on
them (httpx's ``iter_lines``/``aiter_lines``, Python's ``str.splitlines``) still read whole:
those characters are escaped in the events' JSON, on both doors."""

from __future__ import annotations

import httpx
import orjson

from kvgate.gateway.http.io import line_safe
from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_streaming import stream_request

TEXT = "one\u2028two\u2029three\x85four"


def data_lines(response: httpx.Response) -> list[object]:
    """Each ``data:`` line, parsed: a JSONDecodeError where a reader cut one in two."""
    lines = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    return [orjson.loads(line) for line in lines if line != "[DONE]"]


def test_an_openai_stream_of_line_separators_reads_whole(server: LiveServer) -> None:
    body = {
        "prompt": "Say it:",
        "max_tokens": 40,
        "stream": True,
        "structured_outputs": {"choice": [TEXT]},
    }
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as answer:
        assert answer.status_code == 200
        chunks = data_lines(answer)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == TEXT


def test_an_mcp_stream_of_line_separators_reads_whole(server: LiveServer) -> None:
    arguments = {"prompt": "Say it:", "max_tokens": 40, "choice": [TEXT]}
    content, headers = stream_request(
        "tools/call", {"name": "generate", "arguments": arguments}, "generate", progressToken=7
    )
    with httpx.stream("POST", server.url, content=content, headers=headers, timeout=60) as answer:
        assert answer.status_code == 200
        *progress, final = data_lines(answer)
    assert final["result"]["structuredContent"]["text"] == TEXT  # type: ignore[index]
    assert "".join(m["params"]["message"] for m in progress) == TEXT  # type: ignore[index]


def test_escaping_keeps_the_value() -> None:
    raw = orjson.dumps({"a": TEXT + "\\\u2028é"})
    safe = line_safe(raw)
    assert orjson.loads(safe) == orjson.loads(raw)
    assert safe.splitlines() == [safe] and len(raw.decode().splitlines()) > 1
