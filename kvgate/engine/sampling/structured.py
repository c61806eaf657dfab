"""Constrained decoding: a request's output is held to a JSON Schema, regex, choice list or
EBNF grammar by masking, each step, every token the grammar cannot take next.

    StructuredOutputs (SamplingParams) ──GrammarCache.compile──> xgrammar CompiledGrammar
        (json / json_object / regex / choice / grammar / structural_tag: tool calls)
        (cached by (kind, spec hash) on the cache, which is built for one tokenizer)
        (kept LRU within ``max_bytes`` of compiled memory; a spec over ``max_spec_bytes`` refused)
    Request.grammar = GrammarState(matcher)         advanced by Request.append_output
    sampler: fill_bitmask(rows) -> one [B, V/32] int32 bitmask -> apply before temperature

xgrammar (vLLM's default backend) rather than llguidance: both install and run on this CPU,
but on the tiny model's vocabulary xgrammar filled a JSON-Schema mask in ~0.1 ms per token
against ~56 ms for llguidance's first-use masks, and it compiles a schema in ~1 ms. Its state
lives with the request, which keeps its output tokens across preemption, so a preempted
request resumes with its grammar exactly where its tokens are.

Bounds (one tenant must not pin the server's memory or its compile time): a compiled grammar's
memory and its compile time grow with its spec, so a spec over ``max_spec_bytes`` (canonical
JSON) is refused before compiling, and the cache keeps compiled grammars by their own
``memory_size_bytes`` within ``max_bytes`` (a grammar larger than that is used, not kept).
Measured on a 2-core Zen 4 (tiny model): a 1,000-entry choice list (17.7 KB) compiled in 0.1
s to 3.5 MiB, 10,000 entries (174 KB) in 1.8 s to 42 MiB, 30,000 (527 KB) in 11 s to 127 MiB;
a JSON Schema of 600 object properties (147 KB) in 4.4 s to 10 MiB.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import jsonschema
import torch

from kvgate.engine.errors import InvalidArgument
from kvgate.engine.sampling.utf8_guard import Utf8Guard
from kvgate.engine.sampling_params import StructuredOutputs, choice_grammar
from kvgate.engine.tokenization.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256  # entries, besides the bytes bound
GRAMMAR_CACHE_BYTES = 256 * 2**20  # compiled grammars kept: 8+ of the largest spec allowed
MAX_GRAMMAR_SPEC_BYTES = 128 * 2**10  # ~30 MiB and 1-4 s of compile at most (measured above)
# Schema keywords xgrammar would silently ignore: output would then not validate, so they are
# refused up front (vLLM refuses the same set for its xgrammar backend).
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "patternProperties",
        "$dynamicRef",
        "$recursiveRef",
    }
)
_VALUE_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")
# xgrammar 0.2 lets a length-bounded string hold raw control characters, which JSON forbids
# (strict parsers refuse them): such strings get the character class of its other strings.
_BOUNDED_STRING_FIX = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\]")


@functools.cache
def _xgr() -> ModuleType:
    """xgrammar, imported on first use: it pulls in transformers (~1.5 s more than torch), which a server that
    never sees a constraint should not pay for at startup."""
    import xgrammar

    return xgrammar


class GrammarState:
    """One request's position in its grammar, and the UTF-8 lead byte its output ends on."""

    def __init__(self, compiled: Any, guard: Utf8Guard):
        self.matcher = _xgr().GrammarMatcher(compiled)
        self.guard = guard
        self.lead = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar cannot take it."""
        self.lead = self.guard.lead_after(token_id)
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int, lead: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (verified drafts: see
        kvgate.engine.spec_decode.verify); ``lead``: the UTF-8 lead byte before them."""
        self.matcher.rollback(num_tokens)
        self.lead = lead

    @property
    def terminated(self) -> bool:
        """The grammar is complete (its stop token taken): nothing more may follow."""
        return bool(self.matcher.is_terminated())


