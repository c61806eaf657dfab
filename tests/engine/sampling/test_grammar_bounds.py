"""What one caller's constraints may cost the engine: compiled grammars are kept within a byte
budget (not a count), a spec over the size limit is refused before compiling, and a JSON Schema
``$ref`` must resolve inside the schema (nothing is ever fetched)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.errors import InvalidArgument
from kvgate.engine.sampling.structured import GrammarCache
from kvgate.engine.sampling_params import StructuredOutputs


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    yield LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", max_grammar_bytes=4000)


def _cache(llm: LLM, **limits: int) -> GrammarCache:
    core = llm.core
    return GrammarCache(core.tokenizer, core.model_config.vocab_size, [0], **limits)


def _choices(tag: int, n: int) -> StructuredOutputs:
    return StructuredOutputs(choice=[f"option {tag} number {i} of the list" for i in range(n)])


def test_the_grammar_cache_is_bounded_by_compiled_bytes_not_count(llm: LLM) -> None:
    probe = _cache(llm).compile(_choices(0, 100))
    one = probe.memory_size_bytes  # each list below compiles to about this much
    cache = _cache(llm, max_bytes=int(3.5 * one))
    for tag in range(1, 9):
        cache.compile(_choices(tag, 100))
        assert cache.resident_bytes <= cache.max_bytes
    assert 2 <= len(cache) <= 3  # far below the 256 entries a count bound would keep
    assert cache.cached(_choices(8, 100)) and not cache.cached(_choices(1, 100))  # LRU
    big = _choices(99, 400)  # compiles to more than the whole budget: served, not kept
    assert cache.compile(big).memory_size_bytes > cache.max_bytes
    assert not cache.cached(big) and cache.resident_bytes <= cache.max_bytes


def test_engine_stats_report_the_grammar_cache(llm: LLM) -> None:
    llm.core.grammars.compile(StructuredOutputs(choice=["yes", "no"]))
    stats = llm.stats()
    assert stats.grammar_cache_limit_bytes == 256 * 2**20 and stats.max_grammar_bytes == 4000
    assert 0 < stats.grammar_cache_bytes <= stats.grammar_cache_limit_bytes
    assert stats.grammar_cache_entries >= 1


def test_a_spec_over_the_size_limit_is_refused_before_compiling(llm: LLM) -> None:
    spec = _choices(7, 200)  # ~8 KB of canonical JSON, the engine allows 4,000 bytes
    assert spec.size > 4000
    with pytest.raises(InvalidArgument, match="at most 4000 on this server") as caught:
        llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert caught.value.field == "structured_outputs"
    assert not llm.core.grammars.cached(spec)
    assert llm.stats().num_waiting == 0


@pytest.mark.parametrize(
    "ref",
    [
        "http://127.0.0.1:9/schema.json",
        "file:///etc/passwd",
        "other.json#/$defs/x",
        "#/$defs/missing",
        "#an-anchor",
        "https://example.com/root.json#/$defs/x",
    ],
)
def test_a_ref_that_does_not_resolve_inside_the_schema_is_refused(llm: LLM, ref: str) -> None:
    schema = {
        "$defs": {"x": {"type": "integer"}},
        "type": "object",
        "properties": {"a": {"$ref": ref}},
        "required": ["a"],
    }
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(json=schema))
    message = "structured_outputs.json/properties/a/$ref: " + repr(ref) + " does not resolve"
    with pytest.raises(InvalidArgument, match=re.escape(message)) as caught:
        llm.generate(["Hi"], params)
    assert caught.value.field == "structured_outputs"


def test_refs_inside_the_schema_are_served(llm: LLM) -> None:
    schema = {
        "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 9}, "a/b": {"enum": [1]}},
        "type": "object",
        "properties": {
            "n": {"$ref": "#/$defs/small"},
            "m": {"$ref": "#/$defs/a~1b"},  # JSON pointer escapes
            "$ref": {"type": "boolean"},  # a property named $ref is not a reference
            "c": {"const": {"$ref": "http://example.com/"}},  # nor is a value
        },
        "required": ["n", "m", "$ref"],
        "additionalProperties": False,
    }
    spec = StructuredOutputs(json=schema)
    params = SamplingParams(max_tokens=60, temperature=0, structured_outputs=spec)
    out = llm.generate(["Hi"], params)[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)


def test_a_ref_inside_a_structural_tag_schema_is_checked_too(llm: LLM) -> None:
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<call>",
            "content": {"type": "json_schema", "json_schema": {"$ref": "file:///etc/passwd"}},
            "end": "</call>",
        },
    }
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(structural_tag=tag))
    with pytest.raises(InvalidArgument, match=re.escape("'file:///etc/passwd' does not resolve")):
        llm.generate(["Hi"], params)
