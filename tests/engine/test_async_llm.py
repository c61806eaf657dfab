"""The asyncio engine: streaming, cancellation, and nothing left behind."""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import pytest

from kvgate.engine import LLM, AsyncLLM, EngineConfig, EngineOverloaded, OutputKind, SamplingParams
from kvgate.engine.errors import TooManyTokens
from kvgate.engine.request_options import RequestOptions
from tests.engine.tokenization.test_tokenizer import CountingBackend

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[AsyncLLM]:
    engine = AsyncLLM(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="2MiB", replicas=2)
    )
    yield engine
    engine.shutdown()
    engine.core.pool.check_invariants()


async def all_blocks_released(engine: AsyncLLM, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.core.pool.num_in_use() == 0 and engine.stats().num_running == 0:
            engine.core.pool.check_invariants()
            return True
        await asyncio.sleep(0.01)
    return False


async def test_streamed_deltas_add_up_to_the_offline_result(engine: AsyncLLM, tiny_model_dir: Path):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = "Streaming, token by token"
    outputs = [out async for out in engine.generate(prompt, params)]
    deltas = [
        out async for out in engine.generate(prompt, params, RequestOptions(kind=OutputKind.DELTA))
    ]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    final = outputs[-1]
    assert sum((o.token_ids for o in deltas), []) == final.token_ids
    assert "".join(o.text for o in deltas) == final.text
    offline = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB")
    assert final.token_ids == offline.generate("Streaming, token by token", params)[0].token_ids
    assert await all_blocks_released(engine)


async def test_a_reader_ten_times_slower_than_generation_holds_one_buffered_output(
    engine: AsyncLLM,
):
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompt = "A slow reader"
    started = time.perf_counter()
    fast = [o async for o in engine.generate(prompt, params, RequestOptions(kind=OutputKind.DELTA))]
    per_token_s = (time.perf_counter() - started) / 60
    stream = engine.submit(prompt, params, RequestOptions(kind=OutputKind.DELTA))
    outputs, most_buffered = [], 0
    async with aclosing(stream):
        async for output in stream:
            outputs.append(output)
            await asyncio.sleep(10 * per_token_s)
            most_buffered = max(most_buffered, stream.num_buffered)
    assert most_buffered == 1  # the step thread merged what the reader had not taken
    assert len(outputs) < len(fast)  # fewer, larger deltas ...
    assert sum((o.token_ids for o in outputs), []) == sum((o.token_ids for o in fast), [])
    assert "".join(o.text for o in outputs) == "".join(o.text for o in fast)  # ... same text
    assert await all_blocks_released(engine)


async def test_concurrent_requests_are_batched_and_all_finish(engine: AsyncLLM):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def run(prompt: str) -> list[int]:
        return [o async for o in engine.generate(prompt, params)][-1].token_ids

    prompts = [f"request number {i} " * (i + 1) for i in range(6)]
    results = await asyncio.gather(*(run(p) for p in prompts))
    assert all(len(r) == 10 for r in results)
    assert results == await asyncio.gather(*(run(p) for p in prompts))  # again, from cache
    assert engine.stats().prefix_hits > 0
    assert await all_blocks_released(engine)


async def test_closing_the_stream_aborts_and_frees_the_blocks(engine: AsyncLLM):
    stream = engine.generate("a long generation we walk away from", LONG)
    async for out in stream:
        if len(out.token_ids) >= 3:
            break
    assert engine.core.pool.num_in_use() > 0
    await stream.aclose()
    assert await all_blocks_released(engine)


async def test_cancelling_the_consumer_task_aborts_the_request(engine: AsyncLLM):
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("cancel me", LONG):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await all_blocks_released(engine)


async def test_bad_input_raises_before_anything_is_queued(engine: AsyncLLM):
    with pytest.raises(ValueError, match="prompt"):
        await anext(engine.generate([1] * (engine.max_model_len + 5), LONG))
    assert engine.stats().num_waiting == 0


async def test_surface_for_the_gateway(engine: AsyncLLM):
    messages = [{"role": "user", "content": "hi"}]
    ids = engine.apply_chat_template(messages)
    assert ids == engine.tokenizer.encode_chat(messages)
    assert engine.model_name and engine.max_model_len > 16 and engine.is_ready()
    stats = engine.stats()
    assert stats.block_size == 16 and len(stats.per_replica) == 2


async def test_idle_step_threads_sleep_instead_of_spinning(engine: AsyncLLM):
    await asyncio.sleep(0.1)
    before = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.sleep(0.5)
    after = resource.getrusage(resource.RUSAGE_SELF)
    busy = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert busy < 0.1


async def test_shutdown_stops_the_threads_and_ends_open_streams(tiny_model_dir: Path):
    engine = AsyncLLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB")
    stream = engine.generate("interrupted", LONG)
    await anext(stream)
    engine.shutdown()
    assert not engine.is_ready()
    with pytest.raises(RuntimeError, match="shut down"):
        async for _ in stream:
            pass


async def test_a_cache_salt_keeps_tenants_apart(engine: AsyncLLM):
    params = SamplingParams(max_tokens=1, temperature=0)
    prompt = list(range(300, 340))

    async def cached(salt: str | None) -> int:
        return [o async for o in engine.generate(prompt, params, RequestOptions(cache_salt=salt))][
            -1
        ].cached_tokens

    assert await cached("tenant-a") == 0
    assert await cached("tenant-a") == 32
    assert await cached("tenant-b") == 0
    assert await cached(None) == 0


async def test_waiting_queue_is_bounded_and_a_refusal_queues_nothing(tiny_model_dir: Path):
    engine = AsyncLLM(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            kv_cache_memory="1MiB",
            max_num_seqs=1,
            max_waiting=2,
        )
    )
    try:
        streams = [engine.generate(f"queued {i}", LONG) for i in range(3)]
        await anext(streams[0])  # running
        firsts = [asyncio.ensure_future(anext(s)) for s in streams[1:]]  # 2 wait
        await asyncio.sleep(0.05)
        assert engine.stats().num_running == 1 and engine.stats().num_waiting == 2
        with pytest.raises(EngineOverloaded, match="capacity"):
            await anext(engine.generate("one too many", LONG))
        assert engine.stats().num_waiting == 2
        for first in firsts:
            first.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        assert await all_blocks_released(engine)
        outs = [o async for o in engine.generate("room again", SamplingParams(max_tokens=2))]
        assert outs[-1].finished
    finally:
        engine.shutdown()


