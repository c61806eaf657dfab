"""A call's token ids for precise routing when the gateway has no tokenizer: the upstreams'
own ``/tokenize``, cached per tenant and prefix.

Precise routing keys a call's blocks by token content (``kv_index``), so it needs the very
ids the upstream will compute. Without ``--tokenizer`` the gateway asks an upstream's
``/tokenize`` (all of them serve the same model: ``Fleet.connect`` checks): a text prompt as
``prompt`` (its first ``PREFIX_CHARS`` characters: the prefix is what routes), a
conversation as ``messages`` with its tools and template variables, so the chat template is
rendered by the same code that will render the call (one rendered here could differ by a
space and match nothing).

The answers are kept in an LRU keyed by the tenant's cache salt and a digest of the text (or
of the conversation), bounded in entries and in tokens: an agent's retries, parallel calls
and a shared prompt sent again ask once. A failed ``/tokenize`` costs the call nothing but
precision: it routes by hash. Asking is not a routing decision: the least loaded healthy
upstream answers, and ``kvgate_routing_decisions`` does not count it.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import orjson

from kvgate.engine.errors import EngineOverloaded, EngineUnavailable
from kvgate.gateway.calls.errors import BadInput, UpstreamFailed
from kvgate.gateway.generation import GenerationRequest, OffLoop, TokenizeRequest
from kvgate.gateway.upstream.choice import Chooser
from kvgate.gateway.upstream.failures import AttemptFailed
from kvgate.gateway.upstream.precise import PromptBlocks
from kvgate.gateway.upstream.proxies import Proxies
from kvgate.gateway.upstream.upstream import Upstream

logger = logging.getLogger("kvgate.fleet")
PREFIX_CHARS = 65_536  # of a text prompt, tokenized for routing (~16k tokens)
# A text cut at PREFIX_CHARS may end mid-word: its last tokens are not the whole text's.
BOUNDARY_TOKENS = 8
MAX_ENTRIES = 4096
MAX_TOKENS = 8_000_000  # ids kept in all (4 bytes each)
ASK_FAILURES = (EngineUnavailable, EngineOverloaded, UpstreamFailed, BadInput)


class UpstreamTokens:
    """``token_ids(request)``: a text or chat call's ids as its upstream counts them."""

    def __init__(
        self, chooser: Chooser, model_name: str, max_model_len: int, off_loop: OffLoop
    ) -> None:
        self._proxies = Proxies(_Untallied(chooser), model_name, max_model_len, None, off_loop)
        self._cache: OrderedDict[bytes, array[int]] = OrderedDict()
        self._tokens = 0

    async def token_ids(self, request: GenerationRequest) -> list[int] | None:
        """The ids of the call's prompt (of its first ``PREFIX_CHARS`` when it is a longer
        text); None for token ids given (they route as they are) or when no upstream answers."""
        if isinstance(request.prompt, list):
            return None
        asked, key = self._tokenize_request(request)
        ids = self._cache.get(key)
        if ids is not None:
            self._cache.move_to_end(key)
            return ids.tolist()
        try:
            answer = (await self._proxies.tokenize(asked)).ids
        except ASK_FAILURES as exc:
            logger.debug("tokenizing for precise routing failed: %s", exc)
            return None
        if isinstance(request.prompt, str) and len(request.prompt) > PREFIX_CHARS:
            answer = answer[:-BOUNDARY_TOKENS]
        self._keep(key, answer)
        return answer

    def _tokenize_request(self, request: GenerationRequest) -> tuple[TokenizeRequest, bytes]:
        """What ``/tokenize`` is asked, and its cache key (the tenant's salt first)."""
        digest = hashlib.sha256((request.cache_salt or "").encode() + b"\0")
        if request.messages is None:
            assert isinstance(request.prompt, str)
            asked = TokenizeRequest(request.prompt[:PREFIX_CHARS])
            digest.update(b"text\0" + (asked.text or "").encode())
        else:
            asked = TokenizeRequest(
                messages=request.messages,
                tools=request.template_tools,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            digest.update(b"chat\0" + orjson.dumps(asked.messages))
            digest.update(orjson.dumps([asked.tools, asked.chat_template_kwargs]))
        return asked, digest.digest()

    def _keep(self, key: bytes, ids: Sequence[int]) -> None:
        if len(ids) > MAX_TOKENS // 16:  # one answer must not empty the cache
            return
        self._cache[key] = array("i", ids)
        self._tokens += len(ids)
        while len(self._cache) > MAX_ENTRIES or self._tokens > MAX_TOKENS:
            _, evicted = self._cache.popitem(last=False)
            self._tokens -= len(evicted)


class _Untallied:
    """The ``Route`` of a request made for routing: the least loaded healthy upstream, not
    counted as a call's routing decision."""

    def __init__(self, chooser: Chooser) -> None:
        self.chooser = chooser

    def choose(
        self,
        hashes: list[bytes],
        cache_key: str | None,
        tried: set[int],
        placed: Upstream | None = None,
        prompt: PromptBlocks | None = None,
    ) -> Upstream:
        healthy = [u for u in self.chooser.members.upstreams if u.breaker.available()]
        if not healthy:
            raise EngineUnavailable("no healthy upstream to tokenize on")
        return min(healthy, key=self.chooser.load)

    def failed(self, upstream: Upstream, failure: AttemptFailed) -> None:
        self.chooser.failed(upstream, failure)
