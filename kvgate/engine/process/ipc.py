"""Frames between an API process and the engine process: a 4-byte length, then a pickle.

The channel is a Unix domain socket in a folder only this user can open (``mkdtemp``: 0700),
between processes one ``kvgate serve`` started, so pickle's trust in its input is the same
trust the processes already have in each other. Pickle carries the engine's own types
(``SamplingParams``, ``StepOutput``, ``EngineStats``, its exceptions) without a schema kept
beside each; a step's frame of 16 requests' news pickles and unpickles in tens of µs.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

from kvgate.engine.core.prompt_rules import Limits
from kvgate.engine.stats import EngineStats
from kvgate.engine.tokenization.tokenizer import Tokenizer

HEADER = struct.Struct("!I")
MAX_FRAME = 1 << 30


@dataclass(frozen=True)
class Hello:
    """What an API process needs to tokenize, template and check prompts itself."""

    model_name: str
    limits: Limits
    tokenizer: Tokenizer
    default_sampling_fields: dict[str, Any]
    max_grammar_bytes: int
    pid: int


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str


@dataclass(frozen=True)
class State:
    stats: EngineStats
    replicas_ready: list[bool]
    adapters: list[Adapter]


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: Any) -> None:
    sock.sendall(encode(message))


def receive(sock: socket.socket) -> Any:
    """The next message; EOFError once the peer has closed (or died)."""
    (size,) = HEADER.unpack(_exactly(sock, HEADER.size))
    if size > MAX_FRAME:
        raise EOFError(f"a frame of {size} bytes: the peer is not speaking this protocol")
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer closed the connection")
        got += n
    return bytes(buffer)
