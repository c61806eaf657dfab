"""Per-request sampling settings, validated up front so bad input never reaches a step.

Every value that passes ``validate`` is safe to sample with, whatever it is combined with:
the sampler clamps the numeric corners (a temperature below ``GREEDY_BELOW`` is greedy, as in
vLLM), so one request's arguments can never fail a step that other requests share.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows fp32.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed accepts
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match (vLLM's ``StructuredOutputsParams``), exactly one of: a
    JSON Schema (``json``, an object or its JSON text), any JSON object (``json_object``), a
    regular expression, a list of choices, an EBNF ``grammar`` (xgrammar's dialect), or an
    xgrammar ``structural_tag`` (``{"type": "structural_tag", "format": …}``: fixed text and
    JSON Schemas in sequence, as tool calls are written).
    Shapes are checked here; the engine compiles it and refuses what it cannot enforce."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar, "
                "structural_tag "
                f"must be given, got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON Schema object or its text")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise ValueError("structured_outputs.structural_tag must be an object or its text")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple))
            and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @classmethod
    def from_dict(cls, fields: object) -> StructuredOutputs:
        if isinstance(fields, StructuredOutputs):
            return fields
        if not isinstance(fields, dict):
            raise ValueError("structured_outputs must be an object")
        unknown = sorted(set(fields) - set(STRUCTURED_KINDS))
        if unknown:
            raise ValueError(f"unknown structured_outputs field {unknown[0]!r}")
        return cls(**fields)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> object:
        value = getattr(self, self.kind)
        return list(value) if isinstance(value, tuple) else value

    @functools.cached_property
    def digest(self) -> str:
        """What caches of compiled grammars key on (kind and value, canonical JSON, hashed):
        computed once a spec, though a request asks for it when it is checked and compiled."""
        canonical = json.dumps([self.kind, self.value], sort_keys=True).encode()
        return hashlib.sha256(canonical).hexdigest()


@dataclass
class SamplingParams:
    """Shaped like vLLM's: temperature 0 means greedy.

    Penalties: ``presence_penalty`` and ``frequency_penalty`` follow OpenAI (subtracted from
    the logits of tokens already generated, once / per occurrence); ``repetition_penalty``
    follows vLLM and Hugging Face (logits of tokens in the prompt or the output are divided by
    it when positive, multiplied when not; 1 is off). ``min_tokens``: EOS and the stop token
    ids cannot be sampled, and no stop rule ends the request, before that many tokens.
    ``structured_outputs``: the output is held to it, and the request stops ("stop") as soon
    as it is complete, whatever ``min_tokens`` and ``ignore_eos`` say.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens (tool-call markers) stay in the text
    logprobs: int | None = None  # top-N logprobs per generated token (plus the chosen one)
    structured_outputs: StructuredOutputs | None = None  # constrained decoding

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @classmethod
    def from_dict(
        cls, fields: dict[str, object], defaults: dict[str, object] | None = None
    ) -> SamplingParams:
        """Build from untrusted key/values (JSON); an unknown key is a ValueError naming it.
        ``defaults`` (the model's generation_config.json) fill the fields left unset."""
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown sampling field {unknown[0]!r}")
        return cls(**{**(defaults or {}), **fields})  # type: ignore[arg-type]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (the sampler skips them otherwise)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0, maximum=self.max_tokens)
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        _check_number("presence_penalty", self.presence_penalty, minimum=-2.0, maximum=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, minimum=-2.0, maximum=2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_number(
    name: str, value: object, minimum: float | None = None, maximum: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
