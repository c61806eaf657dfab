"""The decode stack (`kvgate.engine.models.decode_stack`): a decode step's layers as one native call
give the Python layers' logits and K/V bit for bit (the same kernels in the same order),
bf16 and fp32, with qkv biases, Qwen3's q/k norms and sliding windows, over bf16 checkpoints
and over GGUF blocks served quantized; and the models, caches and backends it cannot serve
keep their Python layers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvgate.engine.native as native
from kvgate.engine import LLM, SamplingParams
from kvgate.engine.attention import allocate_kv_caches, get_attention_backend
from kvgate.engine.attention.backend import TORCH_BACKEND
from kvgate.engine.loading.loader import load_model
from kvgate.engine.models import decode_stack, gemm, llama
from tests.engine.loading.gguf.gguf_files import Q, folder_to_gguf
from tests.engine.models.test_llama import PROMPTS, PagedRun

pytestmark = pytest.mark.skipif(
    native.library() is None or get_attention_backend("torch").decode_kernel is None,
    reason="no native library: the kernels the stack calls are not there",
)
# bf16 weights are packed for our GEMM only where the CPU computes bf16 (AVX-512 BF16, AMX);
# elsewhere (AVX2) they stay plain tensors, the Python layers serve, and fp32 is native.
BF16_PACKED = gemm.packs(torch.empty(8, 8, dtype=torch.bfloat16))
NATIVE_DTYPE = torch.bfloat16 if BF16_PACKED else torch.float32


@pytest.fixture
def layer_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times the Python decoder layers ran."""
    calls = [0]
    forward = llama.DecoderLayer.forward

    def counted(self: llama.DecoderLayer, *args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(llama.DecoderLayer, "forward", counted)
    yield calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "qwen3-window"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_steps_through_the_stack_equal_the_python_layers(
    hf_checkpoint, arch: str, dtype: str, layer_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    if dtype == "bfloat16" and not BF16_PACKED:
        pytest.skip("no bf16 GEMM on this CPU: bf16 steps run the Python layers")
    native, python = (PagedRun(load_model(hf_checkpoint(arch), dtype=dtype)) for _ in range(2))
    prompts = [native.lm.tokenizer.encode(text) for text in PROMPTS]
    lens = [len(p) for p in prompts]
    seqs = [native.add_sequence(n + 4) for n in lens]
    assert seqs == [python.add_sequence(n + 4) for n in lens]
    logits = native.step(seqs, prompts, lens)
    assert torch.equal(logits, python.step(seqs, prompts, lens))
    ends = torch.tensor(lens).cumsum(0) - 1
    tokens = [[int(logits[end].argmax())] for end in ends]
    for _ in range(3):  # decode steps: one query row per sequence
        lens = [n + 1 for n in lens]
        monkeypatch.setenv(decode_stack.DISABLE_ENV, "1")
        before = layer_calls[0]
        stacked = native.step(seqs, tokens, lens)
        assert layer_calls[0] == before  # the stack ran the layers
        monkeypatch.setenv(decode_stack.DISABLE_ENV, "0")
        layered = python.step(seqs, tokens, lens)
        assert layer_calls[0] > before
        assert torch.equal(stacked, layered)
        tokens = [[int(row.argmax())] for row in stacked]
    for mine, theirs in zip(native.caches, python.caches, strict=True):
        assert torch.equal(mine.k, theirs.k) and torch.equal(mine.v, theirs.v)


def test_what_the_stack_cannot_serve_keeps_its_layers(hf_checkpoint) -> None:
    def stack(arch: str, kv_cache_dtype: torch.dtype | None = None, backend=None) -> object:
        lm = load_model(hf_checkpoint(arch), dtype=str(NATIVE_DTYPE).removeprefix("torch."))
        c = lm.config
        caches = allocate_kv_caches(
            c.num_layers, 8, c.num_kv_heads, 16, c.head_dim, kv_cache_dtype or lm.dtype, "cpu"
        )
        return decode_stack.build(lm.model, caches, backend or get_attention_backend("torch"))

    assert stack("llama") is not None
    assert stack("qwen3") is not None  # per-head q/k norms: the Python layers' ATen ops
    assert stack("gemma2") is None  # sandwich norms, GeGLU, soft-caps
    assert stack("phi4-partial") is None  # RoPE over part of each head
    other = torch.float32 if NATIVE_DTYPE == torch.bfloat16 else torch.bfloat16
    assert stack("llama", other) is None  # a cache of another dtype
    assert stack("llama", torch.float8_e4m3fn) is None  # fp8: its own K/V write
    assert stack("llama", backend=TORCH_BACKEND) is None  # no native decode kernel


def test_quantized_blocks_through_the_stack_answer_as_the_python_layers(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layer_calls: list[int]
) -> None:
    path = folder_to_gguf(tiny_model_dir, tmp_path / "q4_1.gguf", Q.Q4_1, {})
    prompts = [[1, 5, 9, 200, 33], [7, 7, 7, 100, 513, 2, 900, 41, 8, 8, 3]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    answers = []
    for enabled in ("1", "0"):
        monkeypatch.setenv(decode_stack.DISABLE_ENV, enabled)
        llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
        before = layer_calls[0]
        answers.append([out.token_ids for out in llm.generate(prompts, params)])
        layers = llm.core.replicas[0].runner.model.config.num_layers
        # a prefill step through the layers; then every decode step too, or none
        assert (layer_calls[0] - before == layers) == (enabled == "1")
    assert answers[0] == answers[1]
