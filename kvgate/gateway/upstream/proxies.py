"""The fleet's requests that are not generations: tokenizing and embeddings.

With ``--tokenizer`` (or ``--model``) the gateway tokenizes itself; without it ``tokenize``
and ``tokenize_request`` (a vLLM ``/tokenize`` body, answered in full) ask a healthy upstream,
whose answer is checked before it is relayed. Embeddings are proxied the same way to an
upstream's ``/v1/embeddings`` (one call for all the inputs, a bounded read, the answer's shape
checked), as a client would call the upstream itself. Neither is counted in an upstream's
in-flight calls (routing weighs generations), and neither is retried: a failure is the
caller's answer.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.engine.errors import EngineOverloaded, EngineUnavailable
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.calls.errors import BadInput, UpstreamFailed
from kvgate.gateway.generation import (
    Embeddings,
    EmbeddingsRequest,
    GenerationRequest,
    OffLoop,
    Tokenized,
    TokenizeRequest,
    tokenize_here,
)
from kvgate.gateway.upstream import bounded, embeddings
from kvgate.gateway.upstream.choice import Route
from kvgate.gateway.upstream.failures import TRANSPORT_ERRORS, AttemptFailed, transport_failure
from kvgate.gateway.upstream.upstream import retry_after

# What of a vLLM /tokenize body goes upstream (its completion and chat forms); ``model`` is
# always the fleet's.
TOKENIZE_FIELDS = (
    "prompt",
    "messages",
    "add_special_tokens",
    "return_token_strs",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
)
# A /tokenize answer is read up to this many bytes per byte of the request (a token's id and
# text in JSON, escapes included, for each byte tokenized), plus a fixed allowance.
TOKENIZE_BYTES_PER_BYTE = 64
TOKENIZE_MIN_BYTES = 1 << 16


class Proxies:
    def __init__(
        self,
        route: Route,
        model_name: str,
        max_model_len: int,
        tokenizer: Tokenizer | None,
        off_loop: OffLoop,
    ) -> None:
        self.route = route
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._tokenizer = tokenizer
        self.off_loop = off_loop

    async def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """A text or a conversation tokenized as ``tokenize`` does; token ids as given: the
        upstreams' vocabulary is not known here, so their own calls check them."""
        if isinstance(request.prompt, list):
            return request.prompt
        if request.messages is None:
            return (await self.tokenize(TokenizeRequest(request.prompt))).ids
        conversation = TokenizeRequest(
            messages=request.messages,
            tools=request.template_tools,
            chat_template_kwargs=request.chat_template_kwargs,
        )
        return (await self.tokenize(conversation)).ids

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        """With a local tokenizer (``--tokenizer``) here; else by an upstream's ``/tokenize``."""
        if self._tokenizer is not None:
            tokenizer, limit = self._tokenizer, self.max_model_len
            return await self.off_loop.run(request.chars, tokenize_here, tokenizer, limit, request)
        body: dict[str, Any] = {
            "add_special_tokens": request.add_special_tokens,
            "return_token_strs": request.token_strs,
        }
        if request.messages is not None:
            body["messages"] = request.messages
            body.update((k, v) for k, v in request.template().items() if v is not None)
        else:
            body["prompt"] = request.text
        answer = await self.tokenize_request(body)
        return Tokenized(answer["tokens"], answer["token_strs"] if request.token_strs else None)

    async def tokenize_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """A vLLM ``/tokenize`` body (``prompt`` or ``messages``, ``add_special_tokens``,
        ``return_token_strs``, the chat form's template fields) sent to a healthy upstream
        (``post``); its answer checked and rebuilt: ``{"count", "max_model_len", "tokens",
        "token_strs"}``."""
        sent = {"model": self.model_name, **{k: body[k] for k in TOKENIZE_FIELDS if k in body}}
        limit = TOKENIZE_MIN_BYTES + TOKENIZE_BYTES_PER_BYTE * len(orjson.dumps(sent))
        answer, where = await self.post("/tokenize", sent, limit)
        return _tokenized(answer, where)

    async def embed(self, request: EmbeddingsRequest) -> Embeddings:
        """The inputs sent to a healthy upstream's ``/v1/embeddings`` (``post``) as one call,
        floats asked for; its answer read within a bound per input and checked."""
        sent: dict[str, Any] = {
            "model": self.model_name,
            "input": request.inputs,
            "encoding_format": "float",
        }
        if request.cache_salt is not None:
            sent["cache_salt"] = request.cache_salt
        limit = embeddings.answer_limit(len(request.inputs))
        answer, where = await self.post("/v1/embeddings", sent, limit)
        return embeddings.embeddings_of(answer, len(request.inputs), where)

    async def post(self, path: str, sent: dict[str, Any], limit: int) -> tuple[bytes, str]:
        """``sent`` POSTed to ``path`` on a healthy upstream, its answer read within ``limit``
        bytes; the answer and where it came from. An upstream 4xx is ``BadInput`` (its
        message, at most 200 characters), 429/503 ``EngineOverloaded``, a transport failure
        ``EngineUnavailable`` (the upstream counted as failed), anything else
        ``UpstreamFailed``."""
        upstream = self.route.choose([], None, set())
        try:
            response = await upstream.post(path, orjson.dumps(sent))
            try:
                answer = await bounded.read_within(response, limit)
            finally:
                response.close()
        except TRANSPORT_ERRORS as exc:
            failure = transport_failure(exc, upstream.url)
            self.route.failed(upstream, failure)
            raise EngineUnavailable(str(failure)) from None
        except AttemptFailed as failure:
            self.route.failed(upstream, failure)
            raise EngineUnavailable(str(failure)) from None
        where = f"upstream {upstream.url} {path}"
        if answer is None:
            raise UpstreamFailed(f"{where}: its answer is over {limit} bytes")
        status = response.status
        if status in (429, 503):
            wait_s = retry_after(response.headers.get("retry-after"))
            raise EngineOverloaded(f"{where}: answered {status}", wait_s)
        if 400 <= status < 500:
            message, param = _error_of(answer)
            raise BadInput(message[:200], param)  # as a direct call would answer
        if status != 200:
            raise UpstreamFailed(f"{where} answered {status}")
        return answer, where


