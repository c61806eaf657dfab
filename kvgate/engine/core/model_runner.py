"""Runs one scheduled step: flatten the batch into an explicit AttentionMetadata, run the
model over the paged cache, sample the requests whose last token was computed, and pool the
embedding requests' last rows (the final normalized hidden state, before ``lm_head``).

    batch:  req A computes tokens 32..39 (prefill chunk), req B computes token 70 (decode)
    input_ids / positions / slot_mapping: 9 rows, A's 8 then B's 1
    query_start_loc [0, 8, 9]   seq_lens [40, 71]
    outputs: row 8, and row 7 if the chunk ends A's prompt (the last layer computes no other)

A decode verifying K drafts (``Request.spec_token_ids``) runs K + 1 rows, its last token and
the drafts; every one of them is an output row, and the step's result carries the drafts it
accepted (``kvgate.engine.spec_decode.verify``). Where every request of the step is such a
decode (no prefill chunk, no adapter, no pooling), each token is a row of its own, as in a
step of plain decodes: its sequence length is its position + 1 and its block table its
request's. A layer writes every row's K/V before any row attends, so a draft sees the K/V of
the tokens before it, and the decode stack serves the step: each token's logits are the
ones a plain decode at its position would give, from one read of the weights for all rows.

Everything the layers need travels in the metadata object; nothing is module-global.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvgate.engine.attention.backend import AttentionBackend
from kvgate.engine.attention.kv_cache import KVCache
from kvgate.engine.attention.metadata import AttentionMetadata, OutputRows
from kvgate.engine.core.scheduler import ScheduledBatch
from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.lora_layers import Stacks, StepLoRA
from kvgate.engine.sampling.sampler import argmax, plain_greedy, sample
from kvgate.engine.spec_decode.verify import SampledToken, accept_greedy, verify


class StepResult(NamedTuple):
    sampled: list[SampledToken]  # one per request in ``batch.sampling`` order
    pooled: list[list[float]]  # one L2-normalized fp32 vector per request in ``batch.pooling``
    # Per request in ``batch.sampling`` order, the drafts it accepted before ``sampled``'s token
    # (empty where the step verified none).
    accepted: Sequence[list[SampledToken]] = ()


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
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
        if isinstance(model, LlamaForCausalLM):  # its decode stack (and kernels) built now:
            model.decode_stack_for(kv_caches, backend)  # not in the first request's decode

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run the step: a token for each sampling request, a vector for each pooling one."""
        sampling, pooling = batch.sampling, batch.pooling
        input_ids, metadata = self.prepare(batch, self._decodes_only(batch))
        outputs, pooled_rows = self.output_rows(batch, metadata)
        sampled: list[SampledToken] = []
        pooled: list[list[float]] = []
        adapters = [request.lora for request in batch.requests]
        lora = StepLoRA.of(adapters, batch.num_new_tokens, self.lora_stacks, self.device)
        with torch.inference_mode():
            hidden = self.model(
                input_ids, metadata.positions, self.kv_caches, metadata, self.backend, lora, outputs
            )
            if pooling:  # last-token pooling, L2-normalized in fp32 (vLLM's default for embed)
                is_pooled = torch.tensor(pooled_rows, dtype=torch.bool, device=self.device)
                pooled = F.normalize(hidden[is_pooled].float(), dim=-1).tolist()
                hidden = hidden[~is_pooled]
            if any(request.spec_token_ids for request in sampling):
                return self._verify(hidden, batch, pooled)
            if sampling:
                rows = hidden
                if self.model.config.final_softcap is None and plain_greedy(sampling):
                    # The argmax of the lm_head's own output: no fp32 copy of the logits.
                    tokens = argmax(self.model.compute_logits(rows, raw=True)).tolist()
                    sampled = [(token, None) for token in tokens]
                else:
                    result = sample(self.model.compute_logits(rows), sampling)
                    sampled = list(zip(result.token_ids, result.logprobs, strict=True))
        return StepResult(sampled, pooled)

    def _verify(
        self, rows: torch.Tensor, batch: ScheduledBatch, pooled: list[list[float]]
    ) -> StepResult:
        """The step's tokens where some requests verify drafts: ``rows`` holds 1 + K rows
        for each sampling request (K its drafts)."""
        sampling = batch.sampling
        drafts = [request.spec_token_ids for request in sampling]
        kept: list[list[SampledToken]]
        if self.model.config.final_softcap is None and plain_greedy(sampling):
            chosen = argmax(self.model.compute_logits(rows, raw=True)).tolist()
            kept = [[(t, None) for t in ts] for ts in accept_greedy(chosen, drafts)]
        else:
            kept = verify(self.model.compute_logits(rows), sampling, drafts)
        return StepResult([k[-1] for k in kept], pooled, [k[:-1] for k in kept])

    @staticmethod
    def _decodes_only(batch: ScheduledBatch) -> bool:
        """Whether the step is decodes alone, some verifying drafts: then each token is run
        as a row of its own (see the module's docstring)."""
        requests = batch.requests
        return (
            len(batch.sampling) == len(requests)
            and any(request.spec_token_ids for request in requests)
            and all(request.lora is None for request in requests)
            and all(
                n == 1 + len(request.spec_token_ids)
                for request, n in zip(requests, batch.num_new_tokens, strict=True)
            )
        )

    def prepare(
        self, batch: ScheduledBatch, row_per_token: bool = False
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's token ids and metadata, built from plain lists with one tensor each;
        ``row_per_token``: every token a query row of its own (a step of decodes alone)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables = []
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            start, end = request.num_computed, request.num_computed + n
            table = request.block_table
            tokens += request.token_ids[start:end]
            tokens += request.spec_token_ids  # a decode's drafts follow its last token
            positions += range(start, end)
            # A cached block's tokens keep their K/V (-1: not written; see KVCacheManager).
            slots += [
                table[p // bs] * bs + p % bs if p >= request.num_cached else -1
                for p in range(start, end)
            ]
            if row_per_token:
                starts += range(starts[-1] + 1, starts[-1] + n + 1)
                seq_lens += range(start + 1, end + 1)
                tables += [table] * n
            else:
                starts.append(starts[-1] + n)
                seq_lens.append(end)
                tables.append(table)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        device = self.device
        metadata = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=1 if row_per_token else max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(tokens, dtype=torch.int64, device=device), metadata

    def output_rows(
        self, batch: ScheduledBatch, metadata: AttentionMetadata
    ) -> tuple[OutputRows | None, list[bool]]:
        """The rows the step samples or pools, in batch order, for the model to compute alone
        past its last K/V write (None: every row, as in a step of decodes), and which of them
        are pooled."""
        chosen = {id(request) for request in batch.sampling + batch.pooling}
        seqs: list[int] = []
        rows: list[int] = []
        counts: list[int] = []
        pooled: list[bool] = []
        end, max_len = 0, 1
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
            end += n
            if id(request) in chosen:
                count = 1 + len(request.spec_token_ids)
                seqs.append(i)
                rows += range(end - count, end)
                counts.append(count)
                pooled += [request.pooling] * count
                max_len = max(max_len, request.num_computed + n)
        if len(rows) == end:
            return None, pooled
        device = self.device
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        spans = counts if len(rows) > len(seqs) else None  # drafts: several rows a sequence
        last = metadata.last_queries(index, max_len, spans)
        return OutputRows(torch.tensor(rows, dtype=torch.int64, device=device), last), pooled
