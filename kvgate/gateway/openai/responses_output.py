"""A ``Response`` object, and its stream events, built from one generation's items.

One builder serves both answers: it turns ``TextDelta``s into output items as they come — a
``reasoning`` item (its ``reasoning_text``), a ``message`` (its ``output_text``), a
``function_call`` per call —, each opened (``output_item.added``, ``content_part.added``),
grown (``output_text.delta``, ``reasoning_text.delta``, ``function_call_arguments.delta``)
and closed (``….done``, ``output_item.done``) with a ``sequence_number``; a whole answer is
the same build with its events dropped, so a stream's deltas always join to the whole text.
A reply cut by ``max_output_tokens`` is ``incomplete`` with ``incomplete_details.reason``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from kvgate.gateway.generation import Completion, TextDelta

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    def __init__(self, model: str, echo: dict[str, Any], extra: dict[str, Any]) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.model, self.echo, self.extra = model, echo, extra
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item text is flowing into
        self._calls: dict[int, dict[str, Any]] = {}  # call index → its function_call item
        self._sequence = 0
        self.reasoning_tokens = 0
        self.done: Completion | None = None

    # -- the Response object ----------------------------------------------------------------

    def response(self, status: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": self.output if status != "in_progress" else [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
            **self.echo,
            **self.extra,
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.done is not None:
            body["usage"] = self._usage(self.done)
        return body

    def _usage(self, done: Completion) -> dict[str, Any]:
        return {
            "input_tokens": done.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": done.cached_tokens,
                # the prompt tokens computed (their full blocks join the prefix cache)
                "cache_write_tokens": done.prompt_tokens - done.cached_tokens,
            },
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        }

    @property
    def status(self) -> str:
        assert self.done is not None
        return "incomplete" if self.done.finish_reason == "length" else "completed"

    # -- events -----------------------------------------------------------------------------

    def start(self) -> list[Event]:
        body = self.response("in_progress")
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def add(self, item: TextDelta | Completion) -> list[Event]:
        events: list[Event] = []
        if isinstance(item, Completion):
            self.done = item
            if not self.output:  # an empty reply is an empty message, as OpenAI and vLLM give it
                events += self._open_item("message")
            events += self._close()
            status = self.status
            final = self.response(status)
            name = "response.completed" if status == "completed" else "response.incomplete"
            return events + [self._event(name, response=final)]
        if item.reasoning:
            self.reasoning_tokens += len(item.token_ids)
            events += self._grow("reasoning", item.reasoning)
        if item.text:
            events += self._grow("message", item.text)
        for entry in item.tool_calls or ():
            events += self._call(entry)
        return events

    def _grow(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._open_item(kind)
        assert self._open is not None
        part = self._open["content"][0]
        part["text"] += text
        where = self._where(self._open)
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(name, **where, content_index=0, delta=text, **extra)]

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "message":
            item: dict[str, Any] = {"id": new_id("msg"), "type": "message", "role": "assistant"}
            part: dict[str, Any] = {
                "type": "output_text",
                "text": "",
                "annotations": [],
                "logprobs": [],
            }
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": []}
            part = {"type": "reasoning_text", "text": ""}
        item.update(status="in_progress", content=[])
        added = self._event(
            "response.output_item.added", output_index=len(self.output), item=_copy(item)
        )
        item["content"] = [part]
        self.output.append(item)
        self._open = item
        where = self._where(item)
        empty = {**part, "text": ""}
        return [
            added,
            self._event("response.content_part.added", **where, content_index=0, part=empty),
        ]

    def _call(self, entry: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        index, function = entry["index"], entry.get("function", {})
        item = self._calls.get(index)
        if item is None:
            events += self._close()
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": entry.get("id") or new_id("call"),
                "name": function.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            events.append(
                self._event(
                    "response.output_item.added", output_index=len(self.output), item=dict(item)
                )
            )
            self._calls[index] = item
            self.output.append(item)
        delta = function.get("arguments", "")
        if delta:
            item["arguments"] += delta
            events.append(
                self._event(
                    "response.function_call_arguments.delta", **self._where(item), delta=delta
                )
            )
        return events

    def _close(self) -> list[Event]:
        """Close the open text item and every call (a call closes when the reply ends or text
        follows it)."""
        events: list[Event] = []
        status = (
            "incomplete"
            if self.done is not None and self.done.finish_reason == "length"
            else "completed"
        )
        if self._open is not None:
            item, self._open = self._open, None
            where, part = self._where(item), item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
            item["status"] = status if item["type"] == "message" else "completed"
            events += [
                self._event(
                    f"response.{kind}.done", **where, content_index=0, text=part["text"], **extra
                ),
                self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event(
                    "response.output_item.done", output_index=where["output_index"], item=item
                ),
            ]
        if self.done is not None:
            for call in self._calls.values():
                events += self._close_call(call, status)
        return events

    def _close_call(self, item: dict[str, Any], status: str) -> list[Event]:
        item["status"] = status
        where = self._where(item)
        done = self._event(
            "response.function_call_arguments.done",
            **where,
            name=item["name"],
            arguments=item["arguments"],
        )
        return [
            done,
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def error_event(self, code: str | None, message: str, param: str | None) -> Event:
        return self._event("error", code=code, message=message, param=param)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    # -- what a later turn continues from ---------------------------------------------------

    def assistant_messages(self) -> list[dict[str, Any]]:
        """The reply as chat messages (for a stored response that ``previous_response_id``
        continues)."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.output
            if i["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": list(item.get("content", []))}