def _error_of(answer: bytes) -> tuple[str, str | None]:
    """An OpenAI-shaped error body's message and ``param`` (vLLM writes either
    ``{"error": {...}}`` or the error object itself); any other body as text."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return answer.decode(errors="replace").strip() or "no message", None
    error = body.get("error", body) if isinstance(body, dict) else body
    if not isinstance(error, dict):
        return str(error), None
    message = error.get("message") or error.get("detail") or error
    param = error.get("param")
    field = param if isinstance(param, str) and 0 < len(param) <= 64 else None
    return (message if isinstance(message, str) else str(message)), field


def _tokenized(answer: bytes, where: str) -> dict[str, Any]:
    """A ``/tokenize`` answer's four fields, each of the type vLLM gives it (UpstreamFailed
    for anything else)."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise UpstreamFailed(f"{where}: its answer is not JSON: {answer[:200]!r}") from None
    if not isinstance(body, dict):
        raise UpstreamFailed(f"{where}: its answer is not an object")
    tokens, count, max_model_len = body.get("tokens"), body.get("count"), body.get("max_model_len")
    strs = body.get("token_strs")
    problem = None
    if not (isinstance(tokens, list) and all(_natural(t) for t in tokens)):
        problem = "'tokens' is not a list of token ids"
    elif not (_natural(count) and count == len(tokens)):
        problem = "'count' is not the number of tokens"
    elif not (isinstance(max_model_len, int) and _natural(max_model_len) and max_model_len > 0):
        problem = "'max_model_len' is not a positive integer"
    elif strs is not None and not (
        isinstance(strs, list)
        and len(strs) == len(tokens)
        and all(isinstance(t, str) for t in strs)
    ):
        problem = "'token_strs' is not null or a string for each token"
    if problem is not None:
        raise UpstreamFailed(f"{where}: malformed answer: {problem}")
    return {"count": count, "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
