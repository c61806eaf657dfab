"""Parity with transformers (fp32) for the model families beyond Llama: Qwen3, Gemma 2/3,
Phi-3 (plain, longrope, partial rotary), Mixtral and Qwen3-MoE.

Per family: three prompts of different lengths prefilled in one batch (the longest runs
past the sliding window where the family has one), four greedy decode steps, then a new
sequence that reuses the longest prompt's cached blocks and computes only its tail; every
row's logits are compared with transformers' on the whole sequence, and the greedy tokens
must be the same.
"""

from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.loading.loader import load_model
from kvgate.engine.models import packed_linear as pl
from tests.engine.conftest import FAMILY_CONFIGS, WINDOW
from tests.engine.models.test_llama import BLOCK_SIZE, PagedRun, _reference, _reference_logits

FAMILIES = tuple(FAMILY_CONFIGS)
PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village by the river, there lived an old clockmaker "
    "and his daughter. Every morning he wound every clock on the wall, and every evening "
    "she read to him from a book of maps.",
]
TOL = dict(atol=2e-4, rtol=2e-4)


def _check_rows(logits: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(logits, expected, **TOL)
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_matches_transformers(arch: str, hf_checkpoint) -> None:
    path = hf_checkpoint(arch)
    lm = load_model(path, dtype="float32")
    reference = _reference(path)
    prompts = [lm.tokenizer.encode(text) for text in PROMPTS]
    windows = [w for w in lm.config.layer_windows if w is not None]
    if windows:
        assert max(len(p) for p in prompts) > 3 * max(windows) == 3 * WINDOW
    run = PagedRun(lm)
    seqs = [run.add_sequence(len(p) + 4) for p in prompts]
    logits = run.step(seqs, prompts, [len(p) for p in prompts])
    start = 0
    for ids in prompts:
        _check_rows(logits[start : start + len(ids)], _reference_logits(reference, ids))
        start += len(ids)
    sequences = [list(p) for p in prompts]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    last = logits[ends]
    for _ in range(4):
        for seq, row in zip(sequences, last, strict=True):
            seq.append(int(row.argmax()))
        last = run.step(seqs, [[s[-1]] for s in sequences], [len(s) for s in sequences])
        for row, seq in zip(last, sequences, strict=True):
            _check_rows(row[None], _reference_logits(reference, seq)[-1:])

    # A prefix hit: the longest prompt's first full blocks, then a new tail.
    cached = (len(prompts[2]) // BLOCK_SIZE) * BLOCK_SIZE
    tail = lm.tokenizer.encode(" and then the clocks all stopped.", add_special_tokens=False)
    hit = prompts[2][:cached] + tail
    fresh = -(-len(hit) // BLOCK_SIZE) - cached // BLOCK_SIZE
    shared = run.tables[seqs[2]][: cached // BLOCK_SIZE]
    run.tables.append(shared + [run.free.pop(0) for _ in range(fresh)])
    hit_logits = run.step([len(run.tables) - 1], [tail], [len(hit)])
    _check_rows(hit_logits, _reference_logits(reference, hit)[cached:])


@pytest.mark.parametrize("arch", ["gemma2", "qwen3_moe"])
def test_bfloat16_packed_path_tracks_unpacked(arch: str, hf_checkpoint, monkeypatch) -> None:
    """bf16 on CPU runs the oneDNN-packed matmuls (GeGLU, packed experts): within bf16
    rounding of the same model on plain F.linear."""
    path = hf_checkpoint(arch)
    packed = load_model(path, dtype="bfloat16")
    if packed.model.lm_head_packed is None:
        pytest.skip("this CPU's oneDNN has no bf16 kernels")
    monkeypatch.setattr(pl, "packing_helps", lambda weight: False)
    plain = load_model(path, dtype="bfloat16")
    ids = packed.tokenizer.encode(PROMPTS[1])
    logits = [run.step([run.add_sequence(len(ids))], [ids], [len(ids)])
              for run in (PagedRun(packed), PagedRun(plain))]  # fmt: skip
    assert (logits[0] - logits[1]).abs().max() < 0.05 * logits[1].abs().max()


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "qwen3_moe"])
def test_engine_greedy_matches_transformers_and_survives_a_prefix_hit(
    arch: str, hf_checkpoint
) -> None:
    """Through the whole engine (scheduler, chunked prefill, prefix cache): the greedy tokens
    of a prompt past the window equal transformers' generate, cold and from the cache."""
    path = hf_checkpoint(arch)
    # 16-token chunks: the prompt's chunked prefill starts inside earlier chunks' windows.
    llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB", max_num_seqs=2,
              max_num_batched_tokens=16)  # fmt: skip
    prompt = llm.tokenizer.encode(PROMPTS[2])
    assert len(prompt) > 3 * 16
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cold, warm = (llm.generate([prompt], params)[0] for _ in range(2))
    assert warm.cached_tokens >= BLOCK_SIZE * (len(prompt) // BLOCK_SIZE - 1) > 0
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        expected = _reference(path).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
    assert cold.token_ids == warm.token_ids == expected


def test_longrope_positions_past_the_original_length_use_the_long_factors(hf_checkpoint) -> None:
    """Per position, as vLLM does: below original_max_position_embeddings the short factors
    (what transformers uses for such sequences, checked above), from there on the long ones,
    each against transformers' own longrope frequencies and attention factor."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = hf_checkpoint("phi3-longrope")
    lm = load_model(path, dtype="float32")
    hf_config = AutoConfig.from_pretrained(path)
    original = hf_config.rope_parameters["original_max_position_embeddings"]
    longrope = ROPE_INIT_FUNCTIONS["longrope"]
    for positions, seq_len in (
        (torch.arange(0, original), None),
        (torch.arange(original, 300), 300),
    ):
        inv_freq, factor = longrope(hf_config, "cpu", seq_len=seq_len)
        assert factor > 1.0
        angles = torch.outer(positions.float(), inv_freq)
        cos = torch.cat((angles.cos(), angles.cos()), -1) * factor
        torch.testing.assert_close(lm.model.rope_cos_0[positions], cos, atol=1e-5, rtol=1e-5)
