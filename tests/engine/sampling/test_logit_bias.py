"""``logit_bias`` in the engine, as vLLM serves it: added to the model's logits (greedy and
sampled alike), ids checked against the model's vocabulary before anything is queued."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.errors import InvalidArgument


def test_logit_bias_steers_generation_and_ids_are_vocab_checked(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="2MiB")
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    free = llm.generate(["Once upon a time"], plain)[0].token_ids
    forced = 305 if 305 not in free else 306
    biased = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={forced: 100.0}
    )
    assert llm.generate(["Once upon a time"], biased)[0].token_ids == [forced] * 6
    sampled = SamplingParams(max_tokens=6, seed=1, ignore_eos=True, logit_bias={forced: 100.0})
    assert llm.generate(["Once upon a time"], sampled)[0].token_ids == [forced] * 6
    banned = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logit_bias={t: -100.0 for t in free}
    )
    assert not set(llm.generate(["Once upon a time"], banned)[0].token_ids) & set(free)
    vocab = llm.core.model_config.vocab_size
    with pytest.raises(InvalidArgument, match=f"token id {vocab} is out of vocabulary") as caught:
        llm.generate(["Hi"], SamplingParams(logit_bias={vocab: 1.0, 3: 1.0}))
    assert caught.value.field == "logit_bias"
    assert llm.stats().num_waiting == 0
