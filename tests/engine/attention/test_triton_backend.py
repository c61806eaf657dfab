"""The Triton backend serves whole steps: decode rows by kernel, prefill rows by reference."""

from pathlib import Path

import pytest
import torch
from attention_cases import DEVICE, expected_output, make_case

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.attention import AttentionMetadata, allocate_kv_caches, get_attention_backend
from kvgate.engine.attention.kv_cache import FP8_DTYPE

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [4, 1, 9]])
def test_steps_match_the_torch_backend(query_lens: list[int]) -> None:
    triton_backend = get_attention_backend("triton", DEVICE)
    torch_backend = get_attention_backend("torch", DEVICE)
    case = make_case([26, 17, 40], query_lens, 4, 2, head_dim=32, cache_dtype=FP8_DTYPE)
    out = triton_backend.paged_attention(case.q, case.cache, case.md, case.scale)
    reference = torch_backend.paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.double(), expected_output(case), atol=1e-4, rtol=0)


def test_kernel_written_cache_serves_a_decode() -> None:
    backend = get_attention_backend("triton", DEVICE)
    case = make_case([18, 33], [1, 1], 2, 1, head_dim=16, cache_dtype=FP8_DTYPE)
    (cache,) = allocate_kv_caches(1, case.cache.k.shape[0], 1, 16, 16, FP8_DTYPE, DEVICE)
    tables = [case.md.block_tables[i].tolist() for i in range(2)]
    everything = AttentionMetadata.from_lists([18, 33], [18, 33], tables, 16, DEVICE)
    k, v = torch.cat(case.keys).to(DEVICE), torch.cat(case.values).to(DEVICE)
    backend.write_kv(cache, k, v, everything.slot_mapping)
    out = backend.paged_attention(case.q, cache, case.md, case.scale)
    torch.testing.assert_close(out.double(), expected_output(case), atol=1e-3, rtol=0)


def test_engine_with_triton_backend_matches_the_torch_backend(tiny_model_dir: Path) -> None:
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="fp8",
                  kv_cache_memory="1MiB", attention_backend=backend, device=DEVICE.type)  # fmt: skip
        tokens[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
