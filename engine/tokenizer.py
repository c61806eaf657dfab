"""A Hugging Face fast tokenizer (`tokenizer.json`) with transformers' special-token rules.

BOS/EOS insertion, decoding and chat-template rendering follow what
`transformers.AutoTokenizer` (v5) does for the same folder, so prompts tokenize identically
here and in the reference. As there, BOS/EOS insertion comes from the post-processor in
`tokenizer.json`; the `add_bos_token` flags of `tokenizer_config.json` do not override it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine import chat_template
from engine.model_config import ModelLoadError

# transformers' SPECIAL_TOKENS_ATTRIBUTES: what a chat template sees besides its inputs.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_TEMPLATES_DIR = "additional_chat_templates"


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        config: dict[str, Any],
        chat_template: chat_template.Templates | None,
    ):
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
        return cls(HFTokenizer.from_file(str(tokenizer_file)), config, _templates(path, config))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        template: str | None = None,
    ) -> str:
        """Render the conversation to text as transformers does (see `engine.chat_template`);
        tokenize it with `encode_chat` (no extra BOS). `template` names one of several."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        return chat_template.render(
            chat_template.pick_template(self.chat_template, tools, template),
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            special_tokens=self.special_tokens,
            variables=chat_template_kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **options: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation; `options` as for `apply_chat_template`."""
        text = self.apply_chat_template(messages, add_generation_prompt, **options)
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


def _templates(path: Path, config: dict[str, Any]) -> chat_template.Templates | None:
    """The folder's chat template(s): `chat_template.jinja` (plus the named ones transformers
    saves in `additional_chat_templates/`), else `chat_template` in tokenizer_config.json, a
    string or a list of `{name, template}`."""
    named: dict[str, str] = {}
    extra = path / ADDITIONAL_TEMPLATES_DIR
    if extra.is_dir():
        named = {f.stem: f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))}
    main = path / TEMPLATE_FILE
    if main.is_file():
        text = main.read_text(encoding="utf-8")
        return {"default": text, **named} if named else text
    value = config.get("chat_template")
    if isinstance(value, list):
        named.update({item["name"]: item["template"] for item in value})
    elif isinstance(value, str):
        return {"default": value, **named} if named else value
    return named or None


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
