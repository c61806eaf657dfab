"""Sliding windows and soft-capping (Gemma 2/3, Mistral, Phi-3) in both backends: the torch
reference and the Triton kernels (interpreted) against dense fp64 attention, with contexts
well past the window, chunked prefills that start inside it, and decodes."""

import pytest
import torch
from attention_cases import DEVICE, expected_output, make_case

from kvgate.engine.attention import get_attention_backend
from kvgate.engine.attention.kv_cache import FP8_DTYPE
from kvgate.engine.attention.triton.paged_decode import paged_decode
from kvgate.engine.attention.triton.paged_prefill import paged_prefill

pytestmark = pytest.mark.triton

# (window, softcap): window only, softcap only, both; a window shorter than a key tile, one
# spanning several tiles, and one longer than every context (a no-op).
SETTINGS = [(5, None), (70, None), (None, 2.0), (16, 1.5), (500, None)]
# Sequences: a long fresh prompt, a decode far past the window, a chunk continuing a cache.
SEQ_LENS, QUERY_LENS = [90, 300, 150], [90, 1, 37]


@pytest.mark.parametrize(("window", "softcap"), SETTINGS)
def test_torch_backend_matches_dense(window: int | None, softcap: float | None) -> None:
    case = make_case(SEQ_LENS, QUERY_LENS, 4, 2, head_dim=32)
    backend = get_attention_backend("torch", DEVICE)
    out = backend.paged_attention(case.q, case.cache, case.md, case.scale, window=window,
                                  softcap=softcap)  # fmt: skip
    want = expected_output(case, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("window", "softcap"), SETTINGS)
def test_triton_decode_matches_dense(window: int | None, softcap: float | None) -> None:
    case = make_case([300, 17, 700], [1, 1, 1], 8, 2, head_dim=32, cache_dtype=FP8_DTYPE)
    out = paged_decode(case.q, case.cache, case.md.seq_lens, case.md.block_tables,
                       case.md.max_seq_len, case.scale, window=window, softcap=softcap)  # fmt: skip
    want = expected_output(case, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("window", "softcap"), SETTINGS)
def test_triton_prefill_matches_dense(window: int | None, softcap: float | None) -> None:
    case = make_case(SEQ_LENS, QUERY_LENS, 6, 2, head_dim=32)
    out = torch.full_like(case.q, 7.0)
    paged_prefill(case.q, case.cache, case.md, case.scale, out, window=window, softcap=softcap)
    multi = torch.tensor([n for n in QUERY_LENS for _ in range(n)], device=out.device) > 1
    want = expected_output(case, window=window, softcap=softcap)
    torch.testing.assert_close(out[multi].double(), want[multi], atol=1e-4, rtol=0)


def test_window_and_softcap_change_the_result() -> None:
    """The settings above are not no-ops on these cases (except the long window)."""
    case = make_case(SEQ_LENS, QUERY_LENS, 4, 2, head_dim=32)
    plain = expected_output(case)
    for window, softcap in SETTINGS[:-1]:
        assert (expected_output(case, window=window, softcap=softcap) - plain).abs().max() > 1e-2
    torch.testing.assert_close(expected_output(case, window=500), plain)


@pytest.mark.parametrize(("window", "softcap"), [(16, 1.5), (70, None)])
def test_triton_backend_mixed_step_matches_torch_backend(
    window: int | None, softcap: float | None
) -> None:
    case = make_case(SEQ_LENS, QUERY_LENS, 4, 2, head_dim=32, cache_dtype=torch.bfloat16)
    options = dict(window=window, softcap=softcap)
    out = get_attention_backend("triton", DEVICE).paged_attention(
        case.q, case.cache, case.md, case.scale, **options
    )
    reference = get_attention_backend("torch", DEVICE).paged_attention(
        case.q, case.cache, case.md, case.scale, **options
    )
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=0)


def test_engine_on_triton_kernels_matches_the_torch_backend(hf_checkpoint) -> None:
    """Gemma 2 (sliding layers, soft-capping) greedy through the engine, prompt past the
    window, then again from the prefix cache: the same tokens on both backends."""
    from kvgate.engine import LLM, SamplingParams

    path = hf_checkpoint("gemma2")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompt = [(7 * i) % 900 + 20 for i in range(45)]
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(path), dtype="float32", kv_cache_memory="2MiB", attention_backend=backend,
                  device=DEVICE.type)  # fmt: skip
        runs = [llm.generate([prompt], params)[0] for _ in range(2)]
        assert runs[1].cached_tokens > 0 and runs[0].token_ids == runs[1].token_ids
        tokens[backend] = runs[0].token_ids
    assert tokens["triton"] == tokens["torch"]
