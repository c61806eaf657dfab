"""A Hugging Face fast tokenizer (`tokenizer.json`) with transformers' special-token rules.

BOS/EOS insertion, decoding and chat-template rendering follow what
`transformers.AutoTokenizer` (v5) does for the same folder, so prompts tokenize identically
here and in the reference. As there, BOS/EOS insertion comes from the post-processor in
`tokenizer.json`; the `add_bos_token` flags of `tokenizer_config.json` do not override it.

A text's UTF-8 length over the most bytes one token can stand for (`max_token_bytes`,
computed once from the vocabulary) is a floor on its token count, so `encode(max_tokens=)`
refuses a text that cannot fit without tokenizing it: tokenizing 1 MiB costs ~0.5 s and
~150 MiB of transient memory here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

import kvgate.engine.tokenization.chat_template as chat_template
from kvgate.engine.errors import ModelLoadError, TooManyTokens

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
# Longer texts are tokenized with the GIL released (``encode_batch`` releases it; ``encode``
# does not), so a worker thread tokenizing a large prompt leaves the event loop running.
GIL_FREE_CHARS = 16_384
# How far each normalizer can shrink a text's UTF-8 bytes: Unicode normalization and
# lowercasing map at most 4 bytes to 1 (NFKC "𝐀" -> "A", Kelvin sign -> "k"); these
# only add. Any other normalizer (Strip, StripAccents, BERT's) can drop text without limit.
SHRINK = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1, "ByteLevel": 1}
# Pre-tokenizers that keep every byte (unless their behavior is "Removed"); Whitespace,
# WhitespaceSplit, BertPreTokenizer and CharDelimiterSplit drop the text they split on.
KEEPING = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
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
        self.max_token_bytes = max_token_bytes(json.loads(backend.to_str()))

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

    def min_tokens(self, text: str) -> int:
        """A floor on ``len(encode(text, add_special_tokens=False))``, from the text's length
        alone (0 when the tokenizer allows no such floor)."""
        if self.max_token_bytes is None:
            return 0
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return -(-size // self.max_token_bytes)

    def encode(
        self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[int]:
        """Token ids of ``text``. With ``max_tokens``, a text too long to encode to that many
        tokens or fewer is refused (``TooManyTokens``) before any tokenizing; the exact
        count of one that passes is the caller's to check."""
        if max_tokens is not None and (floor := self.min_tokens(text)) > max_tokens:
            raise TooManyTokens(
                f"at least {floor} tokens (a token stands for at most {self.max_token_bytes} "
                f"bytes), more than {max_tokens}",
                floor,
                max_tokens,
            )
        if len(text) <= GIL_FREE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

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
        """Render the conversation to text as transformers does (see `kvgate.engine.tokenization.chat_template`);
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
        max_tokens: int | None = None,
        **options: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation; `options` as for `apply_chat_template`,
        `max_tokens` as for `encode` (the bound applies to the rendered text)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **options)
        return self.encode(text, add_special_tokens=False, max_tokens=max_tokens)

    def incremental(
        self, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing token stream into text deltas without splitting UTF-8 characters.

    Decodes a short window of recent tokens (so spacing rules see context) and holds text
    back while it ends in U+FFFD, i.e. while a multi-byte character is still incomplete.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        context: int = 5,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids or [])
        self.prefix_offset = max(len(self.ids) - context, 0)
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix, full = self._texts()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def _texts(self) -> tuple[str, str]:
        """The text already emitted after the context window, and that text with what follows."""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        return prefix, decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)

    def flush(self) -> str:
        """Text still held back at the end of the stream (with replacement characters)."""
        prefix, full = self._texts()
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


def max_token_bytes(spec: dict[str, Any]) -> int | None:
    """The most UTF-8 bytes of input one token can stand for, from a ``tokenizer.json`` spec;
    None where no bound holds: the pipeline can drop or fuse input without limit (an
    unknown-character token that swallows runs, a normalizer or pre-tokenizer that removes
    text, an added token that strips the whitespace beside it, truncation), or the model is
    not BPE. Loose is safe (a floor that refuses less); too tight would refuse what fits."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation"):
        return None
    shrink = _shrink(spec.get("normalizer"))
    steps = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    if shrink is None or any(
        s.get("type") not in KEEPING or s.get("behavior") == "Removed" for s in steps
    ):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())  # one character per byte
    byte_level = any(
        s.get("type") == "ByteLevel" for s in steps + _steps(spec.get("normalizer"), "normalizers")
    )
    if byte_level and alphabet <= vocab.keys():
        longest = max(len(t) if alphabet.issuperset(t) else len(t.encode()) for t in vocab)
    elif model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        longest = max((len(t.encode()) for t in vocab), default=1)
    elif model.get("unk_token") is not None and not model.get("fuse_unk"):
        longest = max([4, *(len(t.encode()) for t in vocab)])  # an unknown: one character
    else:
        return None  # some input could map to no token at all
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    longest = max([longest, *(len(a["content"].encode()) for a in added)])
    return longest * shrink


def _steps(step: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer as its list of steps (a Sequence flattened)."""
    if step is None:
        return []
    if step.get("type") == "Sequence":
        return [s for inner in step.get(key) or [] for s in _steps(inner, key)]
    return [step]


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many times fewer UTF-8 bytes the normalizer can leave (None: without limit)."""
    factor = 1
    for step in _steps(normalizer, "normalizers"):
        kind = step.get("type")
        if kind == "Replace":
            pattern = (step.get("pattern") or {}).get("String")
            content = (step.get("content") or "").encode()
            if pattern is None or not content:
                return None  # a regex, or deletion
            factor *= -(-len(pattern.encode()) // len(content))
        elif kind in SHRINK:
            factor *= SHRINK[kind]
        else:
            return None
    return factor


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
