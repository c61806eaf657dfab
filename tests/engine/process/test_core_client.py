"""The engine in a process of its own (``kvgate.engine.process.core_process``) through its client
(``kvgate.engine.process.core_client``): the same tokens as the offline LLM, refusals and their fields
across the socket, embeddings, adapters, grammar compiles, aborts freeing the engine's
blocks, and an engine that dies and comes back."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.engine import LLM, EngineConfig, SamplingParams
from kvgate.engine.errors import (
    EngineStepError,
    EngineUnavailable,
    InvalidArgument,
    TooManyTokens,
    UnknownAdapter,
)
from kvgate.engine.outputs import OutputKind
from kvgate.engine.process.core_client import EngineClient
from kvgate.engine.request_options import RequestOptions
from kvgate.engine.sampling_params import StructuredOutputs
from tests.lora_adapters import ADAPTER_A, make_adapter

REPO_ROOT = Path(__file__).resolve().parents[3]


class EngineProcess:
    """``python -m kvgate.engine.process.core_process`` on a socket in ``folder``, startable again."""

    def __init__(self, folder: Path, model: Path) -> None:
        self.socket = str(folder / "kvgate.engine.sock")
        self.config = folder / "config.pickle"
        config = EngineConfig(
            model=str(model),
            dtype="float32",
            kv_cache_memory="8MiB",
            enable_lora=True,
            max_tokens_limit=500,
            max_prompt_tokens=64,
        )
        self.config.write_bytes(pickle.dumps((config, [], "text")))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        phases = os.open(os.devnull, os.O_WRONLY)  # its start's steps: not read here
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvgate.engine.process.core_process",
                self.socket,
                str(self.config),
            ]
            + [str(os.getpid()), str(phases)],
            cwd=REPO_ROOT,
            pass_fds=(phases,),
        )
        os.close(phases)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def engine_process(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EngineProcess]:
    process = EngineProcess(tmp_path_factory.mktemp("engine"), tiny_model_dir)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(engine_process: EngineProcess) -> Iterator[EngineClient]:
    client = EngineClient(engine_process.socket, 600)
    yield client
    client.shutdown()


async def idle(client: EngineClient, timeout_s: float = 5.0) -> bool:
    """The engine has nothing running and every KV block back (its state, every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_the_same_tokens_as_the_offline_llm(client: EngineClient, tiny_model_dir: Path):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    stream = client.submit(
        "Streaming, token by token", params, RequestOptions(kind=OutputKind.DELTA)
    )
    await stream.admitted()
    deltas = [out async for out in stream]
    assert deltas[-1].finished and stream.replica == 0
    offline = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB")
    expected = offline.generate("Streaming, token by token", params)[0]
    assert sum((o.token_ids for o in deltas), []) == expected.token_ids
    assert "".join(o.text for o in deltas) == expected.text
    (reference,) = offline.embed(["an embedding"])
    embedding = await client.embed("an embedding")
    assert embedding.prompt_token_ids == reference.prompt_token_ids
    assert embedding.embedding == pytest.approx(reference.embedding, abs=1e-5)
    assert client.checked_prompt("hello") == offline.core.encode_prompt("hello")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        client.checked_prompt([5, -7])
    assert await idle(client)


async def test_refusals_cross_with_their_fields(client: EngineClient):
    stream = client.submit("hi", SamplingParams(max_tokens=501))
    with pytest.raises(InvalidArgument) as refused:
        await stream.admitted()
    assert refused.value.field == "max_tokens" and "at most 500" in str(refused.value)
    stream = client.submit("hi", SamplingParams(max_tokens=5), RequestOptions(lora_name="nope"))
    with pytest.raises(UnknownAdapter) as unknown:
        await stream.admitted()
    assert unknown.value.field == "model" and unknown.value.name == "nope"
    with pytest.raises(TooManyTokens):  # checked here: nothing crosses
        client.submit(list(range(1, 70)), SamplingParams(max_tokens=5))


async def test_closing_a_stream_aborts_it_in_the_engine(client: EngineClient):
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    stream = client.submit("a long one", params, RequestOptions(kind=OutputKind.DELTA))
    await stream.admitted()
    await anext(stream)
    await stream.aclose()
    assert await idle(client)


async def test_adapters_and_grammars_live_in_the_engine(
    client: EngineClient, tmp_path: Path, tiny_model_dir: Path
):
    path = make_adapter(tiny_model_dir, tmp_path / "a", **ADAPTER_A)  # type: ignore[arg-type]
    await asyncio.to_thread(client.add_lora, "a", str(path))
    assert [(a.name, a.path) for a in client.list_loras()] == [("a", str(path))]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    stream = client.submit("with an adapter", params, RequestOptions(lora_name="a"))
    await stream.admitted()
    assert [out async for out in stream][-1].num_output_tokens == 4
    assert await asyncio.to_thread(client.remove_lora, "a") is True
    assert client.list_loras() == []
    spec = StructuredOutputs(choice=["yes", "no"])
    assert not client.grammar_compiled(spec)
    await asyncio.to_thread(client.compile_grammar, spec)
    assert client.grammar_compiled(spec)
    stream = client.submit("answer", SamplingParams(max_tokens=8, structured_outputs=spec))
    await stream.admitted()
    assert [out async for out in stream][-1].text in ("yes", "no")
    assert client.stats().grammar_cache_entries >= 1 or await _stats_caught_up(client)


async def _stats_caught_up(client: EngineClient) -> bool:
    await asyncio.sleep(0.6)
    return client.stats().grammar_cache_entries >= 1


async def test_a_dead_engine_fails_its_requests_and_comes_back(
    client: EngineClient, engine_process: EngineProcess
):
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    stream = client.submit("interrupted", params, RequestOptions(kind=OutputKind.DELTA))
    await stream.admitted()
    await anext(stream)
    engine_process.stop()
    with pytest.raises(EngineStepError, match="engine process exited"):
        async for _ in stream:
            pass
    assert not client.is_ready() and client.replicas_ready() == [False]
    with pytest.raises(EngineUnavailable):
        client.submit("refused", params)
    engine_process.start()
    deadline = time.monotonic() + 300
    while not client.is_ready():
        assert time.monotonic() < deadline, "the client did not reconnect"
        await asyncio.sleep(0.1)
    stream = client.submit("again", SamplingParams(max_tokens=3))
    await stream.admitted()
    assert [out async for out in stream][-1].num_output_tokens == 3
