"""Rejected drafts leave no trace: a block filled by drafts is never published in the prefix
cache, their blocks go back to the pool, and accepted drafts are published once verified."""

from __future__ import annotations

from kvgate.engine.core.block_hash import block_hashes
from kvgate.engine.core.scheduler import Scheduler
from kvgate.engine.spec_decode.config import SpeculativeConfig
from kvgate.engine.spec_decode.speculator import Drafted, Speculator
from kvgate.engine.spec_decode.verify import SampledToken
from tests.engine.scheduling_helpers import ROOT, make_request, make_scheduler

BLOCK = 16


class FixedDrafts(Speculator):
    """Proposes ``drafts`` to every decode."""

    def __init__(self, drafts: list[int]):
        super().__init__(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 16}))
        self.drafts = drafts

    def propose(self, request: Drafted, budget: int) -> list[int]:
        return self.drafts[:budget]


def _scheduler(drafts: list[int]) -> Scheduler:
    scheduler = make_scheduler(num_blocks=16)
    scheduler.speculator = FixedDrafts(drafts)
    return scheduler


def _published(scheduler: Scheduler) -> set[bytes]:
    return set(scheduler.kv.pool.by_hash)


def test_a_block_of_rejected_drafts_is_never_published_and_goes_back() -> None:
    drafts = list(range(500, 515))  # with the last token they fill block 1 exactly
    scheduler = _scheduler(drafts)
    request = make_request(list(range(100, 100 + BLOCK)), max_tokens=40)
    scheduler.add(request)
    batch = scheduler.schedule()  # the prompt: block 0
    scheduler.update(batch, [(7, None)])
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1 + len(drafts)] and len(request.block_table) == 2
    scheduler.kv.pool.check_invariants()
    scheduler.update(batch, [(9, None)], accepted=[[]])  # every draft rejected; 9 instead
    assert request.token_ids[BLOCK:] == [7, 9] and request.num_computed == BLOCK + 1
    drafted = block_hashes([*request.prompt_token_ids, 7, *drafts], ROOT)
    assert drafted[1] not in _published(scheduler)
    assert _published(scheduler) == {drafted[0]}
    assert len(request.block_table) == 2  # the block the kept tokens still need
    spec = scheduler.meter.stats.spec
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (1, 15, 0)
    scheduler.kv.pool.check_invariants()


def test_accepted_drafts_are_published_when_verified_and_spare_blocks_trimmed() -> None:
    drafts = list(range(600, 631))  # two blocks' worth past the last token
    scheduler = _scheduler(drafts)
    request = make_request(list(range(100, 100 + BLOCK)), max_tokens=60)
    scheduler.add(request)
    scheduler.update(scheduler.schedule(), [(7, None)])
    batch = scheduler.schedule()
    assert len(request.block_table) == 3
    kept: list[SampledToken] = [(t, None) for t in drafts[:20]]
    scheduler.update(batch, [(8, None)], accepted=[kept])
    assert request.token_ids[BLOCK:] == [7, *drafts[:20], 8]
    assert len(request.block_table) == 3  # 38 tokens: blocks 0-2, none spare
    scheduler.speculator = None
    scheduler.update(scheduler.schedule(), [(9, None)])  # verified: block 1 published now
    assert block_hashes(request.token_ids, ROOT)[1] in _published(scheduler)
    assert scheduler.meter.stats.spec.accepted_tokens == 20
    scheduler.kv.pool.check_invariants()


def test_rejected_drafts_free_their_blocks() -> None:
    scheduler = _scheduler(list(range(700, 740)))
    request = make_request(list(range(100, 100 + BLOCK)), max_tokens=60)
    scheduler.add(request)
    scheduler.update(scheduler.schedule(), [(7, None)])
    batch = scheduler.schedule()
    assert len(request.block_table) == 4
    scheduler.update(batch, [(8, None)], accepted=[[]])
    assert len(request.block_table) == 2
    assert scheduler.kv.pool.num_in_use() == 2
