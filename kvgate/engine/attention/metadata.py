"""What one forward step attends to: an explicit description passed down to every layer.

A step is a batch of B sequences flattened into T query tokens. Sequence i owns the query
rows ``query_start_loc[i]:query_start_loc[i+1]``; they are the *last* ``n_q`` positions of a
context of ``seq_lens[i]`` tokens whose K/V live in the paged cache at ``block_tables[i]``.

    q rows:   [ seq0: 5 prefill tokens | seq1: 1 decode | seq2: 1 decode ]
    query_start_loc = [0, 5, 6, 7]     seq_lens = [5, 38, 17]

Index tensors that every layer needs (which rows are decodes, which cache blocks to gather,
the key mask) are derived once per step and memoised on the object, not per layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write
    max_query_len: int
    max_seq_len: int
    # Per-step memo for backends (key -> derived tensors); never part of equality or repr.
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def last_queries(
        self, seqs: torch.Tensor, max_seq_len: int, query_lens: list[int] | None = None
    ) -> AttentionMetadata:
        """Only the last query row of each of ``seqs`` (int64 indices), each a one-token query
        over its whole context (a decode row to every backend), its K/V already written:
        what a model's last layer attends for the rows whose output is wanted. With
        ``query_lens``, the last ``query_lens[i]`` rows of sequence ``seqs[i]`` (a request
        verifying drafts wants a row for each)."""
        count = seqs.shape[0]
        seq_lens = self.seq_lens.index_select(0, seqs)
        device = seq_lens.device
        if query_lens is None:
            positions = seq_lens.long() - 1
            starts = torch.arange(count + 1, dtype=torch.int32, device=device)
        else:
            positions = torch.tensor(
                [
                    p
                    for end, n in zip(seq_lens.tolist(), query_lens, strict=True)
                    for p in range(end - n, end)
                ],
                dtype=torch.int64,
                device=device,
            )
            starts = torch.tensor(
                [0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device
            )
        return AttentionMetadata(
            positions=positions,
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=self.block_tables.index_select(0, seqs),
            slot_mapping=torch.full((positions.shape[0],), -1, dtype=torch.int64, device=device),
            max_query_len=1 if query_lens is None else max(query_lens),
            max_seq_len=max_seq_len,
        )

    @classmethod
    def from_lists(
        cls,
        seq_lens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the tensors for sequences whose last ``query_lens[i]`` tokens are computed."""
        if not (len(seq_lens) == len(query_lens) == len(block_tables)):
            raise ValueError(
                "seq_lens, query_lens and block_tables must have one entry per sequence"
            )
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for seq_len, n_q, table in zip(seq_lens, query_lens, block_tables, strict=True):
            if not 0 < n_q <= seq_len or len(table) * block_size < seq_len:
                raise ValueError(f"bad sequence: seq_len={seq_len} n_q={n_q} blocks={len(table)}")
            for pos in range(seq_len - n_q, seq_len):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            starts.append(starts[-1] + n_q)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )


class OutputRows(NamedTuple):
    """The step's rows whose final hidden states are wanted (a sampled or pooled sequence's
    last, in batch order) and the metadata that attends for them alone (`last_queries`)."""

    rows: torch.Tensor  # [n] int64
    metadata: AttentionMetadata
