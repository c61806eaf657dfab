"""PyTorch reference attention over the paged KV cache: the CPU serving path and the oracle
the Triton kernels are tested against.

Decode rows (one query per sequence) of a step are served together: the K/V of every decoding
sequence is gathered into a padded ``[B, Hkv, L, D]`` tensor through the block tables, the
``G = Hq / Hkv`` query heads of a KV head taking the place of the query-length axis. Prefill
rows (several queries) go per sequence, causal with the queries aligned to the end of the
context, in tiles of query rows so the masked upper triangle is not computed.

Both are two batched matmuls in the cache dtype around a softmax that accumulates in fp32
(bf16 serving converts nothing; an fp8 cache is dequantized to fp32). On CPUs without AMX this
is 1.5-2x faster than torch's fused SDPA kernel for these shapes. Few, large ops per layer: on
a shared CPU every parallel region costs.

With ``fused`` (the CPU backend sets it where the CPU has AMX tiles for bf16), bf16 layers
without soft-capping go through ``scaled_dot_product_attention`` instead, over the same
gathered K/V: its flash kernel runs the matmuls on AMX and never materializes the scores. On a
2-core Xeon with AMX: a 2,000-token prefill 3.6x faster than the tiles here, a 256-token one
5x; decode 2.3x at batch 1, 1.2-1.6x at batch 8-32.

With ``decode_kernel`` (the CPU backend passes the native one, `kvgate.engine.attention.cpu`, where it
builds) the decode rows skip the gather: the kernel reads each block where it lies. With
``prefill_kernel`` (likewise) the prefill sequences of a layer go to one call of a fused
native kernel that never materializes the scores (SDPA keeps the bf16 prefills where ``fused``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

import kvgate.engine.cpu_ops as cpu_ops
from kvgate.engine.attention.kv_cache import FP8_DTYPE, KVCache, quantize_fp8
from kvgate.engine.attention.metadata import AttentionMetadata

# Prefill query tiles are 256 rows (fewer, larger batched matmuls: 7-10% faster than 128 at
# 512-2,000 tokens on Zen 4), fewer where a tile would exceed this many scores.
T = TypeVar("T")
_MAX_TILE_SCORES = 1 << 22


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``k``/``v`` ``[T, Hkv, D]`` into their slots (quantizing for fp8); slots < 0 skipped.
    A bf16/fp32 cache on CPU takes one native call (no mask, no ``.item()`` sync, no index ops)."""
    if cache.k_scale is None and cpu_ops.write_kv(cache.k, cache.v, k, v, slot_mapping):
        return
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    blocks = slot_mapping // cache.block_size
    offsets = slot_mapping % cache.block_size
    for store, scales, new in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        if scales is None:
            store[blocks, :, offsets] = new.to(store.dtype)
        else:
            values, scale = quantize_fp8(new)
            _bytes(store)[blocks, :, offsets] = _bytes(values)
            scales[blocks, :, offsets] = scale


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as raw bytes: indexing kernels do not cover fp8 on every device."""
    return x.view(torch.uint8) if x.dtype == FP8_DTYPE else x


class DecodeKernel(Protocol):
    """Decode attention over the cache in place (`kvgate.engine.attention.cpu.NativeDecode`):
    ``q [B, Hq, D]``, the sequences' block tables ``[B, W]`` and lengths ``[B]`` (int32)."""

    def takes(self, q: torch.Tensor, cache: KVCache) -> bool: ...

    def __call__(
        self, q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
    ) -> torch.Tensor: ...  # fmt: skip


class PrefillKernel(Protocol):
    """Fused prefill attention over the cache in place (`kvgate.engine.attention.cpu.NativePrefill`):
    writes the query rows of the sequences ``seqs`` (``[S]`` int32 indices into ``md``) of
    ``out``."""

    def takes(self, q: torch.Tensor, cache: KVCache) -> bool: ...

    def __call__(
        self, q: torch.Tensor, cache: KVCache, md: AttentionMetadata, seqs: torch.Tensor,
        scale: float, window: int | None, softcap: float | None, out: torch.Tensor,
    ) -> None: ...  # fmt: skip


@dataclass
class _Prefill:
    q_start: int
    q_end: int
    seq_len: int
    cache_rows: torch.Tensor  # [Hkv * nblk], see _cache_rows


