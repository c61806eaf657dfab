"""Logits parity of the paged-cache model with transformers, per architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kvgate.engine.attention import AttentionMetadata, allocate_kv_caches, get_attention_backend
from kvgate.engine.attention.metadata import OutputRows
from kvgate.engine.loading.loader import LoadedModel, load_model
from kvgate.engine.models.gemm import NativeLinear
from kvgate.engine.models.llama import RMSNorm, rope_inv_freq
from kvgate.engine.models.model_config import ModelConfig

BLOCK_SIZE = 16
HF_ARCHS = ("llama", "llama3", "mistral", "qwen2")  # built by conftest.hf_checkpoint
PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village by the river, there lived an old clockmaker "
    "and his daughter. Every morning he wound every clock on the wall.",
    "你好，世界！ Größe 😀 → ∞",
]


class PagedRun:
    """Drives the model step by step over a fresh cache, with scattered block ids."""

    def __init__(self, lm: LoadedModel, num_blocks: int = 64):
        c = lm.config
        self.lm = lm
        self.caches = allocate_kv_caches(
            c.num_layers, num_blocks, c.num_kv_heads, BLOCK_SIZE, c.head_dim, lm.dtype, "cpu"
        )
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self.tables: list[list[int]] = []
        self.backend = get_attention_backend("torch")

    def add_sequence(self, max_len: int) -> int:
        blocks = -(-max_len // BLOCK_SIZE)
        self.tables.append([self.free.pop(0) for _ in range(blocks)])
        return len(self.tables) - 1

    def step(
        self,
        seqs: list[int],
        tokens: list[list[int]],
        seq_lens: list[int],
        wanted: list[int] | None = None,
    ) -> torch.Tensor:
        """Compute `tokens[i]` as the last tokens of sequence `seqs[i]`; logits of every row, or
        of the last rows of the sequences at indices ``wanted`` alone."""
        metadata = AttentionMetadata.from_lists(
            seq_lens, [len(t) for t in tokens], [self.tables[s] for s in seqs], BLOCK_SIZE
        )
        outputs = None
        if wanted is not None:
            ends = metadata.query_start_loc[1:].long() - 1
            chosen = torch.tensor(wanted, dtype=torch.int64)
            last = metadata.last_queries(chosen, max([seq_lens[i] for i in wanted], default=1))
            outputs = OutputRows(ends[chosen], last)
        input_ids = torch.tensor([t for row in tokens for t in row], dtype=torch.int64)
        with torch.inference_mode():
            hidden = self.lm.model(
                input_ids, metadata.positions, self.caches, metadata, self.backend, None, outputs
            )
            return self.lm.model.compute_logits(hidden)


def _reference(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_batched_prefill_and_decode_match_transformers(arch: str, hf_checkpoint) -> None:
    path = hf_checkpoint(arch)
    lm = load_model(path, dtype="float32")
    reference = _reference(path)
    prompts = [lm.tokenizer.encode(text) for text in PROMPTS]
    run = PagedRun(lm)
    seqs = [run.add_sequence(len(p) + 3) for p in prompts]
    logits = run.step(seqs, prompts, [len(p) for p in prompts])
    start = 0
    for ids in prompts:
        ours = logits[start : start + len(ids)]
        torch.testing.assert_close(ours, _reference_logits(reference, ids), atol=1e-4, rtol=1e-4)
        start += len(ids)
    sequences = [list(p) for p in prompts]
    last = [logits[end - 1] for end in torch.tensor([len(p) for p in prompts]).cumsum(0).tolist()]
    for _ in range(3):
        next_ids = [int(row.argmax()) for row in last]
        for seq, token in zip(sequences, next_ids, strict=True):
            seq.append(token)
        logits = run.step(seqs, [[t] for t in next_ids], [len(s) for s in sequences])
        for row, seq in enumerate(sequences):
            expected = _reference_logits(reference, seq)[-1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
        last = list(logits)


def test_chunked_prefill_matches_one_shot(hf_checkpoint) -> None:
    lm = load_model(hf_checkpoint("llama"), dtype="float32")
    ids = lm.tokenizer.encode(PROMPTS[2])
    whole = PagedRun(lm)
    whole_logits = whole.step([whole.add_sequence(len(ids))], [ids], [len(ids)])
    chunked = PagedRun(lm)
    seq = chunked.add_sequence(len(ids))
    pieces = [
        chunked.step([seq], [ids[i : i + 7]], [min(i + 7, len(ids))]) for i in range(0, len(ids), 7)
    ]
    torch.testing.assert_close(torch.cat(pieces), whole_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wanted", [[0, 2], [1], []])
def test_the_last_layer_computes_only_the_wanted_rows_and_writes_all_kv(
    hf_checkpoint, wanted: list[int]
) -> None:
    lm = load_model(hf_checkpoint("llama"), dtype="float32")
    prompts = [lm.tokenizer.encode(text) for text in PROMPTS[1:]]
    lens = [len(p) for p in prompts]
    whole, pruned = PagedRun(lm), PagedRun(lm)
    seqs = [whole.add_sequence(n + 1) for n in lens]
    assert seqs == [pruned.add_sequence(n + 1) for n in lens]
    every_row = whole.step(seqs, prompts, lens)
    ends = torch.tensor(lens).cumsum(0) - 1
    some_rows = pruned.step(seqs, prompts, lens, wanted)
    assert some_rows.shape[0] == len(wanted)
    torch.testing.assert_close(some_rows, every_row[ends[wanted]], atol=1e-5, rtol=1e-5)
    # The next token of every sequence reads the last layer's K/V of every prompt row.
    next_ids = [[int(every_row[end].argmax())] for end in ends]
    after = [n + 1 for n in lens]
    torch.testing.assert_close(
        pruned.step(seqs, next_ids, after), whole.step(seqs, next_ids, after), atol=1e-5, rtol=1e-5
    )


def test_bfloat16_tracks_transformers(hf_checkpoint) -> None:
    path = hf_checkpoint("qwen2")
    lm = load_model(path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    ids = lm.tokenizer.encode(PROMPTS[2])
    run = PagedRun(lm)
    logits = run.step([run.add_sequence(len(ids))], [ids], [len(ids)])
    expected = _reference_logits(_reference(path, torch.float32), ids)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_table_is_held_once_for_the_lookup_and_the_logits(
    hf_checkpoint, dtype: torch.dtype
) -> None:
    path = hf_checkpoint("qwen2")
    table = load_file(path / "model.safetensors")["model.embed_tokens.weight"].to(dtype)
    lm = load_model(path, dtype=dtype)
    if isinstance(lm.model.lm_head_packed, NativeLinear):  # our kernel's copy serves both
        assert lm.model.embed_weight is None
    hidden = torch.randn(3, lm.config.hidden_size).to(dtype)
    expected = (hidden.float() @ table.float().T).to(dtype).float()
    torch.testing.assert_close(lm.model.compute_logits(hidden), expected, rtol=1e-2, atol=1e-3)
    ids = torch.tensor([0, 5, table.shape[0] - 1])
    metadata = AttentionMetadata.from_lists([3], [3], [[1]], BLOCK_SIZE)
    caches = allocate_kv_caches(
        lm.config.num_layers,
        2,
        lm.config.num_kv_heads,
        BLOCK_SIZE,
        lm.config.head_dim,
        dtype,
        "cpu",
    )
    looked_up = []
    original = lm.model.layers[0].forward
    lm.model.layers[0].forward = lambda x, *args: looked_up.append(x.clone()) or original(x, *args)
    with torch.inference_mode():
        lm.model(ids, metadata.positions, caches, metadata, get_attention_backend("torch"))
    assert torch.equal(looked_up[0], table[ids])


def test_raw_logits_are_the_lm_heads_output_and_refused_when_soft_capped(hf_checkpoint) -> None:
    lm = load_model(hf_checkpoint("qwen2"), dtype="bfloat16")
    hidden = torch.randn(3, lm.config.hidden_size, dtype=torch.bfloat16)
    raw = lm.model.compute_logits(hidden, raw=True)
    assert raw.dtype == torch.bfloat16
    assert torch.equal(raw.float(), lm.model.compute_logits(hidden))
    capped = load_model(hf_checkpoint("gemma2"), dtype="float32")
    with pytest.raises(ValueError, match="soft-capped"):
        capped.model.compute_logits(torch.randn(1, capped.config.hidden_size), raw=True)


def test_greedy_decoding_matches_transformers_generate(tiny_model_dir: Path) -> None:
    lm = load_model(tiny_model_dir, dtype="float32")
    ids = lm.tokenizer.encode(PROMPTS[1])
    run = PagedRun(lm)
    seq = run.add_sequence(len(ids) + 24)
    logits = run.step([seq], [ids], [len(ids)])[-1:]
    ours = []
    for _ in range(24):
        ours.append(int(logits[0].argmax()))
        logits = run.step([seq], [ours[-1:]], [len(ids) + len(ours)])
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        expected = _reference(tiny_model_dir).generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=lm.tokenizer.eos_token_ids[0],
        )
    assert ours == expected[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_scaling_matches_transformers(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters=rope)
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    assert attention_factor == 1.0
    raw = {**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_hf(raw)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (9, 512), (5, 3, 128), (300, 64), (70, 3, 32)])
def test_rms_norm_is_transformers_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    norm = RMSNorm(shape[-1], 1e-6, dtype, "cpu")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    # transformers' LlamaRMSNorm: fp32 statistics, rounded to the dtype, then the weight.
    xf = x.float()
    expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {}
    before = x.clone()
    torch.testing.assert_close(norm(x), expected, **tolerance)
    assert torch.equal(x, before)  # the input (a residual stream) is left as it was
