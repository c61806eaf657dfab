"""Stored responses, so ``previous_response_id`` continues a conversation on any gateway
process: kept in Redis (``--redis-url``) for ``--responses-ttl`` seconds, never in a process.

A stored response keeps the conversation it ends as chat messages (its input and its reply,
without its ``instructions``, which a continuation does not inherit) beside the Response
object. Without Redis nothing is stored: ``store: true`` and ``previous_response_id`` are
refused (400) rather than kept in one process's memory, which another process behind the same
load balancer would not have.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.calls.errors import BadInput, Refused
from gateway.openai.errors import OpenAIError

KEY = "kvgate:response:"
TIMEOUT_S = 1.0  # a slow Redis is a failed call, not a stalled one


class ResponseStore:
    def __init__(self, url: str, ttl_s: int) -> None:
        from gateway.redis_connection import connect  # imports redis only when asked

        self._redis = connect(url, socket_timeout=TIMEOUT_S)
        self.ttl_s = ttl_s

    async def save(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        value = orjson.dumps({"response": response, "messages": messages})
        try:
            await self._redis.set(KEY + response["id"], value, ex=self.ttl_s)
        except Exception as exc:  # noqa: BLE001 - any Redis failure: the answer says so
            raise _unavailable("storing the response", exc) from None

    async def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The messages ``response_id`` ended with (404 when unknown or expired)."""
        try:
            value = await self._redis.get(KEY + response_id)
        except Exception as exc:  # noqa: BLE001
            raise _unavailable("reading the previous response", exc) from None
        if value is None:
            raise OpenAIError(
                404,
                f"Response with id '{response_id}' not found (unknown, or older than its "
                "stored lifetime)",
                "invalid_request_error",
                "previous_response_id",
                "not_found",
            )
        messages: list[dict[str, Any]] = orjson.loads(value)["messages"]
        return messages

    async def aclose(self) -> None:
        await self._redis.aclose()


def refuse_without_store(store: bool, previous_response_id: str | None) -> None:
    """What a gateway with no ``--redis-url`` cannot do, said as a 400."""
    for asked, field in (
        (store, "store"),
        (previous_response_id is not None, "previous_response_id"),
    ):
        if asked:
            raise BadInput(
                f"'{field}' needs a gateway started with --redis-url (responses are stored "
                "there, for any gateway process to continue); this one is stateless: send "
                "the whole conversation as 'input', with 'store' false or absent",
                field,
            )


def _unavailable(what: str, exc: Exception) -> Refused:
    return Refused(503, "response_store", f"Redis is unavailable ({what}): {exc}", 1)
