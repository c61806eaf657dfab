"""A fake OpenAI engine server that answers at once: the upstream of fleet.py's overhead
workload, so what is timed is the router in front of it, never a model.

A raw asyncio protocol (uvloop when installed) over HTTP/1.1 keep-alive: ``GET /v1/models``,
``/health``, ``/metrics`` (vLLM's gauge names, all zero) and the probes a router sends
(``/server_info``, ``/model_info``, ``/get_server_info``, ``/get_model_info``); ``POST
/v1/chat/completions`` and ``/v1/completions`` answer a fixed two-token reply, as one JSON body
or, when the body asks ``"stream": true``, as SSE events; vLLM's ``/v1/chat/completions/render``
and ``/v1/completions/render`` (what vllm-router's ``cache_aware`` asks first) a fixed prompt
of 64 token ids, and ``/tokenize`` the same 64 ids. ``--kv-events-port`` binds a ZMQ PUB
that publishes no KV-cache event: a gateway following it routes every call by the precise
rule (on the blocks it just sent there), so its cost per call is measured. Usage:

    python -m benchmarks.instant_upstream --port 9001 [--kv-events-port 9002]
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import zmq

MODEL = "instant"
CHAT = orjson.dumps(
    {
        "id": "chatcmpl-instant",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10},
    }
)


def _event(delta: dict[str, object], finish: str | None, usage: bool = False) -> bytes:
    chunk: dict[str, object] = {
        "id": "chatcmpl-instant",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        chunk["usage"] = {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


STREAM = (
    _event({"role": "assistant", "content": "ok"}, None)
    + _event({"content": " ok"}, None)
    + _event({}, "stop", usage=True)
    + b"data: [DONE]\n\n"
)
GETS = {
    b"/v1/models": orjson.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}
    ),
    b"/health": b"{}",
    b"/metrics": b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n",
    b"/server_info": b"{}",
    b"/get_server_info": b"{}",
    b"/model_info": orjson.dumps({"model_path": MODEL, "is_generation": True}),
    b"/get_model_info": orjson.dumps({"model_path": MODEL, "is_generation": True}),
}

RENDERED = {  # vLLM's GenerateRequest, the fields a router reads
    "request_id": "instant",
    "token_ids": list(range(1, 65)),
    "sampling_params": {"max_tokens": 8},
    "model": MODEL,
    "stream": False,
}


def _answer(body: bytes, kind: bytes = b"application/json", status: bytes = b"200 OK") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + kind
        + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


ANSWERS = {path: _answer(body) for path, body in GETS.items()}
JSON_ANSWER = _answer(CHAT)
SSE_ANSWER = _answer(STREAM, b"text/event-stream")
TOKENS = RENDERED["token_ids"]
RENDERS = {
    b"/v1/chat/completions/render": _answer(orjson.dumps(RENDERED)),
    b"/v1/completions/render": _answer(orjson.dumps([RENDERED])),
    b"/tokenize": _answer(
        orjson.dumps({"count": 64, "max_model_len": 4096, "tokens": TOKENS, "token_strs": None})
    ),
}
NOT_FOUND = _answer(b'{"error": "not found"}', status=b"404 Not Found")


class Instant(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.WriteTransport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            request_line = head.split(b"\r\n", 1)[0].split(b" ", 2)
            if len(request_line) < 2:  # not HTTP/1.1 (a stray line): no answer, no crash
                self.transport.close()
                return
            method, path = request_line[:2]
            if method == b"POST" and path in RENDERS:
                self.transport.write(RENDERS[path])
            elif method == b"POST":
                streamed = b'"stream":true' in body.replace(b" ", b"")
                self.transport.write(SSE_ANSWER if streamed else JSON_ANSWER)
            else:
                self.transport.write(ANSWERS.get(path.split(b"?")[0], NOT_FOUND))


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Instant, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kv-events-port", type=int, help="bind a silent KV-event publisher")
    args = parser.parse_args()
    port = args.port
    if args.kv_events_port is not None:
        publisher = zmq.Context().socket(zmq.PUB)  # held open, silent, until the process ends
        publisher.bind(f"tcp://127.0.0.1:{args.kv_events_port}")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(port))
    else:
        uvloop.run(serve(port))


if __name__ == "__main__":
    main()