@dataclass
class _StepPlan:
    """Index tensors shared by all layers of one step. The gather rows and the padding bias
    are built on first use: a step whose decodes all go to the native kernel never needs them."""

    decode_seqs: torch.Tensor  # [Bd] int64 indices of the sequences with one query
    decode_query_rows: torch.Tensor | None  # [Bd] query rows; None when every row is a decode
    decode_tables: torch.Tensor  # [Bd, nblk] int32: the decoding sequences' block tables
    decode_lens: torch.Tensor  # [Bd] int32: their context lengths
    prefills: list[_Prefill]
    prefill_seqs: torch.Tensor  # [Bp] int32 indices of the sequences with several queries
    block_size: int
    kv_heads: int

    @property
    def num_decodes(self) -> int:
        return self.decode_seqs.shape[0]

    @functools.cached_property
    def decode_cache_rows(self) -> torch.Tensor:
        """[Bd * Hkv * nblk], see _cache_rows."""
        return _cache_rows(self.decode_tables, self.kv_heads)

    @functools.cached_property
    def decode_bias(self) -> torch.Tensor:
        """[Bd, 1, 1, nblk * block_size] fp32: 0 = attend, -inf = padding."""
        tables, lens = self.decode_tables, self.decode_lens
        keys = torch.arange(tables.shape[1] * self.block_size, device=tables.device)
        padding = keys[None, :] >= lens[:, None]
        bias = torch.zeros(padding.shape, device=tables.device)
        return bias.masked_fill_(padding, float("-inf"))[:, None, None, :]


def _once(md: AttentionMetadata, key: str, build: Callable[[], T]) -> T:
    """``build()``, computed once a step and kept in ``md.derived`` for the step's layers."""
    if key not in md.derived:
        md.derived[key] = build()
    value: T = md.derived[key]
    return value


def _step_plan(md: AttentionMetadata, block_size: int, kv_heads: int) -> _StepPlan:
    return _once(
        md, f"torch_plan/{block_size}/{kv_heads}", lambda: _build_plan(md, block_size, kv_heads)
    )


