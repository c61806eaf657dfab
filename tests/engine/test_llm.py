"""End-to-end tests of the offline API against transformers and against itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from kvgate.engine import LLM, EngineStepError, SamplingParams
from kvgate.engine.core.block_hash import BLOCK_SIZE, block_hashes, root_hash
from kvgate.engine.core.engine_core import MAX_SALT_ROOTS
from tests.engine.sampling.test_sampler import valid_params

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Token-id prompts of different lengths: within a block, across blocks, exactly two blocks.
PROMPTS = [
    [5, 9, 42],
    list(range(100, 117)),
    [(7 * i) % 900 + 20 for i in range(32)],
    [(13 * i) % 800 + 30 for i in range(45)],
]


def hf_greedy(
    path: Path, prompt: list[int], n: int, repetition: float = 1.0, presence: float = 0.0
) -> list[int]:
    """The reference: transformers' forward over the whole sequence, argmax, n times; with
    transformers' repetition penalty, then OpenAI's presence penalty, when asked."""
    model = (
        _HF_MODELS.get(path)
        or AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    )
    _HF_MODELS[path] = model
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[:, -1]
            logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), logits)
            logits[0, list(set(ids[len(prompt) :]))] -= presence
            ids.append(int(logits[0].argmax()))
    return ids[len(prompt) :]


_HF_MODELS: dict[Path, torch.nn.Module] = {}


def assert_no_leaks(llm: LLM) -> None:
    """Every block is free or evictable and the bookkeeping is consistent."""
    llm.core.pool.check_invariants()
    assert llm.core.pool.num_in_use() == 0
    assert not any(r.has_work() for r in llm.core.replicas)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[LLM]:
    yield LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")


@pytest.fixture(autouse=True)
def _blocks_are_released(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "llm" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("llm"))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_matches_transformers_batched_and_again_from_the_prefix_cache(
    arch: str, hf_checkpoint
):
    path = hf_checkpoint(arch)
    engine = LLM(str(path), dtype="float32", kv_cache_memory="2MiB")
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    first = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == expected
    assert [o.cached_tokens for o in first] == [0, 0, 0, 0]
    second = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in second] == expected
    # A prompt of whole cached blocks computes its last token alone (31 of 32 cached).
    assert [o.cached_tokens for o in second] == [0, 16, 31, 32]
    assert_no_leaks(engine)


def test_a_fully_cached_prompt_writes_nothing_into_its_shared_blocks(tiny_model_dir: Path):
    engine = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="2MiB")
    whole_blocks = PROMPTS[2]  # 32 tokens: the cached blocks hold its last token's K/V too
    params = SamplingParams(max_tokens=1, temperature=0)
    cold = engine.generate([whole_blocks], params)[0].token_ids
    caches = engine.core.replicas[0].runner.kv_caches
    for cache in caches:  # a marker in every row: any write by the cached run would show
        cache.k.fill_(0.25)
        cache.v.fill_(-0.25)
    again = engine.generate([whole_blocks], params)[0]
    assert again.cached_tokens == 31 and len(again.token_ids) == len(cold) == 1
    assert all(bool((c.k == 0.25).all() and (c.v == -0.25).all()) for c in caches)
    assert_no_leaks(engine)


def test_chunked_prefill_matches_transformers(hf_checkpoint):
    path = hf_checkpoint("llama")
    chunked = LLM(
        str(path), dtype="float32", kv_cache_memory="2MiB", max_num_seqs=4, max_num_batched_tokens=7
    )  # prompts arrive in chunks of at most 7 tokens
    outputs = chunked.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [
        hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS
    ]
    assert_no_leaks(chunked)


def test_a_prompt_alone_and_inside_a_batch_gives_the_same_tokens(llm: LLM):
    llm_params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], llm_params)[0].token_ids
    # prefix caching off for the comparison run would hide nothing: compare cold and batched
    batched = llm.generate(PROMPTS[:3] + [PROMPTS[3]] + PROMPTS[:2], llm_params)
    assert batched[3].token_ids == alone


def test_a_seed_gives_the_same_sample_whatever_the_batch(llm: LLM):
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("A seeded prompt", seeded)[0].token_ids
    others = SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True)
    batched = llm.generate(["Other", "A seeded prompt", "More"], [others, seeded, others])
    assert batched[1].token_ids == alone


def test_unseeded_sampling_is_reproducible_from_the_engine_seed(tiny_model_dir: Path):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = [
        LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB", seed=7).generate(
            ["one", "two"], params
        )
        for _ in range(2)
    ]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def test_finish_reasons_stop_strings_and_stop_token_ids(llm: LLM):
    free = llm.generate("Stop here", GREEDY)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    token = free.token_ids[2]
    by_token = llm.generate(
        "Stop here",
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[token]),
    )[0]
    first = free.token_ids.index(token)
    assert by_token.token_ids == free.token_ids[: first + 1] and by_token.finish_reason == "stop"
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    by_string = llm.generate(
        "Stop here", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert by_string.finish_reason == "stop"
    assert by_string.text == text[: text.index(stop)]


def test_logprobs_are_returned_per_token(llm: LLM):
    out = llm.generate(
        "logprobs", SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    )[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and max(entry, key=entry.get) == token and len(entry) == 3


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([1] * 5000, GREEDY, "prompt"),
        ([], GREEDY, "prompt"),
        ([10**9], GREEDY, "prompt"),
        ("hi", dict(max_tokens=0), "max_tokens"),
        ("hi", dict(temperature=-1.0), "temperature"),
        ("hi", dict(top_p=1.5), "top_p"),
        ("hi", dict(top_k=-3), "top_k"),
        ("hi", dict(logprobs=99), "logprobs"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field_before_queueing(
    llm: LLM, prompt, params, field: str
):
    with pytest.raises(ValueError, match=field):
        sampling = params if isinstance(params, SamplingParams) else SamplingParams(**params)
        llm.generate([prompt], sampling)
    assert llm.stats().num_waiting == 0


def test_preempted_requests_recompute_and_give_the_same_tokens(tiny_model_dir: Path):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[(s * 97 + i) % 900 + 10 for i in range(30)] for s in range(4)]
    roomy = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="2MiB")
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    # 8 usable blocks: four requests of 70 tokens (5 blocks each) cannot all stay resident
    tight = LLM(
        str(tiny_model_dir),
        dtype="float32",
        kv_cache_memory=8 * 16 * 1024 + 1,
        free_block_reserve=0,
        enable_prefix_caching=False,
        conversation_cache_share=1.0,
    )
    assert tight.core.pool.num_blocks == 9
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert got == expected
    assert tight.core.replicas[0].scheduler.num_preemptions > 0
    assert_no_leaks(tight)


def test_many_requests_through_few_slots_all_finish_in_order(tiny_model_dir: Path):
    small = LLM(
        str(tiny_model_dir),
        dtype="float32",
        kv_cache_memory="1MiB",
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )
    prompts = [[i + 3] * (5 + 7 * i) for i in range(8)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = small.generate(prompts, params)
    alone = [small.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in outputs] == alone
    assert all(o.finish_reason == "length" for o in outputs)
    assert_no_leaks(small)


def test_abort_frees_the_request_blocks_at_the_next_step(llm: LLM):
    replica = llm.core.replicas[0]
    request = llm.core.make_request(
        list(range(40, 90)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    )
    replica.submit(request)
    replica.step()
    replica.step()
    assert llm.core.pool.num_in_use() > 0
    replica.abort(request)
    replica.step()
    assert request.finished and llm.core.pool.num_in_use() == 0


def test_chat_applies_the_template(llm: LLM):
    messages = [{"role": "user", "content": "Hello!"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(messages)
    both = llm.chat([messages, messages + [{"role": "assistant", "content": "Hi"}]])
    assert len(both) == 2


def test_prefix_caching_can_be_turned_off(tiny_model_dir: Path):
    off = LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB", enable_prefix_caching=False
    )
    prompt = list(range(200, 260))
    outs = [off.generate([prompt], GREEDY)[0] for _ in range(2)]
    assert outs[1].cached_tokens == 0 and outs[0].token_ids == outs[1].token_ids
    assert off.core.pool.num_cached() == 0


def test_fp8_kv_cache_generates_close_to_the_fp32_cache(tiny_model_dir: Path, llm: LLM):
    fp8 = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="fp8", kv_cache_memory="1MiB")
    assert fp8.stats().cache_dtype == "float8_e4m3fn"
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    quantized = fp8.generate(PROMPTS, params)
    exact = llm.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 8 for o in quantized)
    agree = sum(q.token_ids[0] == e.token_ids[0] for q, e in zip(quantized, exact, strict=True))
    assert agree >= 3  # first tokens mostly agree; fp8 is lossy
    assert_no_leaks(fp8)


def test_two_replicas_share_one_pool_and_give_the_same_tokens(tiny_model_dir: Path, llm: LLM):
    two = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="2MiB", replicas=2)
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    for _ in range(2):  # the second round hits the blocks the first one cached
        outs = two.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == expected
    assert {o.replica for o in outs} <= {0, 1}
    stats = two.stats()
    assert len(stats.per_replica) == 2 and stats.prefix_hits == 16 + 31 + 32
    assert_no_leaks(two)


def test_one_huge_prompt_cannot_evict_every_other_conversation(tiny_model_dir: Path):
    block_bytes = 16 * 1024  # tiny model, fp32: 2 layers x 2 KV heads x 32 dims x 4 B x K,V
    llm = LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_memory=32 * block_bytes, free_block_reserve=0
    )
    assert llm.core.max_model_len == 16 * 16  # one request may hold half the pool
    one = SamplingParams(max_tokens=1, temperature=0)
    conversations = [[c + 10] * 49 for c in range(8)]  # 3 cacheable blocks each
    llm.generate(conversations, one)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5] * (32 * 16 - 1)], one)  # as large as the whole cache
    llm.generate([[6] * (16 * 16 - 1)], one)  # the largest allowed: evicts some, not all
    root = llm.core.hash_root()
    kept = [all(h in llm.core.pool.by_hash for h in block_hashes(c, root)) for c in conversations]
    assert sum(kept) >= 4
    assert llm.generate([conversations[-1]], one)[0].cached_tokens == 48
    assert_no_leaks(llm)


def test_penalized_greedy_decoding_matches_transformers(hf_checkpoint):
    path = hf_checkpoint("llama")
    engine = LLM(str(path), dtype="float32", kv_cache_memory="2MiB")
    plain = [hf_greedy(path, p, 12) for p in PROMPTS[:2]]
    expected = [hf_greedy(path, p, 12, repetition=1.8, presence=1.5) for p in PROMPTS[:2]]
    assert expected != plain  # the penalties really change the tokens
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.8, presence_penalty=1.5
    )
    outs = engine.generate(PROMPTS[:2] + PROMPTS[:2], [params, params, GREEDY, GREEDY])
    assert [o.token_ids for o in outs] == expected + plain  # unpenalized neighbours unchanged
    assert_no_leaks(engine)


def test_min_tokens_holds_back_stop_token_ids_and_eos(llm: LLM):
    free = llm.generate("Stop here", GREEDY)[0].token_ids
    token = free[1]
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[token], min_tokens=5
    )
    held = llm.generate("Stop here", params)[0]
    assert held.token_ids[:1] == free[:1] and token not in held.token_ids[:5]
    assert len(held.token_ids) >= 5
    if held.finish_reason == "stop":
        assert held.token_ids.index(token) == len(held.token_ids) - 1


NEIGHBOUR = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(params=valid_params(max_tokens=st.integers(1, 8)))
def test_no_valid_arguments_of_one_request_change_a_neighbours_greedy_tokens(
    llm: LLM, params: SamplingParams
):
    prompts = [PROMPTS[1], PROMPTS[2]]
    expected = llm.generate(prompts, [NEIGHBOUR, NEIGHBOUR])[0].token_ids
    outs = llm.generate(prompts, [NEIGHBOUR, params])
    assert outs[0].token_ids == expected and outs[0].finish_reason == "length"
    assert outs[1].finish_reason in ("stop", "length")


def test_a_failing_step_raises_instead_of_returning_partial_text(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB")
    runner = llm.core.replicas[0].runner
    real, calls = runner.execute, 0

    def fail_the_third_step(batch):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(runner, "execute", fail_the_third_step)
    with pytest.raises(EngineStepError, match=r"prompts \[0, 1\]: .*injected fault"):
        llm.generate(["one", "two"], GREEDY)
    assert_no_leaks(llm)
    assert [len(o.token_ids) for o in llm.generate(["one", "two"], GREEDY)] == [12, 12]


def test_the_salt_roots_memo_is_a_bounded_lru(tiny_model_dir: Path):
    core = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB").core
    limit = MAX_SALT_ROOTS
    salts = [f"tenant-{i}" for i in range(limit + 100)]
    assert core.hash_root("kept") == root_hash(core.model_id, core.cache_scheme, BLOCK_SIZE, "kept")
    for i, salt in enumerate(salts):
        assert core.hash_root(salt) == root_hash(core.model_id, core.cache_scheme, BLOCK_SIZE, salt)
        if i % 512 == 0:
            core.hash_root("kept")  # recently used: survives the others
    info = core._roots.cache_info()
    assert info.currsize == limit
    core.hash_root("kept")
    core.hash_root(salts[0])  # the least recently used went first
    after = core._roots.cache_info()
    assert (after.hits, after.misses) == (info.hits + 1, info.misses + 1)
