"""A model's thinking split from its reply as it streams, per model family (vLLM's
``--reasoning-parser`` names and rules).

    qwen3        thinking only between ``<think>`` and ``</think>`` at the start of the reply;
                 a reply that does not open with ``<think>`` is all content
    deepseek_r1  the chat template opens the thinking, so everything before ``</think>`` is
                 thinking (a ``<think>`` the model writes itself is dropped); a reply that never
                 writes ``</think>`` is all thinking

``ThinkParser.feed(text)`` takes each new piece of the reply, cut anywhere (mid-tag), and
returns the thinking and the content it completes; ``finish()`` flushes what was held back (a
possible tag's beginning). ``split(text)`` is the same machine fed at once, so a whole answer
is exactly what its streamed pieces add up to.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    # The template opens the thinking: the reply thinks until ``</think>`` (deepseek_r1);
    # otherwise only a reply that opens with ``<think>`` thinks (qwen3).
    opened_by_template: bool

    def parser(self) -> ThinkParser:
        return ThinkParser(self)


QWEN3 = ReasoningFormat("qwen3", opened_by_template=False)
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", opened_by_template=True)
FORMATS = {f.name: f for f in (QWEN3, DEEPSEEK_R1)}


def resolve(name: str | None) -> ReasoningFormat | None:
    """``--reasoning-parser NAME`` (ValueError for an unknown one); None: no parser."""
    if not name:
        return None
    if name not in FORMATS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; one of {list(FORMATS)}")
    return FORMATS[name]


@dataclass(frozen=True)
class Split:
    reasoning: str  # comes before ``content`` in the reply
    content: str


class ThinkParser:
    def __init__(self, form: ReasoningFormat) -> None:
        self.form = form
        self.state = "opening"  # opening (a <think> may come) | thinking | content
        self.held = ""  # text that may be the beginning of a tag
        self.thought = False  # the reply thought (a <think> was read, or the template opened it)

    def feed(self, text: str) -> Split:
        reasoning: list[str] = []
        content: list[str] = []
        text = self.held + text
        self.held = ""
        if self.state == "opening":
            stripped = text.lstrip()
            if stripped.startswith(START):
                self.state, self.thought = "thinking", True
                text = stripped[len(START) :]
            elif START.startswith(stripped):  # still possibly the opening tag
                self.held = text
                return Split("", "")
            elif self.form.opened_by_template:
                self.state, self.thought = "thinking", True
            else:
                self.state = "content"
        if self.state == "thinking":
            before, tag, after = text.partition(END)
            if tag:
                reasoning.append(before)
                self.state, text = "content", after
            else:
                keep = _partial_suffix(text, END)
                reasoning.append(text[: len(text) - keep])
                self.held, text = text[len(text) - keep :], ""
        if self.state == "content":
            content.append(text)
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """What was held back: a tag that never completed is text of the state it is in."""
        held, self.held = self.held, ""
        if self.state == "opening":
            if self.form.opened_by_template and held:
                self.thought = True
                return Split(held, "")
            return Split("", held)
        return Split(held, "") if self.state == "thinking" else Split("", held)


def split(form: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """A whole reply's thinking (None when it did not think) and content."""
    parser = form.parser()
    parts = [parser.feed(text), parser.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    return (reasoning if parser.thought else None), "".join(p.content for p in parts)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
