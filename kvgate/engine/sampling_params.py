"""Per-request sampling settings, validated up front so bad input never reaches a step.

Every value that passes ``validate`` is safe to sample with, whatever it is combined with:
the sampler clamps the numeric corners (a temperature below ``GREEDY_BELOW`` is greedy, as in
vLLM), so one request's arguments can never fail a step that other requests share. A bad field
is an ``InvalidArgument`` (a ValueError) whose ``field`` names it.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

import orjson

from kvgate.engine.errors import InvalidArgument

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows fp32.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGIT_BIAS = 100.0  # OpenAI's (and vLLM's) range for a logit_bias value: [-100, 100]
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class _Unknown(frozenset):  # type: ignore[type-arg]
    """``SamplingParams.given`` before ``__post_init__`` when the constructor was not told
    (its own type: the empty frozenset is a singleton, so no identity test could tell)."""


_UNKNOWN: frozenset[str] = _Unknown()


def choice_grammar(choices: Sequence[str]) -> str:
    """A choice list as an EBNF grammar (xgrammar's dialect): one string literal a choice.
    Each character is written as itself, not as JSON's ``\\uXXXX``: xgrammar reads such an
    escape as one code point, so a character past U+FFFF, escaped as its UTF-16 surrogate
    pair, became two lone surrogates — bytes no UTF-8 text holds, which the engine never
    samples (``utf8_guard``), so the choice could not be written."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


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
            raise InvalidArgument(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar, "
                "structural_tag "
                f"must be given, got {given or 'none'}",
                "structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidArgument(
                "structured_outputs.json must be a JSON Schema object or its text",
                "structured_outputs",
            )
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise InvalidArgument(
                "structured_outputs.structural_tag must be an object or its text",
                "structured_outputs",
            )
        if not isinstance(self.json_object, bool):
            raise InvalidArgument(
                "structured_outputs.json_object must be a bool", "structured_outputs"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidArgument(
                    f"structured_outputs.{name} must be a non-empty string", "structured_outputs"
                )
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple))
            and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidArgument(
                "structured_outputs.choice must be a non-empty list of strings",
                "structured_outputs",
            )
        _ = self.document  # JSON text parsed here: bad text is refused whoever reads it

    @classmethod
    def from_dict(cls, fields: object) -> StructuredOutputs:
        if isinstance(fields, StructuredOutputs):
            return fields
        if not isinstance(fields, dict):
            raise InvalidArgument("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(fields) - set(STRUCTURED_KINDS))
        if unknown:
            raise InvalidArgument(
                f"unknown structured_outputs field {unknown[0]!r}", "structured_outputs"
            )
        return cls(**fields)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> object:
        value = getattr(self, self.kind)
        return list(value) if isinstance(value, tuple) else value

    @property
    def document(self) -> object:
        """``value``, with the JSON text of a ``json`` or ``structural_tag`` parsed. Read when
        the spec is built, so text that is not JSON is the caller's error
        (``InvalidArgument``) on every path; the engine's compile and a reasoning parser's
        wrapping of the spec read this, not the text. Not cached: the instance's fields are
        its wire form (``vars``), and orjson parses the largest spec allowed in under 1 ms."""
        value = self.value
        if self.kind not in ("json", "structural_tag") or not isinstance(value, str):
            return value
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(
                f"structured_outputs.{self.kind}: not valid JSON: {exc}", "structured_outputs"
            ) from None

    @functools.cached_property
    def _canonical(self) -> bytes:
        return json.dumps([self.kind, self.value], sort_keys=True).encode()

    @functools.cached_property
    def digest(self) -> str:
        """What caches of compiled grammars key on (kind and value, canonical JSON, hashed):
        computed once a spec, though a request asks for it when it is checked and compiled."""
        return hashlib.sha256(self._canonical).hexdigest()

    @property
    def size(self) -> int:
        """The spec's size in bytes (its canonical JSON): what compile time and a compiled
        grammar's memory grow with, so what the engine's ``max_grammar_bytes`` bounds."""
        return len(self._canonical)

    def check_size(self, limit: int) -> None:
        """``InvalidArgument`` when the spec is over ``limit`` bytes (a server's
        ``max_grammar_bytes``: compile time and compiled memory grow with the spec)."""
        if self.size > limit:
            raise InvalidArgument(
                f"structured_outputs.{self.kind}: {self.size} bytes, at most {limit} on this "
                "server (a grammar's compile time and memory grow with its spec)",
                "structured_outputs",
            )


@dataclass
class SamplingParams:
    """Shaped like vLLM's: temperature 0 means greedy.

    Penalties: ``presence_penalty`` and ``frequency_penalty`` follow OpenAI (subtracted from
    the logits of tokens already generated, once / per occurrence); ``repetition_penalty``
    follows vLLM and Hugging Face (logits of tokens in the prompt or the output are divided by
    it when positive, multiplied when not; 1 is off). ``min_tokens``: EOS and the stop token
    ids cannot be sampled, and no stop rule ends the request, before that many tokens.
    ``structured_outputs``: the output is held to it, and the request stops ("stop") as soon
    as it is complete, whatever ``min_tokens`` and ``ignore_eos`` say. ``logit_bias`` (OpenAI,
    vLLM): ``{token_id: bias}``, each bias in [-100, 100] added to that token's logit before
    the penalties and temperature (the engine refuses ids outside the model's vocabulary).

    ``given``: the names of the fields the caller chose, explicit defaults included (fleet
    mode sends exactly these to the upstream, whose own defaults fill the rest). ``from_dict``
    sets it to the caller's keys; built directly, it is the fields that differ from the
    defaults (all a constructor can tell). Ignored by ``==``; ``dataclasses.replace`` keeps it
    as it was, so set a field the caller did not give with ``with_fields``.
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
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    given: frozenset[str] = field(default=_UNKNOWN, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise InvalidArgument(
                f"stop must be a string or a list of strings, got {self.stop!r}", "stop"
            )
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidArgument(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                "stop_token_ids",
            )
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.given is _UNKNOWN:  # built directly: what differs from the defaults
            self.given = frozenset(n for n, d in _DEFAULTS.items() if getattr(self, n) != d)
        elif not (isinstance(self.given, frozenset) and self.given <= _DEFAULTS.keys()):
            raise InvalidArgument(
                f"given must be a frozenset of sampling field names, got {self.given!r}", "given"
            )
        self.validate()

    @classmethod
    def from_dict(
        cls, fields: dict[str, object], defaults: dict[str, object] | None = None
    ) -> SamplingParams:
        """Build from untrusted key/values (JSON); an unknown key is an ``InvalidArgument``
        naming it. ``defaults`` (the model's generation_config.json) fill the fields left
        unset; ``given`` is the keys of ``fields`` alone (explicit defaults included)."""
        unknown = sorted(set(fields) - _DEFAULTS.keys())
        if unknown:
            raise InvalidArgument(f"unknown sampling field {unknown[0]!r}", unknown[0])
        values = {**(defaults or {}), **fields}
        return cls(**values, given=frozenset(fields))  # type: ignore[arg-type]

    def with_fields(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` set and counted as given (``dataclasses.replace`` would
        keep ``given`` as it was)."""
        return replace(self, **changes, given=self.given | frozenset(changes))

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
        """Raise ``InvalidArgument`` naming the offending field."""
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0, maximum=self.max_tokens)
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        _check_number("presence_penalty", self.presence_penalty, minimum=-2.0, maximum=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, minimum=-2.0, maximum=2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise InvalidArgument(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidArgument("stop must be a list of non-empty strings", "stop")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be a bool, got {getattr(self, name)!r}", name)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidArgument(
                    f"logit_bias must be an object of token id -> bias, got {self.logit_bias!r}",
                    "logit_bias",
                )
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias", token_id, minimum=0)
                _check_number("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    @functools.cached_property
    def logit_bias_arrays(self) -> tuple[array.array[int], array.array[float]]:
        """``logit_bias`` as (token ids int64, biases float32), built once a request: the
        sampler adds them every step, so a large bias map is not re-read from a dict each step."""
        bias = self.logit_bias or {}
        return array.array("q", bias.keys()), array.array("f", bias.values())


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}", name)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidArgument(f"{name} must be {bound}, got {value}", name)


def _check_number(
    name: str, value: object, minimum: float | None = None, maximum: float | None = None
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}", name)
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name} must be <= {maximum}, got {value}", name)


# Each sampling field's default ("given" is not one of them).
_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if f.default_factory is not MISSING else f.default
    for f in fields(SamplingParams)
    if f.name != "given"
}
