"""Runs one scheduled step: flatten the batch into an explicit AttentionMetadata, run the
model over the paged cache, sample the requests whose last token was computed.

    batch:  req A computes tokens 32..39 (prefill chunk), req B computes token 70 (decode)
    input_ids / positions / slot_mapping: 9 rows, A's 8 then B's 1
    query_start_loc [0, 8, 9]   seq_lens [40, 71]   logits_indices: rows of sampled requests

Everything the layers need travels in the metadata object; nothing is module-global.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata
from engine.models.lora_layers import Stacks, StepLoRA
from engine.sampler import sample
from engine.scheduler import ScheduledBatch

SampledToken = tuple[int, dict[int, float] | None]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.lora_stacks = Stacks()  # LoRA weights stacked per set of adapters in a step

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        """Run the step; one (token id, logprobs) per request in ``batch.sampling`` order."""
        sampling = batch.sampling
        input_ids, metadata = self.prepare(batch, sampling)
        adapters = [request.lora for request in batch.requests]
        lora = StepLoRA.of(adapters, batch.num_new_tokens, self.lora_stacks, self.device)
        with torch.inference_mode():
            hidden = self.model(
                input_ids, metadata.positions, self.kv_caches, metadata, self.backend, lora
            )
            if not sampling:
                return []
            logits = self.model.compute_logits(hidden.index_select(0, metadata.logits_indices))
            result = sample(logits, sampling)
        return list(zip(result.token_ids, result.logprobs, strict=True))

    def prepare(
        self, batch: ScheduledBatch, sampling: list
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's token ids and metadata, built from plain lists with one tensor each."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        tables = []
        sampled = set(map(id, sampling))
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start, end = request.num_computed, request.num_computed + n
            table = request.block_table
            tokens += request.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if id(request) in sampled:
                logits_rows.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        device = self.device
        metadata = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(tokens, dtype=torch.int64, device=device), metadata
