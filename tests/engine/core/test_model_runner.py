"""The model runner's steps: a step of decodes verifying drafts runs one row per token, so the
decode stack serves it as it serves plain decodes (one read of the weights for every draft),
and its tokens are those of plain decoding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvgate.engine.native as native
from kvgate.engine import LLM, SamplingParams
from kvgate.engine.attention import get_attention_backend
from kvgate.engine.models import decode_stack, llama

pytestmark = pytest.mark.skipif(
    native.library() is None or get_attention_backend("torch").decode_kernel is None,
    reason="no native library: no decode stack to serve the steps",
)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SPAN = [(11 * i) % 700 + 40 for i in range(24)]


@pytest.fixture
def stack_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The query rows of each step the decode stack ran."""
    rows: list[int] = []
    run = decode_stack.DecodeStack.run

    def counted(self: decode_stack.DecodeStack, x: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(x.shape[0])
        return run(self, x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_stack.DecodeStack, "run", counted)
    yield rows


def test_drafts_are_verified_through_the_decode_stack(
    tiny_model_dir: Path, stack_runs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    layer_steps = [0]
    forward = llama.LlamaForCausalLM.forward

    def counted(self: llama.LlamaForCausalLM, *args: object, **kwargs: object) -> torch.Tensor:
        layer_steps[0] += 1
        return forward(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llama.LlamaForCausalLM, "forward", counted)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = SPAN + [7, 8] + SPAN[:6]  # repeats its context: drafts are found
    plain = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
    want = plain.generate([prompt], params)[0].token_ids
    speculating = LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", speculative_config=SPEC
    )
    stack_runs.clear()
    before = layer_steps[0]
    assert speculating.generate([prompt], params)[0].token_ids == want
    spec = speculating.core.stats().serving.spec
    assert spec.accepted_tokens > 0
    assert max(stack_runs) > 1  # drafts rode along: several rows of one sequence in a step
    steps = layer_steps[0] - before
    assert steps == 1 + len(stack_runs)  # the prefill; every other step through the stack
