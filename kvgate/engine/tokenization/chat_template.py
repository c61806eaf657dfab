"""Chat templates rendered as transformers (v5) renders them, with everything agents send.

Same Jinja sandbox, filters and globals (`tojson` without HTML escaping, `raise_exception`,
`strftime_now`, `dict`, a dunder-safe `namespace`, `{% generation %}` blocks), and the same
input preparation as `PreTrainedTokenizerBase.apply_chat_template`:

- a named template list (`default`, `tool_use`, `rag`, ...) picks `tool_use` when tools are
  given, else `default`; a name passed as `chat_template` picks that one;
- each message loses its None-valued keys (OpenAI clients send `content: null` beside
  `tool_calls`), reasoning under any of its names is copied to `reasoning_content` and
  `thinking`, and everything is rebuilt from plain JSON types;
- the template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the special
  tokens, and any extra variables (`chat_template_kwargs`: `enable_thinking`, ...), which
  override the special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

Templates = str | dict[str, str]
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def pick_template(templates: Templates, tools: Sequence[Any] | None, name: str | None) -> str:
    """The template text to render: `name` (a template name, or a whole template), else
    `tool_use` when tools are given and the model has one, else `default`."""
    if isinstance(templates, dict):
        if name is not None:
            if name not in templates:
                raise ValueError(
                    f"chat_template: no template named {name!r}; have {sorted(templates)}"
                )
            return templates[name]
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"chat_template: several templates and no default: {sorted(templates)}")
    return templates if name is None else name


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The rendered conversation; ValueError names a malformed message, tool or document, or
    says the template refused to render (its ``raise_exception``, or any error the caller's
    messages and variables lead it into: a variable named like an argument, a number where
    it loops): what the caller sent, so every door answers it as bad input."""
    if not messages:
        raise ValueError("messages: a conversation needs at least one message")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}]: each message must be an object")
        chat.append({key: value for key, value in message.items() if value is not None})
    for name, items in (("tools", tools), ("documents", documents)):
        if items is not None and not all(isinstance(item, Mapping) for item in items):
            raise ValueError(f"{name}: each entry must be a JSON object")
    context = {**(special_tokens or {}), **_plain(dict(variables or {}))}
    compiled = _compile(template)  # the server's own template: its errors are not the caller's
    try:
        return compiled.render(
            messages=_alias_reasoning(_plain(chat)),
            tools=_plain(None if tools is None else list(tools)),
            documents=_plain(None if documents is None else list(documents)),
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except Exception as exc:
        raise ValueError(f"messages: the chat template rejected them ({exc})") from exc


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning under any of its names is read by templates as `reasoning_content` (Qwen3,
    DeepSeek) or `thinking` (gpt-oss)."""
    out = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """A fresh copy in plain JSON types, so a template never sees (or edits) caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    raise ValueError(f"chat template input: unsupported value of type {type(value).__name__}")


class _GenerationTag(Extension):
    """Accept transformers' `{% generation %}` blocks (used for masks); render their body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """`dict(...)` for templates without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attribute {name!r} on a namespace"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)
