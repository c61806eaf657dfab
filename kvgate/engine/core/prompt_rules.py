"""A prompt's token ids and the limits they are checked against, without the model.

The engine core checks prompts with these rules, and so does an API process whose engine
runs in a process of its own (``kvgate.engine.process.core_client``): it tokenizes and refuses a prompt
that cannot fit before anything crosses to the engine, with the same words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.engine.errors import TooManyTokens
from kvgate.engine.tokenization.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Limits:
    """What the rules need of a loaded engine (sent to API processes as it is)."""

    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int | None  # the server's own bound (--max-prompt-tokens), if any

    @property
    def max_prompt_len(self) -> int:
        """The most prompt tokens a request may have (one more must fit in max_model_len)."""
        limit = self.max_prompt_tokens
        return min(self.max_model_len - 1, self.max_model_len if limit is None else limit)

    @property
    def max_embedding_len(self) -> int:
        """The most tokens an embedding input may have: nothing is generated after it."""
        limit = self.max_prompt_tokens
        return self.max_model_len if limit is None else min(self.max_model_len, limit)


class PromptRules:
    def __init__(self, tokenizer: Tokenizer, limits: Limits) -> None:
        self.tokenizer, self.limits = tokenizer, limits

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids; one whose length alone shows it cannot fit is refused
        (``TooManyTokens``, a ValueError) without tokenizing it."""
        try:
            return self.tokenizer.encode(text, add_special_tokens, self.limits.max_prompt_len)
        except TooManyTokens as exc:
            raise self.too_long(f"at least {exc.at_least}", exc.at_least) from None

    def too_long(self, count: str, at_least: int) -> TooManyTokens:
        limits = self.limits
        limit = limits.max_prompt_tokens
        if limit is not None and at_least > limit:
            message = f"prompt: {count} tokens, at most {limit} on this server"
        else:
            message = (
                f"prompt: {count} tokens leave no room to generate within "
                f"max_model_len {limits.max_model_len}"
            )
        return TooManyTokens(message, at_least, limits.max_prompt_len)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids, checked: in the vocabulary, not empty."""
        if isinstance(prompt, str):
            token_ids = self.encode_prompt(prompt)
        elif isinstance(prompt, Sequence) and _all_ints(set(map(type, prompt))):
            # Checked by C loops (map, min, max): a per-id Python test was 0.7 ms of a cached
            # 2,000-token prompt's 7 ms.
            token_ids = list(map(int, prompt))
            vocab = self.limits.vocab_size
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
                raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        return token_ids

    def checked_prompt(self, prompt: Prompt) -> list[int]:
        """``prompt_ids``, and at most ``max_prompt_len`` of them."""
        token_ids = self.prompt_ids(prompt)
        if len(token_ids) > self.limits.max_prompt_len:
            raise self.too_long(str(len(token_ids)), len(token_ids))
        return token_ids

    def embedding_ids(self, prompt: Prompt) -> list[int]:
        """An embedding input's token ids (a text with its special tokens), checked: at most
        ``max_embedding_len`` (a text refused from its length alone when it shows that)."""
        limit = self.limits.max_embedding_len
        if isinstance(prompt, str):
            try:
                prompt = self.tokenizer.encode(prompt, True, limit)
            except TooManyTokens as exc:
                raise _embedding_too_long(f"at least {exc.at_least}", exc.at_least, limit) from None
        token_ids = self.prompt_ids(prompt)
        if len(token_ids) > limit:
            raise _embedding_too_long(str(len(token_ids)), len(token_ids), limit)
        return token_ids

    def chat_ids(
        self,
        messages: Sequence[dict[str, object]],
        tools: Sequence[dict[str, object]] | None = None,
        documents: Sequence[dict[str, object]] | None = None,
        chat_template_kwargs: dict[str, object] | None = None,
    ) -> list[int]:
        """Token ids of the conversation with the assistant's turn opened; a rendered
        conversation too long to fit is refused as ``encode_prompt`` refuses a prompt."""
        text = self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=True,
            tools=tools,
            documents=documents,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.encode_prompt(text, add_special_tokens=False)


def _embedding_too_long(count: str, at_least: int, limit: int) -> TooManyTokens:
    return TooManyTokens(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{count} tokens in the input for embedding generation. Please reduce the length of "
        "the input.",
        at_least,
        limit,
    )


def _all_ints(kinds: set[type]) -> bool:
    """Every type an ``int`` (a subclass too, but not ``bool``)."""
    return all(issubclass(kind, int) and kind is not bool for kind in kinds)
