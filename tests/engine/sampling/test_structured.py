"""Constrained decoding on the random tiny model: whatever the model would say, the output
fits the schema / regex / choice / grammar, in a batch, in every sampling mode, preempted."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.core.request import GRAMMAR_DEAD_END
from kvgate.engine.sampling.sampler import processed_logits
from kvgate.engine.sampling_params import StructuredOutputs
from tests.engine.sampling.test_sampler import Row
from tests.real_model import smollm2_file

SCHEMAS = [
    {  # nested objects, required, additionalProperties false
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "name": {"type": "string", "minLength": 1, "maxLength": 8},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {  # arrays with bounds, enums
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "level": {"enum": ["low", "high", 3]},
        },
        "required": ["tags", "level"],
        "additionalProperties": False,
    },
    {  # string patterns
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {  # numbers with ranges
        "type": "object",
        "properties": {
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10},
            "ratio": {"type": "integer", "minimum": -50, "maximum": -3},
        },
        "required": ["count", "ratio"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
]
SAMPLING_MODES = [
    {},
    {"top_k": 5},
    {"top_p": 0.8},
    {"repetition_penalty": 1.3, "presence_penalty": 0.5},
    {"temperature": 0},
    {"min_tokens": 3, "ignore_eos": True},
    {"logprobs": 2},
    {"seed": 11},
]
SAMPLES_PER_SCHEMA = 8  # 40 sampled generations in all, in one batch


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    yield LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=64)


def _params(spec: dict, mode: dict, max_tokens: int = 160) -> SamplingParams:
    fields = {"temperature": 1.0, "max_tokens": max_tokens, **mode}
    return SamplingParams(**fields, structured_outputs=StructuredOutputs(**spec))


def test_sampled_outputs_all_validate_against_their_schemas(llm: LLM):
    prompts, params, schemas = [], [], []
    for s, schema in enumerate(SCHEMAS):
        for i in range(SAMPLES_PER_SCHEMA):
            prompts.append(f"Item {s} number {i}: the quick brown fox")
            params.append(_params({"json": schema}, SAMPLING_MODES[i % len(SAMPLING_MODES)]))
            schemas.append(schema)
    # An unconstrained greedy request shares the batch: the masks are per row.
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = llm.generate(["Hello there"], free)[0].token_ids
    outputs = llm.generate([*prompts, "Hello there"], [*params, free])
    assert outputs[-1].token_ids == alone
    for output, schema in zip(outputs, schemas, strict=False):
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)
    assert len({o.text for o in outputs[:-1]}) > len(SCHEMAS)  # sampled, not one answer each


def test_regex_choice_grammar_and_json_object(llm: LLM):
    pattern = r"[a-z]{2,5}-\d{2}(\.[0-9])?"
    choices = ["yes", "no", "maybe later"]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    specs = [{"regex": pattern}, {"choice": choices}, {"grammar": grammar}, {"json_object": True}]
    params = [_params(spec, mode, max_tokens=60) for spec in specs for mode in SAMPLING_MODES[:4]]
    outputs = llm.generate(["Say something"] * len(params), params)
    for output, p in zip(outputs, params, strict=True):
        spec, text = p.structured_outputs, output.text
        if spec.json_object:  # unbounded: a random model rarely closes it within max_tokens
            assert text.startswith("{")
            assert output.finish_reason == "length" or isinstance(json.loads(text), dict)
            continue
        assert output.finish_reason == "stop", text
        if spec.regex:
            assert re.fullmatch(pattern, text), text
        elif spec.choice:
            assert text in choices
        else:
            assert re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text), text


@pytest.mark.parametrize("choices", [["😀 ok", "𝄞"], ["é ok", "€"], ['"\\q\n', "\u2028"]])
def test_every_character_of_a_choice_can_be_written(llm: LLM, choices: list[str]):
    """Characters past U+FFFF included: written into the grammar as JSON's surrogate-pair
    escapes, xgrammar would read them as two lone surrogates, which no token may spell."""
    params = [_params({"choice": choices}, mode, max_tokens=30) for mode in SAMPLING_MODES[:5]]
    for output in llm.generate(["Pick one"] * len(params), params):
        assert (output.text, output.finish_reason, output.stop_reason) in [
            (c, "stop", None) for c in choices
        ]


@pytest.mark.slow  # loads the 135M model
def test_a_real_vocabulary_writes_choices_past_the_bmp() -> None:
    smollm2 = LLM(str(smollm2_file()), kv_cache_memory="16MiB")
    choices = ["😀 ok", "𝄞"]
    params = [_params({"choice": choices}, mode, max_tokens=30) for mode in SAMPLING_MODES[:3]]
    for output in smollm2.generate(["Pick one"] * len(params), params):
        assert (output.text, output.finish_reason, output.stop_reason) in [
            (c, "stop", None) for c in choices
        ]


def test_a_complete_grammar_stops_the_request_whatever_min_tokens_and_ignore_eos_say(llm: LLM):
    params = _params({"choice": ["ok"]}, {"min_tokens": 5, "ignore_eos": True, "temperature": 0})
    output = llm.generate(["Hi"], params)[0]
    assert (output.text, output.finish_reason) == ("ok", "stop")


def test_preempted_constrained_requests_resume_their_grammar(tiny_model_dir: Path):
    tight = LLM(
        str(tiny_model_dir),
        dtype="float32",
        kv_cache_memory=8 * 16 * 1024 + 1,
        free_block_reserve=0,
        enable_prefix_caching=False,
        conversation_cache_share=1.0,
    )
    item = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "array", "items": item, "minItems": 12, "maxItems": 12}
    prompts = [[(s * 97 + i) % 900 + 10 for i in range(30)] for s in range(4)]
    outputs = tight.generate(prompts, _params({"json": schema}, {"seed": 3}, max_tokens=98))
    assert tight.core.replicas[0].scheduler.num_preemptions > 0
    for output in outputs:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), schema)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"json": {"type": "wibble"}}, "structured_outputs.json"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum greater"),
        ({"json": {"properties": {"a": {"minLength": "x"}}}}, "json/properties/a/minLength"),
        ({"json": {"not": {"type": "string"}}}, "json/not: not supported"),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"json": {"$ref": "#/nowhere"}}, "structured_outputs.json"),
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"grammar": "root ::= missing"}, "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_are_refused_before_anything_is_queued(llm: LLM, spec: dict, field: str):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["Hi"], _params(spec, {}))
    assert llm.stats().num_waiting == 0 and llm.stats().num_running == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"json": 3}, "json must be a JSON Schema"),
        ({"jsn": {}}, "unknown structured_outputs field 'jsn'"),
    ],
)
def test_malformed_structured_outputs_name_the_field(fields: dict, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams.from_dict({"structured_outputs": fields})


def test_compiled_grammars_are_cached_by_spec(llm: LLM):
    cache = llm.core.grammars
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = cache.compile(StructuredOutputs(json=schema))
    assert cache.compile(StructuredOutputs(json=json.loads(json.dumps(schema)))) is first
    assert cache.compile(StructuredOutputs(regex="a+")) is not first


def test_the_batch_bitmask_masks_only_grammar_rows_and_leaves_the_raw_logits(llm: LLM):
    vocab = llm.core.model_config.vocab_size
    state = llm.core.grammars.state(StructuredOutputs(choice=["ok", "no"]))
    rows = [Row(SamplingParams(), grammar=None), Row(SamplingParams(), grammar=state)]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    processed = processed_logits(logits, rows)
    assert torch.equal(logits, raw) and torch.equal(processed[0], raw[0])
    allowed = torch.isfinite(processed[1]).nonzero().flatten().tolist()
    texts = {llm.tokenizer.decode([t]) for t in allowed}
    assert allowed and all("ok".startswith(t) or "no".startswith(t) for t in texts), texts
    assert torch.equal(processed[1, allowed], raw[1, allowed])


CALL_ARGUMENTS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def _call_tag(schema: dict) -> dict:
    """Calls written as <call>{"name": "f", "arguments": …}</call>, one or more, ", "-separated."""
    tag = {
        "type": "tag",
        "begin": '<call>{"name": "f", "arguments": ',
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
        "end": "}</call>",
    }
    calls = {"type": "tags_with_separator", "tags": [tag], "separator": ", "}
    return {"type": "structural_tag", "format": {**calls, "at_least_one": True}}


def test_structural_tags_hold_fixed_text_and_schemas(llm: LLM):
    params = _params({"structural_tag": _call_tag(CALL_ARGUMENTS)}, {"seed": 5}, max_tokens=200)
    outputs = llm.generate(["Call f"] * 12, [replace(params, seed=i) for i in range(12)])
    finished = [o for o in outputs if o.finish_reason == "stop"]
    assert len(finished) >= 6  # a random model may keep adding calls up to max_tokens
    for output in finished:
        calls = re.findall(r'<call>\{"name": "f", "arguments": (.*?)\}</call>', output.text, re.S)
        assert (
            calls
            and ", ".join(f'<call>{{"name": "f", "arguments": {c}}}</call>' for c in calls)
            == output.text
        )
        for arguments in calls:
            jsonschema.validate(json.loads(arguments), CALL_ARGUMENTS)


def test_a_bad_schema_inside_a_structural_tag_is_named(llm: LLM):
    bad = _call_tag({"type": "object", "properties": {"a": {"maxLength": -1}}})
    with pytest.raises(ValueError, match=re.escape("structured_outputs.structural_tag/format/")):
        llm.generate(["Hi"], _params({"structural_tag": bad}, {}))
    with pytest.raises(ValueError, match="structured_outputs.structural_tag"):
        llm.generate(["Hi"], _params({"structural_tag": {"type": "structural_tag"}}, {}))


def test_a_grammar_dead_end_stops_and_says_why(llm: LLM):
    """The grammar is complete but min_tokens bans the end it allows: nothing can be drawn."""
    params = _params({"choice": ["ok"]}, {"min_tokens": 5, "temperature": 0})
    output = llm.generate(["Hi"], params)[0]
    assert (output.text, output.finish_reason) == ("ok", "stop")
    assert output.stop_reason == GRAMMAR_DEAD_END


def test_off_loop_compile_fills_the_cache_submit_uses(llm: LLM):
    spec = StructuredOutputs(json={"type": "object", "properties": {"zz": {"type": "boolean"}}})
    cache = llm.core.grammars
    with cache._build_lock:  # a worker building the compiler does not stall the loop's check
        assert not cache.cached(spec)
    compiled = cache.compile(spec)
    assert cache.cached(spec) and cache.compile(spec) is compiled
