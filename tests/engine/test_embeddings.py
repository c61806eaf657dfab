"""Embeddings on the generation engine: last-token pooling of the final normalized hidden
state, L2-normalized, against transformers (fp32) for Llama and Qwen3; scheduled beside
generations, batched, and from the prefix cache."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvgate.engine import LLM, AsyncLLM, SamplingParams
from kvgate.engine.errors import TooManyTokens
from tests.engine.test_llm import PROMPTS, assert_no_leaks

TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog, twice, and then once more."]


def hf_embedding(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """transformers' last hidden state (after the final norm) at the last token, normalized."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        base = model.model(torch.tensor([ids])).last_hidden_state
    last = out.hidden_states[-1][0, -1]
    torch.testing.assert_close(last, base[0, -1])  # hidden_states[-1] is after the norm
    return torch.nn.functional.normalize(last.float(), dim=-1).tolist()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    yield LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", max_model_len=256)


@pytest.mark.parametrize("arch", ["tiny", "qwen3"])
def test_embeddings_match_transformers_last_token_hidden_state(
    arch: str, tiny_model_dir: Path, hf_checkpoint, request: pytest.FixtureRequest
) -> None:
    path = tiny_model_dir if arch == "tiny" else hf_checkpoint(arch)
    engine = (
        request.getfixturevalue("llm")
        if arch == "tiny"
        else LLM(str(path), dtype="float32", kv_cache_memory="2MiB")
    )
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [*PROMPTS, *(engine.tokenizer.encode(t) for t in TEXTS)]
    batched = engine.embed(prompts)  # one step, prompts of different lengths
    for prompt, out in zip(prompts, batched, strict=True):
        assert out.prompt_token_ids == prompt
        assert math.isclose(sum(x * x for x in out.embedding), 1.0, rel_tol=1e-5)
        assert cosine(out.embedding, hf_embedding(reference, prompt)) >= 0.999
    singles = [engine.embed(p)[0].embedding for p in prompts]
    for single, out in zip(singles, batched, strict=True):
        assert cosine(single, out.embedding) >= 0.99999
    assert_no_leaks(engine)


def test_text_prompts_are_tokenized_with_special_tokens(llm: LLM) -> None:
    [by_text] = llm.embed(TEXTS[1])
    [by_ids] = llm.embed(llm.tokenizer.encode(TEXTS[1]))
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.embedding == pytest.approx(by_ids.embedding, abs=1e-6)
    assert_no_leaks(llm)


def test_a_cached_prompt_still_computes_its_last_token(llm: LLM) -> None:
    prompt = [(11 * i) % 700 + 40 for i in range(45)]  # two full blocks cached after one run
    first = llm.embed(prompt)[0]
    again = llm.embed(prompt)[0]
    assert first.cached_tokens == 0 and again.cached_tokens == 32
    assert cosine(first.embedding, again.embedding) >= 0.99999
    # a generation reuses the blocks an embedding published, and the other way round
    [generated] = llm.generate(prompt + [7], SamplingParams(max_tokens=2, temperature=0))
    assert generated.cached_tokens == 32
    assert_no_leaks(llm)


def test_embedding_inputs_are_checked_before_queueing(llm: LLM) -> None:
    limit = llm.core.max_embedding_len
    assert limit == llm.core.max_model_len  # nothing is generated after an embedding input
    assert len(llm.embed([5] * limit)[0].embedding) == llm.core.model_config.hidden_size
    with pytest.raises(TooManyTokens, match="in the input for embedding generation"):
        llm.embed([5] * (limit + 1))
    with pytest.raises(TooManyTokens, match=f"context length is {limit} tokens"):
        llm.embed("word " * (4 * limit))
    with pytest.raises(ValueError, match="must not be empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.embed([[10**9]])
    assert_no_leaks(llm)


def test_async_embeddings_batch_with_generations(tiny_model_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncLLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
        try:
            greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            stream = engine.submit(PROMPTS[1], greedy)
            vectors = await asyncio.gather(*(engine.embed(p) for p in PROMPTS))
            outputs = [out async for out in stream]
            assert outputs[-1].finished and len(outputs[-1].token_ids) == 8
            offline = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
            for got, want in zip(vectors, offline.embed(PROMPTS), strict=True):
                assert cosine(got.embedding, want.embedding) >= 0.99999
            # cancelled while waiting: the request is aborted and its blocks freed
            task = asyncio.create_task(engine.embed(list(range(20, 600))))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if engine.stats().num_running == engine.stats().num_waiting == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.core.pool.num_in_use() == 0
        finally:
            engine.shutdown()

    asyncio.run(main())
