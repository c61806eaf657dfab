"""Tool calls read back out of a reply as it streams, in any family's syntax.

``CallParser.feed(text)`` takes each new piece of the reply (cut anywhere: mid-tag, mid-key)
and returns events — ``Content`` for text outside calls, ``CallStart`` once a call's name is
complete, then ``Arguments`` fragments of its arguments' JSON text as they arrive — the
shape of OpenAI's ``delta.content`` / ``delta.tool_calls``. ``finish()`` flushes what was held
back. ``parse(text)`` is the same machine fed at once, so a non-streamed answer is exactly
what its streamed deltas accumulate to. Text that only looked like a call (an opener not
followed by a call object, an object without a name) is given back as content.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.gateway.function_calls.formats import Family

ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


@dataclass
class FunctionCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class Parsed:
    content: str | None  # None when the reply was only calls
    calls: list[FunctionCall] = field(default_factory=list)


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's default id shape


def short_call_id() -> str:
    """9 letters and digits: what Mistral's chat templates accept back (vLLM's too)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class _CallObject:
    """One ``{"name": ..., "arguments": ...}`` object, scanned a character at a time: its
    name once complete, its arguments text as it arrives (an object or array streams; any
    other value is given whole, a string decoded)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = False
        self.part = "key"  # key | colon | value_start | value (scalar) | after
        self.key: str | None = None
        self.token: list[str] = []  # the current key, or the current top-level value
        self.streaming = False  # the arguments value is an object/array being streamed
        self.name: str | None = None
        self.pending: list[str] = []  # arguments text not yet handed out
        self.has_arguments = False
        self.done = self.bad = False

    def feed(self, ch: str) -> None:
        if self.depth == 0:  # the opening brace
            self.depth = 1
            return
        if self.in_string:
            self._append(ch)
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_closed()
            return
        if self.depth >= 2:  # inside a nested value
            self._append(ch)
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_done()
            return
        self._top(ch)

    def _top(self, ch: str) -> None:
        part = self.part
        if ch in WHITESPACE and part != "value":
            return
        if part == "key":
            if ch == '"':
                self.in_string, self.token = True, ['"']
            elif ch == "}" and self.key is None:
                self.done = True
            else:
                self.bad = True
        elif part == "colon":
            self.part = "value_start" if ch == ":" else self.part
            self.bad = ch != ":"
        elif part == "value_start":
            self.token = [ch]
            self.streaming = self.key in ARGUMENT_KEYS and ch in "{["
            if self.streaming:
                self.has_arguments = True
                self.pending.append(ch)
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.part = "value"
        elif part in ("value", "after"):
            if ch in ",}":
                if part == "value":
                    self._value_done()
                self.part, self.key = "key", None
                self.done = ch == "}"
            elif part == "value" and ch not in WHITESPACE:
                self.token.append(ch)
            elif ch not in WHITESPACE:
                self.bad = True

    def _append(self, ch: str) -> None:
        self.token.append(ch)
        if self.streaming:
            self.pending.append(ch)

    def _string_closed(self) -> None:
        if self.part == "key":
            self.key = _string(self.token)
            self.part = "colon"
            self.bad = self.key is None
        else:
            self._value_done()

    def _value_done(self) -> None:
        text = "".join(self.token)
        if self.key == "name":
            self.name = _string(self.token)
            self.bad = self.name is None
        elif self.key in ARGUMENT_KEYS and not self.streaming:
            self.has_arguments = True
            decoded = _string(self.token) if text.startswith('"') else text
            self.pending.append(text if decoded is None else decoded)
        self.streaming = False
        self.part = "after"

    def take(self) -> str:
        text, self.pending = "".join(self.pending), []
        return text


class CallParser:
    """The streaming parser for one reply in ``family``'s syntax."""

    def __init__(self, family: Family, new_id: Callable[[], str] | None = None) -> None:
        self.family = family
        self.new_id = new_id or (short_call_id if family.short_ids else call_id)
        self.state = "start" if family.bare_start else "text"
        self.buffer = ""  # text not yet decided
        self.raw = ""  # the current region's text while no call in it is committed
        self.call: _CallObject | None = None
        self.calls: list[FunctionCall] = []
        self.listed = False  # the region's list bracket was seen
        self.committed = False  # the current call object has been announced (its name seen)
        self.calls_in_region = False  # a separator may follow

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while self.buffer:
            before = (self.state, len(self.buffer))
            getattr(self, "_" + self.state)(events)
            if (self.state, len(self.buffer)) == before:
                break  # waiting for more text
        return _merged(events)

    def finish(self) -> list[Event]:
        """The end of the reply: whatever was held back."""
        events: list[Event] = []
        if self.call is not None:
            if self.call.name is not None:
                self._flush_arguments(events, closing=True)
            else:
                events.append(Content(self.raw + self.buffer))
        elif self.state in ("start", "text") or self.raw:
            events.append(Content(self.raw + self.buffer))
        self.buffer = self.raw = ""
        self.call = None
        return _merged(events)

    # -- states --------------------------------------------------------------------------

    def _start(self, events: list[Event]) -> None:
        """The reply's first characters: a bare call region, or text."""
        stripped = self.buffer.lstrip(WHITESPACE)
        skip = self.family.skip_prefix
        if skip and stripped.startswith(skip):
            stripped = stripped[len(skip) :].lstrip(WHITESPACE)
        elif skip and skip.startswith(stripped):
            return  # the marker may still be arriving
        if not stripped:
            return
        opener = self.family.opener
        if opener and opener.startswith(stripped[: len(opener)]):
            if len(stripped) >= len(opener):
                self.state = "text"  # the marked region: the text state finds it
            return  # else the opener may still be arriving
        if stripped[0] == self.family.bare_start:
            self.raw = self.buffer[: len(self.buffer) - len(stripped)]
            self.buffer = stripped
            self.state = "between"
        else:
            self.state = "text"

    def _text(self, events: list[Event]) -> None:
        opener = self.family.opener
        if opener is None:
            events.append(Content(self.buffer))
            self.buffer = ""
            return
        at = self.buffer.find(opener)
        if at >= 0:
            events.append(Content(self.buffer[:at]))
            self.raw, self.buffer = opener, self.buffer[at + len(opener) :]
            self.state, self.listed = "between", False
            return
        keep = _partial_suffix(self.buffer, opener)
        events.append(Content(self.buffer[: len(self.buffer) - keep]))
        self.buffer = self.buffer[len(self.buffer) - keep :]

    def _between(self, events: list[Event]) -> None:
        """Between calls: whitespace, separators, the list brackets, the closer, a call."""
        family, buffer = self.family, self.buffer
        ch = buffer[0]
        closer = family.closer
        if ch in WHITESPACE or (ch == family.separator and self.calls_in_region):
            self._consume(1)
        elif family.list_open is not None and not self.listed and ch == family.list_open:
            self.listed = True
            self._consume(1)
        elif ch == "{" and (self.listed or family.list_open is None):
            self.call = _CallObject()
            self.state = "call"
        elif family.list_open is not None and self.listed and ch == "]":
            self._consume(1)
            self._end_region()
        elif closer is not None and buffer.startswith(closer):
            self._consume(len(closer))
            self._end_region()
        elif closer is not None and closer.startswith(buffer):
            return  # the closer may still be arriving
        else:  # not a call after all: what the region held is text
            events.append(Content(self.raw))
            self.raw, self.state = "", "text"

    def _call(self, events: list[Event]) -> None:
        call = self.call
        assert call is not None
        used = 0
        for ch in self.buffer:
            used += 1
            call.feed(ch)
            if call.done or call.bad:
                break
        if not self.committed:
            self.raw += self.buffer[:used]
        self.buffer = self.buffer[used:]
        if call.name is not None and not self.committed:
            self.calls.append(FunctionCall(self.new_id(), call.name, ""))
            self.committed, self.raw = True, ""
            events.append(CallStart(len(self.calls) - 1, self.calls[-1].id, call.name))
        if self.committed:
            self._flush_arguments(events, closing=call.done)
        if call.bad or (call.done and not self.committed):
            events.append(Content(self.raw))
            self.raw, self.state, self.call = "", "text", None
        elif call.done:
            self.call, self.state = None, "between"
            self.calls_in_region = True
            self.committed = False

    # -- helpers -------------------------------------------------------------------------

    def _flush_arguments(self, events: list[Event], closing: bool) -> None:
        call = self.call
        assert call is not None
        text = call.take()
        if closing and not call.has_arguments and not self.calls[-1].arguments:
            text = "{}"
        if text:
            self.calls[-1].arguments += text
            events.append(Arguments(len(self.calls) - 1, text))

    def _consume(self, n: int) -> None:
        self.raw += self.buffer[:n]
        self.buffer = self.buffer[n:]

    def _end_region(self) -> None:
        self.state, self.raw, self.calls_in_region = "text", "", False


def parse(family: Family, text: str, new_id: Callable[[], str] | None = None) -> Parsed:
    """A whole reply: its content (None if only calls) and its calls."""
    parser = CallParser(family, new_id)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    if parser.calls and not content.strip():
        return Parsed(None, parser.calls)
    return Parsed(content, parser.calls)


def relayed(text: str, found: list[FunctionCall]) -> Parsed:
    """A whole reply whose calls were ``found`` already (by a fleet's upstream), as ``parse``
    would give it: its content None if it was only calls."""
    return Parsed(None if found and not text.strip() else text, found)


def finish_reason(reason: str, called: bool) -> str:
    """A reply that stopped after making calls finished with ``tool_calls``."""
    return "tool_calls" if called and reason == "stop" else reason


def _string(chars: list[str]) -> str | None:
    try:
        value = json.loads("".join(chars))
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent fragments of one kind joined; empty content dropped."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, Content) and not event.text:
            continue
        last = out[-1] if out else None
        if isinstance(event, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + event.text)
        elif (
            isinstance(event, Arguments)
            and isinstance(last, Arguments)
            and last.index == event.index
        ):
            out[-1] = Arguments(event.index, last.text + event.text)
        else:
            out.append(event)
    return out
