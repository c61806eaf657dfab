"""Speculation changes no token: greedy outputs with n-gram or suffix drafts equal those
without, token for token, on the tiny model in fp32 (and in bf16 where the CPU computes it) — with prompts that repeat their context
and prompts that do not, the prefix cache on, LoRA adapters, a JSON schema, stop strings,
penalties, logprobs and two choices of one prompt, and the model as a Q4_1 GGUF file (the
quantized kernels verifying several rows per product) — and every block is given back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvgate.engine.native as native
from kvgate.engine import LLM, SamplingParams
from kvgate.engine.config import native_bf16_flags
from kvgate.engine.models.lora import LoRARequest
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import StructuredOutputs
from tests.engine.loading.gguf.gguf_files import Q, folder_to_gguf
from tests.engine.test_llm import assert_no_leaks
from tests.lora_adapters import ADAPTER_A, make_adapter

SPAN = [(11 * i) % 700 + 40 for i in range(24)]
PROMPTS = [
    SPAN + [7, 8] + SPAN[:6],  # repeats its context
    [5, 6, 7, 8, 9] * 6,
    [(7 * i) % 900 + 20 for i in range(45)],  # does not
    [3, 9, 42],
]
METHODS = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> LoRARequest:
    path = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "a", **ADAPTER_A)  # type: ignore[arg-type]
    return LoRARequest("a", str(path))


def _engine(model: Path, spec: dict[str, object] | None) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        kv_cache_memory="8MiB",
        enable_lora=True,
        speculative_config=spec,
    )


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Iterator[LLM]:
    yield _engine(tiny_model_dir, None)


@pytest.fixture(scope="module", params=sorted(METHODS))
def speculating(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[LLM]:
    engine = _engine(tiny_model_dir, METHODS[request.param])
    yield engine
    assert_no_leaks(engine)
    spec = engine.core.stats().serving.spec
    assert spec.accepted_tokens > 0 and spec.draft_tokens > spec.accepted_tokens


def _same(
    plain: LLM, speculating: LLM, params: SamplingParams, **kwargs: object
) -> list[RequestOutput]:
    expected = plain.generate(PROMPTS, params, **kwargs)  # type: ignore[arg-type]
    got = speculating.generate(PROMPTS, params, **kwargs)  # type: ignore[arg-type]
    for want, have in zip(expected, got, strict=True):
        assert have.token_ids == want.token_ids
        assert (have.text, have.finish_reason) == (want.text, want.finish_reason)
    return got


def test_greedy_tokens_and_logprobs_are_those_without_speculation(
    plain: LLM, speculating: LLM
) -> None:
    _same(plain, speculating, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    expected = plain.generate(PROMPTS, params)
    for want, have in zip(expected, speculating.generate(PROMPTS, params), strict=True):
        assert have.token_ids == want.token_ids and have.logprobs and want.logprobs
        for a, b in zip(have.logprobs, want.logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_q4_1_file_speculates_exactly(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, method: str
) -> None:
    """The GGUF blocks' own products verify the drafts (8 rows interleaved where vectors are):
    each verified row must come out as a one-row decode step's."""
    if native.library() is None:
        pytest.skip("no native library: GGUF weights are dequantized at load")
    path = folder_to_gguf(tiny_model_dir, tmp_path_factory.mktemp("q") / "tiny.gguf", Q.Q4_1)
    engines = [
        LLM(str(path), dtype="float32", kv_cache_memory="8MiB", speculative_config=spec)
        for spec in (None, METHODS[method])
    ]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want, got = (engine.generate(PROMPTS, params) for engine in engines)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engines[1].core.stats().serving.spec.accepted_tokens > 0
    assert_no_leaks(engines[1])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_bf16_weights_and_activations_speculate_exactly(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, method: str
) -> None:
    """In bf16, the dtype such a CPU serves by default, the dense model and its Q4_1 file
    (bf16 activations into the quantized products) verify drafts to a one-row step's tokens."""
    if not native_bf16_flags():
        pytest.skip("bf16 is emulated on this CPU: kvgate serves fp32 here")
    path = folder_to_gguf(tiny_model_dir, tmp_path_factory.mktemp("q") / "tiny.gguf", Q.Q4_1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for model in (tiny_model_dir, path):
        engines = [
            LLM(str(model), dtype="bfloat16", kv_cache_memory="8MiB", speculative_config=spec)
            for spec in (None, METHODS[method])
        ]
        want, got = (engine.generate(PROMPTS, params) for engine in engines)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert engines[1].core.stats().serving.spec.accepted_tokens > 0
        assert_no_leaks(engines[1])


def test_penalties_and_min_tokens_see_the_drafts_taken_before(plain: LLM, speculating: LLM) -> None:
    _same(
        plain,
        speculating,
        SamplingParams(
            max_tokens=30,
            temperature=0,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            min_tokens=20,
        ),
    )


def test_a_lora_adapter_speculates_exactly(
    plain: LLM, speculating: LLM, adapter: LoRARequest
) -> None:
    _same(
        plain,
        speculating,
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        lora_request=adapter,
    )


def test_a_json_schema_holds_and_matches(plain: LLM, speculating: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 12}},
        "required": ["a"],
    }
    params = SamplingParams(
        max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(json=schema)
    )
    for out in _same(plain, speculating, params):
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"a"}


def test_stop_strings_end_the_text_where_they_did(plain: LLM, speculating: LLM) -> None:
    free = plain.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, free, strict=True):
        stop = out.text[len(out.text) // 2 :][:2]
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
        want = plain.generate([prompt], params)[0]
        have = speculating.generate([prompt], params)[0]
        assert (have.text, have.finish_reason) == (want.text, "stop")


def test_two_choices_of_one_prompt_and_a_batch_past_the_back_off(
    plain: LLM, speculating: LLM
) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [
        PROMPTS[0],
        PROMPTS[0],
        *PROMPTS,
        *PROMPTS,
    ]  # 10 decodes: speculation backs off, then resumes
    expected = plain.generate(prompts, params)
    got = speculating.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