def _cache_rows(blocks: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Block tables ``[S, nblk]`` -> rows of the cache viewed as ``[blocks * Hkv, bs, D]``,
    ordered (sequence, head, block): one gather then yields ``[S, Hkv, nblk * bs, D]``."""
    heads = torch.arange(kv_heads, device=blocks.device)
    return (blocks.long()[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)


def _build_plan(md: AttentionMetadata, block_size: int, kv_heads: int) -> _StepPlan:
    starts = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    device = md.block_tables.device
    decode_seqs, prefills, prefill_seqs = [], [], []
    for i, seq_len in enumerate(seq_lens):
        if starts[i + 1] - starts[i] == 1:
            decode_seqs.append(i)
        else:
            prefill_seqs.append(i)
            blocks = md.block_tables[i : i + 1, : -(-seq_len // block_size)]
            prefills.append(
                _Prefill(starts[i], starts[i + 1], seq_len, _cache_rows(blocks, kv_heads))
            )
    nblk = max((-(-seq_lens[i] // block_size) for i in decode_seqs), default=0)
    seqs = torch.tensor(decode_seqs, dtype=torch.int64, device=device)
    tables = md.block_tables.index_select(0, seqs)[:, :nblk].contiguous()
    lens = md.seq_lens.index_select(0, seqs)
    query_rows = None
    if len(decode_seqs) != len(seq_lens):
        query_rows = md.query_start_loc.index_select(0, seqs).long()
    return _StepPlan(
        seqs, query_rows, tables, lens, prefills,
        torch.tensor(prefill_seqs, dtype=torch.int32, device=device), block_size, kv_heads,
    )  # fmt: skip


def _gather(
    store: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor, n_seqs: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """Cache rows -> ``[n_seqs, Hkv, nblk * block_size, D]`` in ``dtype``, dequantized."""
    num_blocks, heads, block_size, dim = store.shape
    picked = _bytes(store).view(num_blocks * heads, block_size, dim).index_select(0, rows)
    out = picked.view(store.dtype).to(dtype)
    if scales is not None:
        out.mul_(scales.view(num_blocks * heads, block_size).index_select(0, rows)[..., None])
    return out.view(n_seqs, heads, -1, dim)


def _compute_dtype(q: torch.Tensor, cache: KVCache) -> torch.dtype:
    """The cache dtype when the queries share it (no conversion pass), else fp32."""
    return q.dtype if cache.k.dtype == q.dtype else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """``q k^T * scale``; the matmul runs in the inputs' dtype, accumulating in fp32.

    When the scale is a power of two (head_dim 64 or 256) and there is no soft-cap it goes onto
    the few queries, exactly, and the scores stay in the inputs' dtype: that saves two passes
    over the largest tensor of a prefill (~10% of a 2,000-token bf16 prompt). Otherwise the
    scores are scaled in fp32, and soft-capped to ``softcap * tanh(s / softcap)`` when given
    (Gemma 2)."""
    if softcap is None and math.frexp(scale)[0] == 0.5:
        return torch.matmul(q * scale, k.transpose(-1, -2))
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def _window_bias(
    md: AttentionMetadata, plan: _StepPlan, block_size: int, window: int
) -> torch.Tensor:
    """The decode bias with the keys that fell out of a sliding window masked as well."""

    def build() -> torch.Tensor:
        keys = torch.arange(plan.decode_bias.shape[-1], device=plan.decode_bias.device)
        first = md.seq_lens.index_select(0, plan.decode_seqs)[:, None] - window
        outside = (keys[None, :] < first)[:, None, None, :]
        return plan.decode_bias.masked_fill(outside, float("-inf"))

    return _once(md, f"torch_window_bias/{block_size}/{window}", build)


def _decode_bias(
    md: AttentionMetadata, plan: _StepPlan, block_size: int, window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The decode bias (sliding window applied) in ``dtype``: built once a step, not per layer."""
    bias = plan.decode_bias if window is None else _window_bias(md, plan, block_size, window)
    if bias.dtype == dtype:
        return bias
    return _once(md, f"torch_decode_bias/{block_size}/{window}/{dtype}", lambda: bias.to(dtype))


def _weighted_values(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(scores) v``: torch's CPU softmax accumulates bf16 scores in fp32; its weights
    are rounded once, to the dtype of ``v``."""
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def _decode(
    q: torch.Tensor, cache: KVCache, plan: _StepPlan, scale: float, bias: torch.Tensor,
    softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    n_seqs, num_heads, dim = q.shape
    kv_heads, dtype = cache.k.shape[1], _compute_dtype(q, cache)
    k = _gather(cache.k, cache.k_scale, plan.decode_cache_rows, n_seqs, dtype)
    v = _gather(cache.v, cache.v_scale, plan.decode_cache_rows, n_seqs, dtype)
    grouped = q.to(dtype).view(n_seqs, kv_heads, num_heads // kv_heads, dim)
    scores = _scores(grouped, k, scale, softcap).add_(bias)  # [B, Hkv, G, L]
    return _weighted_values(scores, v).reshape(n_seqs, num_heads, dim).to(q.dtype)


def _prefill(
    q: torch.Tensor, cache: KVCache, seq: _Prefill, scale: float, window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of one sequence's ``n_q`` queries, the last positions of its context,
    in tiles of query rows: a tile reads keys only up to its last query (and, with a sliding
    window, from its first query's window start), so the masked triangles are (mostly) never
    computed, and its scores stay small enough to live in cache."""
    n_q, num_heads, dim = q.shape
    dtype, seq_len = _compute_dtype(q, cache), seq.seq_len
    k = _gather(cache.k, cache.k_scale, seq.cache_rows, 1, dtype)[0, :, :seq_len]
    v = _gather(cache.v, cache.v_scale, seq.cache_rows, 1, dtype)[0, :, :seq_len]
    kv_heads = k.shape[0]
    group = num_heads // kv_heads
    grouped = q.to(dtype).view(n_q, kv_heads, group, dim).permute(1, 2, 0, 3)  # [Hkv, G, n_q, D]
    out = torch.empty_like(grouped)  # keeps q's [n_q, Hkv, G, D] memory order
    tile = max(16, min(256, _MAX_TILE_SCORES // (num_heads * seq_len)))
    causal = torch.full((tile, tile), float("-inf"), device=q.device).triu_(1)
    for start in range(0, n_q, tile):
        end = min(start + tile, n_q)
        rows, keys = end - start, seq_len - n_q + end  # query t sees keys 0 .. seq_len - n_q + t
        first = seq_len - n_q + start  # the tile's first query position
        lo = 0 if window is None else max(0, first - window + 1)
        tile_q = grouped[:, :, start:end].reshape(kv_heads, group * rows, dim)
        scores = _scores(tile_q, k[:, lo:keys], scale, softcap)
        scores = scores.view(kv_heads, group, rows, keys - lo)
        scores[..., keys - lo - rows :].add_(causal[:rows, :rows])
        if window is not None:  # key j is seen by query p when p - window < j
            key_pos = torch.arange(lo, keys, device=q.device)
            q_pos = torch.arange(first, first + rows, device=q.device)
            scores.masked_fill_(key_pos[None, :] <= q_pos[:, None] - window, float("-inf"))
        values = _weighted_values(scores.view(kv_heads, group * rows, keys - lo), v[:, lo:keys])
        out[:, :, start:end] = values.view(kv_heads, group, rows, dim)
    return out.permute(2, 0, 1, 3).reshape(n_q, num_heads, dim).to(q.dtype)


def _prefill_mask(
    md: AttentionMetadata, seq: _Prefill, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """The boolean ``[n_q, seq_len]`` mask of one prefill (True = attend), shared by the
    step's layers; None when plain causal attention from position 0 is the mask."""
    n_q = seq.q_end - seq.q_start
    if n_q == seq.seq_len and window is None:
        return None

    def build() -> torch.Tensor:
        keys = torch.arange(seq.seq_len, device=device)[None, :]
        positions = torch.arange(seq.seq_len - n_q, seq.seq_len, device=device)[:, None]
        mask = keys <= positions
        if window is not None:
            mask &= keys > positions - window
        return mask

    return _once(md, f"torch_prefill_mask/{seq.q_start}/{window}", build)


def _fused_decode(
    q: torch.Tensor, cache: KVCache, plan: _StepPlan, scale: float, bias: torch.Tensor
) -> torch.Tensor:
    """`_decode` through torch's fused SDPA kernel (no soft-cap, q and ``bias`` in the cache
    dtype)."""
    k = _gather(cache.k, None, plan.decode_cache_rows, q.shape[0], q.dtype)
    v = _gather(cache.v, None, plan.decode_cache_rows, q.shape[0], q.dtype)
    out = F.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=bias, scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def _fused_prefill(
    q: torch.Tensor, cache: KVCache, md: AttentionMetadata, seq: _Prefill, scale: float,
    window: int | None,
) -> torch.Tensor:  # fmt: skip
    """`_prefill` through torch's fused SDPA kernel (no soft-cap, q in the cache dtype)."""
    k = _gather(cache.k, None, seq.cache_rows, 1, q.dtype)[:, :, : seq.seq_len]
    v = _gather(cache.v, None, seq.cache_rows, 1, q.dtype)[:, :, : seq.seq_len]
    mask = _prefill_mask(md, seq, window, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    md: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    *,
    fused: bool = False,
    decode_kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over the paged cache -> ``[T, Hq, D]`` in q's dtype.
    ``window``: each query sees only its last ``window`` keys (itself included);
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask;
    ``fused``: bf16 layers through SDPA's fused kernel (see the module notes);
    ``decode_kernel``: decode rows through a native kernel that reads the cache in place
    (`kvgate.engine.attention.cpu`), where it takes the cache's dtype and head size;
    ``prefill_kernel``: likewise the prefill sequences (those ``fused`` does not take)."""
    plan = _step_plan(md, cache.block_size, cache.k.shape[1])
    fused = fused and softcap is None and q.dtype == cache.k.dtype == torch.bfloat16
    native = decode_kernel if decode_kernel is not None and decode_kernel.takes(q, cache) else None

    def decode(rows: torch.Tensor) -> torch.Tensor:
        if native is not None:
            tables, lens = plan.decode_tables, plan.decode_lens
            return native(rows, cache, tables, lens, scale, window, softcap)
        dtype = q.dtype if fused else plan.decode_bias.dtype
        bias = _decode_bias(md, plan, cache.block_size, window, dtype)
        if fused:
            return _fused_decode(rows, cache, plan, scale, bias)
        return _decode(rows, cache, plan, scale, bias, softcap)

    if plan.decode_query_rows is None and plan.num_decodes > 0:
        return decode(q)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if plan.num_decodes > 0:
        rows = plan.decode_query_rows
        out[rows] = decode(q[rows])
    if (
        plan.prefills
        and not fused
        and prefill_kernel is not None
        and prefill_kernel.takes(q, cache)
    ):
        prefill_kernel(q, cache, md, plan.prefill_seqs, scale, window, softcap, out)
        return out
    for seq in plan.prefills:
        rows = q[seq.q_start : seq.q_end]
        if fused:
            out[seq.q_start : seq.q_end] = _fused_prefill(rows, cache, md, seq, scale, window)
        else:
            out[seq.q_start : seq.q_end] = _prefill(rows, cache, seq, scale, window, softcap)
    return out
