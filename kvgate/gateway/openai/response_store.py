"""Stored responses, so ``previous_response_id`` continues a conversation on any gateway
process: kept in Redis (``--redis-url``) for ``--responses-ttl`` seconds, never in a process.

A stored response keeps the conversation it ends as chat messages (its input and its reply,
without its ``instructions``, which a continuation does not inherit) beside the Response
object. Without Redis nothing is stored: ``store: true`` and ``previous_response_id`` are
refused (400) rather than kept in one process's memory, which another process behind the same
load balancer would not have.

A stored response is its tenant's alone: its key is
``kvgate:response:{key_part(tenant)}:{id}`` and its record names the tenant, compared on
every read. Another tenant's id — continued, or rendered by ``/v1/responses/render``, which
reads it the same way — is a 404 worded exactly as for an unknown id. A record read back is
bounded and typed (``redis_records``) and its messages are checked as a chat's would be
(``parse.chat_messages``, ``template_messages``): a record that is not one of ours is that
same 404, never a 500.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kvgate.gateway.auth.identity import current_tenant
from kvgate.gateway.calls.errors import BadInput, Refused
from kvgate.gateway.function_calls.functions import template_messages
from kvgate.gateway.openai import requests as parse
from kvgate.gateway.openai.errors import OpenAIError
from kvgate.gateway.redis_records import MAX_RECORD_BYTES, RecordReader, key_part

KEY = "kvgate:response:"
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # responses_output.new_id("resp")
TIMEOUT_S = 1.0  # a slow Redis is a failed call, not a stalled one


def key_of(tenant: str, response_id: str) -> str:
    return f"{KEY}{key_part(tenant)}:{response_id}"


class ResponseStore:
    def __init__(self, url: str, ttl_s: int) -> None:
        from kvgate.gateway.redis_connection import connect  # imports redis only when asked

        self._redis = connect(url, socket_timeout=TIMEOUT_S)
        self._records = RecordReader(self._redis)
        self.ttl_s = ttl_s

    async def save(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Store the caller's ``response``; a 400 when it is too large to be read back."""
        tenant = current_tenant()
        value = orjson.dumps({"tenant": tenant, "response": response, "messages": messages})
        if len(value) > MAX_RECORD_BYTES:
            raise BadInput(
                f"this conversation is {len(value)} bytes stored, over the {MAX_RECORD_BYTES} "
                "a stored response may have: send it whole as 'input', with 'store' false",
                "store",
            )
        try:
            await self._redis.set(key_of(tenant, response["id"]), value, ex=self.ttl_s)
        except Exception as exc:  # noqa: BLE001 - any Redis failure: the answer says so
            raise _unavailable("storing the response", exc) from None

    async def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The messages the caller's ``response_id`` ended with (404 when unknown, expired,
        another tenant's or not a record of ours)."""
        tenant = current_tenant()
        messages = None
        if RESPONSE_ID.fullmatch(response_id) is not None:
            try:
                messages = await self._records.read(
                    key_of(tenant, response_id), lambda data: _messages(data, tenant)
                )
            except Exception as exc:  # noqa: BLE001
                raise _unavailable("reading the previous response", exc) from None
        if messages is None:
            raise OpenAIError(
                404,
                f"Response with id '{response_id}' not found (unknown, or older than its "
                "stored lifetime)",
                "invalid_request_error",
                "previous_response_id",
                "not_found",
            )
        return messages

    async def aclose(self) -> None:
        await self._redis.aclose()


def _messages(data: Any, tenant: str) -> list[dict[str, Any]]:
    """The conversation of a stored record of ``tenant``'s: its messages pass the checks a
    chat's do (ValueError for anything else)."""
    if not isinstance(data, dict) or data.get("tenant") != tenant:
        raise ValueError("not a stored response of this tenant")
    try:
        messages = parse.chat_messages(data)
        template_messages(messages)  # raises for an earlier call it could not render
    except BadInput as exc:
        raise ValueError(str(exc)) from None
    return messages


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