class GrammarCache:
    """Compiles StructuredOutputs for one tokenizer and model vocabulary; compiled grammars
    are kept (LRU) by the hash of their spec, so a schema sent again is not recompiled. The
    xgrammar tokenizer info is built at the first compile."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_bytes: int = GRAMMAR_CACHE_BYTES,
        max_spec_bytes: int = MAX_GRAMMAR_SPEC_BYTES,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.max_bytes = max_bytes
        self.max_spec_bytes = max_spec_bytes
        self._compiled: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # digest -> (, bytes)
        self._bytes = 0  # the compiled memory of the grammars kept
        self._lock = threading.Lock()  # the cache (held for microseconds: the loop asks it)
        self._build_lock = threading.Lock()  # building the compiler (seconds, on a worker)
        self.token_bytes: list[bytes] = []  # each token's bytes as xgrammar reads them
        self._guard: Utf8Guard | None = None  # built with the compiler, from token_bytes

    @functools.cached_property
    def _compiler(self) -> Any:
        xgr = _xgr()
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        encoded = [""] * max(len(vocab), max(vocab.values(), default=-1) + 1)
        for text, token_id in vocab.items():
            encoded[token_id] = text
        info = xgr.TokenizerInfo(
            encoded,
            vocab_type=_vocab_type(self.tokenizer),
            vocab_size=self.vocab_size,
            stop_token_ids=self.stop_token_ids,
        )
        self.token_bytes = list(info.decoded_vocab)
        self._guard = Utf8Guard(self.token_bytes, self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def state(self, spec: StructuredOutputs) -> GrammarState:
        """A fresh grammar state for ``spec``; ValueError naming the field if it is bad."""
        compiled = self.compile(spec)  # builds the compiler, and the guard with it
        assert self._guard is not None
        return GrammarState(compiled, self._guard)

    def cached(self, spec: StructuredOutputs) -> bool:
        """Whether ``spec`` is compiled already (a front door compiles the others off its
        event loop first: a large schema, or the first one, takes a while)."""
        with self._lock:
            return spec.digest in self._compiled

    @property
    def resident_bytes(self) -> int:
        """The compiled memory of the grammars the cache keeps (at most ``max_bytes``)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._compiled)

    def compile(self, spec: StructuredOutputs) -> Any:
        kind, key = spec.kind, spec.digest
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key][0]
        spec.check_size(self.max_spec_bytes)
        with self._build_lock:  # the compiler is built once
            compiler = self._compiler
        compiled = self._compile(compiler, kind, spec.document)
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if key not in self._compiled and size <= self.max_bytes:
                self._compiled[key] = (compiled, size)
                self._bytes += size
            while self._bytes > self.max_bytes or len(self._compiled) > MAX_CACHED_GRAMMARS:
                _, (_, evicted) = self._compiled.popitem(last=False)
                self._bytes -= evicted
        return compiled

    @staticmethod
    def _compile(compiler: Any, kind: str, value: object) -> Any:
        xgr = _xgr()
        field = f"structured_outputs.{kind}"
        try:
            if kind in ("json", "json_object"):
                # json_object: any object (not any JSON value)
                schema = {"type": "object"} if kind == "json_object" else value
                _check_schema(schema, field)
                ebnf = str(
                    xgr.Grammar.from_json_schema(
                        json.dumps(schema), any_whitespace=False, strict_mode=True
                    )
                )
                return compiler.compile_grammar(ebnf.replace(*_BOUNDED_STRING_FIX))
            if kind == "structural_tag":
                for where, schema in _tag_schemas(value, ""):
                    _check_schema(schema, field + where)
                ebnf = str(xgr.Grammar.from_structural_tag(json.dumps(value)))
                return compiler.compile_grammar(ebnf.replace(*_BOUNDED_STRING_FIX))
            if kind == "regex":
                return compiler.compile_regex(str(value))
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(value))  # type: ignore[arg-type]
            return compiler.compile_grammar(str(value))
        except RuntimeError as exc:
            raise ValueError(f"{field}: {_native_message(exc)}") from None


def fill_bitmask(grammars: Sequence[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """One int32 bitmask [B, ceil(V/32)] for the batch (rows without a grammar allow all);
    None when no row has a grammar."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    bitmask = _xgr().allocate_token_bitmask(len(grammars), vocab_size)  # all allowed
    for i in rows:
        grammar = grammars[i]
        assert grammar is not None
        grammar.matcher.fill_next_token_bitmask(bitmask, i)
        bitmask[i] &= grammar.guard.masks[grammar.lead]  # valid UTF-8 only (utf8_guard)
    allowed: torch.Tensor = bitmask
    return allowed


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: every disallowed token's logit becomes -inf."""
    _xgr().apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=logits.shape[1]
    )


def _check_schema(schema: object, field: str) -> None:
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON Schema is an object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"{field}{'/' + where if where else ''}: {exc.message}") from None
    path = _unsupported(schema, "")
    if path is not None:
        raise ValueError(f"{field}{path}: not supported in constrained decoding")
    for where, ref in _refs(schema, ""):
        if not _resolves(schema, ref):
            raise InvalidArgument(
                f"{field}{where}/$ref: {ref[:200]!r} does not resolve inside the schema; only "
                "references within it ('#' or '#/$defs/...') are served, nothing is fetched",
                "structured_outputs",
            )


def _refs(node: object, path: str) -> Iterator[tuple[str, str]]:
    """Every ``$ref`` (a string beside schema keywords) in a schema, with its path; a property
    named ``$ref`` (an object) and values (``const``, ``enum``…) are not references."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield path, ref
        for key, child in node.items():
            if key not in _VALUE_KEYWORDS:
                yield from _refs(child, f"{path}/{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _refs(child, f"{path}/{i}")


def _resolves(root: object, ref: str) -> bool:
    """Whether ``ref`` is a JSON pointer fragment (``#``, ``#/a/b``: all xgrammar follows)
    naming a node of ``root``; remote, file, relative and anchor references are not."""
    if ref != "#" and not ref.startswith("#/"):
        return False
    node = root
    for part in urllib.parse.unquote(ref[2:]).split("/") if ref != "#" else ():
        token = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False
    return True


def _tag_schemas(node: object, path: str) -> Iterator[tuple[str, Any]]:
    """Every JSON Schema inside a structural tag, with its path (checked like ``json``)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield f"{path}/json_schema", node["json_schema"]
        for key, child in node.items():
            if key != "json_schema":
                yield from _tag_schemas(child, f"{path}/{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from _tag_schemas(child, f"{path}/{i}")


def _unsupported(node: object, path: str) -> str | None:
    """The path of the first keyword xgrammar cannot enforce, or None."""
    if isinstance(node, dict):
        for key, child in node.items():
            if key in UNSUPPORTED_KEYWORDS:
                return f"{path}/{key}"
            if key in _VALUE_KEYWORDS:
                continue
            found = _unsupported(child, f"{path}/{key}")
            if found is not None:
                return found
    elif isinstance(node, list):
        for i, child in enumerate(node):
            found = _unsupported(child, f"{path}/{i}")
            if found is not None:
                return found
    return None


def _vocab_type(tokenizer: Tokenizer) -> Any:
    """How token strings encode bytes: GPT-2 byte-level, SentencePiece byte fallback, or raw."""
    xgr = _xgr()
    spec = json.loads(tokenizer.backend.to_str())
    decoder = json.dumps(spec.get("decoder"))
    if "ByteLevel" in decoder:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in decoder:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _native_message(exc: RuntimeError) -> str:
    return _NATIVE_PREFIX.sub("", str(exc).strip()).strip()
