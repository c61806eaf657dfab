"""Clients nobody here wrote, against the live gateway's chat completions (and embeddings), as
a new user would call them: LiteLLM, LangChain's ``ChatOpenAI`` / ``OpenAIEmbeddings`` and
Pydantic AI's OpenAI chat model. Each is skipped when its package is absent (LiteLLM is not
in the dev extra: it brings boto3 and more)."""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

import httpx
import openai
import pytest

from kvgate.engine import AsyncLLM, SamplingParams
from tests.engine.test_embeddings import cosine
from tests.gateway.live_server import LiveServer

PROMPT = "Tell me a story about a clockmaker."
MAX_TOKENS = 8


async def greedy_reply(engine: AsyncLLM) -> str:
    """The engine's own greedy reply to ``PROMPT`` as a chat turn (what every client must get)."""
    prompt = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [o async for o in engine.generate(prompt, params)][-1].text


def engine_reply(engine: AsyncLLM) -> str:
    return asyncio.run(greedy_reply(engine))


def engine_embedding(engine: AsyncLLM, text: str) -> list[float]:
    return asyncio.run(engine.embed(text)).embedding


# LiteLLM's own: a TypedDict pydantic warns about, and an event loop it opens and never closes
# (collected here, so that no later test meets it).
@pytest.mark.filterwarnings("ignore:.*the `ReadOnly` qualifier:UserWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_litellm_completion_and_embedding(server: LiveServer, engine: AsyncLLM) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetched from the web
    litellm: Any = pytest.importorskip("litellm")
    try:
        _litellm_calls(litellm, server, engine)
    finally:
        gc.collect()


def _litellm_calls(litellm: Any, server: LiveServer, engine: AsyncLLM) -> None:
    base = server.base + "/v1"
    with openai.OpenAI(base_url=base, api_key="unused") as client:  # ours, closed here
        where = {"api_base": base, "api_key": "unused", "client": client}
        model = f"openai/{engine.model_name}"
        reply = litellm.completion(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            **where,
        )
        assert reply.choices[0].message.content == engine_reply(engine)
        assert reply.usage.completion_tokens > 0
        vectors = litellm.embedding(model=model, input=["Hi"], **where)
    assert cosine(vectors.data[0]["embedding"], engine_embedding(engine, "Hi")) >= 0.9999


def test_langchain_chat_openai_and_embeddings(server: LiveServer, engine: AsyncLLM) -> None:
    langchain_openai: Any = pytest.importorskip("langchain_openai")
    with httpx.Client() as http:  # ours, closed here: the default one outlives the test
        where = {
            "base_url": server.base + "/v1",
            "api_key": "unused",
            "model": engine.model_name,
            "http_client": http,
        }
        chat = langchain_openai.ChatOpenAI(max_tokens=MAX_TOKENS, temperature=0, **where)
        assert chat.invoke(PROMPT).content == engine_reply(engine)
        # tiktoken's ctx-length check would download an encoding: kvgate counts tokens itself
        embeddings = langchain_openai.OpenAIEmbeddings(check_embedding_ctx_length=False, **where)
        assert cosine(embeddings.embed_query("Hi"), engine_embedding(engine, "Hi")) >= 0.9999


async def test_pydantic_ai_agent_on_chat_completions(server: LiveServer, engine: AsyncLLM) -> None:
    pytest.importorskip("pydantic_ai")
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    # Our own client, closed here (the provider's default one is shared and never closed).
    async with AsyncOpenAI(base_url=server.base + "/v1", api_key="unused") as client:
        model = OpenAIChatModel(engine.model_name, provider=OpenAIProvider(openai_client=client))
        result = await Agent(model).run(
            PROMPT, model_settings={"max_tokens": MAX_TOKENS, "temperature": 0}
        )
    assert result.output == await greedy_reply(engine)