async def test_prompt_and_max_tokens_limits_name_the_field(tiny_model_dir: Path):
    engine = AsyncLLM(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            kv_cache_memory="1MiB",
            max_prompt_tokens=8,
            max_tokens_limit=16,
        )
    )
    try:
        with pytest.raises(ValueError, match="max_tokens: at most 16"):
            await anext(engine.generate("hi", SamplingParams(max_tokens=17)))
        with pytest.raises(ValueError, match="prompt: 20 tokens, at most 8"):
            await anext(engine.generate([5] * 20, SamplingParams(max_tokens=4)))
        outs = [o async for o in engine.generate([5] * 8, SamplingParams(max_tokens=16))]
        assert outs[-1].finished
    finally:
        engine.shutdown()


async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(tiny_model_dir: Path):
    """Text over max_prompt_len x 12 bytes (the tiny vocabulary's longest token) cannot fit:
    submit, encode_prompt and apply_chat_template refuse it with the too-long error before
    the tokenizer sees it."""
    engine = AsyncLLM(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB", max_model_len=64
        )
    )
    counting = CountingBackend(engine.tokenizer.backend)
    engine.tokenizer.backend = counting  # type: ignore[assignment]
    too_long = "word " * 152  # 760 bytes > 63 x 12: at least 64 tokens
    try:
        no_room = "prompt: at least 64 tokens leave no room to generate within max_model_len 64"
        with pytest.raises(TooManyTokens, match=no_room):
            await anext(engine.generate(too_long, SamplingParams(max_tokens=1)))
        with pytest.raises(TooManyTokens, match=no_room):
            engine.checked_prompt(too_long)
        with pytest.raises(TooManyTokens, match="prompt: at least"):
            engine.apply_chat_template([{"role": "user", "content": too_long}])
        assert counting.calls == 0
        fits_by_bytes = "word " * 100  # under the floor's limit, so it is counted exactly
        count = len(counting.backend.encode(fits_by_bytes).ids)  # type: ignore[attr-defined]
        with pytest.raises(TooManyTokens, match=f"prompt: {count} tokens leave no room"):
            await anext(engine.generate(fits_by_bytes, SamplingParams(max_tokens=1)))
        assert counting.calls == 1
    finally:
        engine.shutdown()
