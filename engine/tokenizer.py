"""A Hugging Face fast tokenizer (`tokenizer.json`) with transformers' special-token rules.

BOS/EOS insertion, decoding and chat-template rendering follow what
`transformers.AutoTokenizer` (v5) does for the same folder, so prompts tokenize identically
here and in the reference. As there, BOS/EOS insertion comes from the post-processor in
`tokenizer.json`; the `add_bos_token` flags of `tokenizer_config.json` do not override it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.model_config import ModelLoadError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict[str, Any], chat_template: str | None):
        self.backend = backend
        self.special_tokens = {
            key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS if config.get(key)
        }
        self.chat_template = chat_template
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        eos = self.special_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos else None
        self.eos_token_ids: list[int] = [] if eos_id is None else [eos_id]
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"missing tokenizer.json in {path}")
        config_file = path / "tokenizer_config.json"
        config = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"))
        return cls(HFTokenizer.from_file(str(tokenizer_file)), config, template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """Render the conversation to text; tokenize it with `encode_chat` (no extra BOS)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        template = _compile(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **variables,
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def incremental(self, prompt_ids: list[int] | None = None) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas without splitting UTF-8 characters.

    Decodes a short window of recent tokens (so spacing rules see context) and holds text
    back while it ends in U+FFFD, i.e. while a multi-byte character is still incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, context: int = 5):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids or [])
        self.prefix_offset = max(len(self.ids) - context, 0)
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Text still held back at the end of the stream (with replacement characters)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


def _token_text(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):
        named = {item["name"]: item["template"] for item in value}
        return named.get("default")
    return value


def _clean_up_spaces(text: str) -> str:
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


class _GenerationTag(Extension):
    """Accept transformers' `{% generation %}` blocks (used for masks); render their body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


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
    return env.from_string(source)
