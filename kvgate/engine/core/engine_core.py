"""What LLM and AsyncLLM share: the loaded model, one KV cache and BlockPool, N replicas,
request validation and the replica choice.

    EngineCore ── model weights (shared, read-only)
        ├── KV caches + BlockPool (shared; fair share per replica)
        └── Replica i: Scheduler ── KVCacheManager(pool, i) ; ModelRunner(model, caches)
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterable

import torch

from kvgate.engine.attention.backend import get_attention_backend
from kvgate.engine.attention.kv_cache import (
    allocate_kv_caches,
    cache_scheme,
    kv_bytes_per_token,
    resolve_cache_dtype,
)
from kvgate.engine.config import (
    TINY_MODEL,
    EngineConfig,
    apply_threads,
    choose_dtype,
    choose_kv_cache_dtype,
    free_memory_bytes,
    log_dtype_choice,
    log_threads,
)
from kvgate.engine.core.block_hash import BLOCK_SIZE, block_hashes, root_hash
from kvgate.engine.core.block_pool import BlockPool
from kvgate.engine.core.kv_cache_manager import KVCacheManager
from kvgate.engine.core.model_runner import ModelRunner
from kvgate.engine.core.prompt_rules import Limits, Prompt, PromptRules
from kvgate.engine.core.replica import OutputSink, Replica
from kvgate.engine.core.request import Request
from kvgate.engine.core.router import make_router
from kvgate.engine.core.scheduler import Scheduler
from kvgate.engine.core.serving_stats import ServingMeter, ServingStats
from kvgate.engine.errors import (
    AdapterError,
    EngineOverloaded,
    EngineUnavailable,
    InvalidArgument,
)
from kvgate.engine.loading.model_source import load_model_at, resolve_model
from kvgate.engine.loading.tiny_model import default_model_dir
from kvgate.engine.models.lora import LoRAAdapter, LoRARegistry, load_adapter
from kvgate.engine.sampling.structured import GrammarCache
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode.config import SpeculativeConfig
from kvgate.engine.spec_decode.speculator import Speculator
from kvgate.engine.stats import EngineStats

MAX_SALT_ROOTS = 1024  # memoised tenant-salt roots (LRU)


PhaseSink = Callable[[str, str], None]  # (short name, what it does): the steps of a start


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        on_output: OutputSink | None = None,
        on_phase: PhaseSink | None = None,
    ):
        """``on_phase`` hears each slow step as it begins (a server's start reports them)."""
        self.config = config
        self.device = _resolve_device(config.device)
        on_phase = on_phase or (lambda name, what: None)
        if config.model is None:
            path = default_model_dir()
        else:
            path = resolve_model(config.model, config.revision)
        on_phase("model", f"loading model {config.model or TINY_MODEL} ({path.name})")
        threads = apply_threads(config.threads) if self.device.type == "cpu" else None
        dtype = choose_dtype(config.dtype, self.device.type)
        loaded = load_model_at(
            path, dtype.name, self.device, config.max_model_len, config.gguf_dequantize
        )
        if threads is not None:
            log_threads(threads)
        log_dtype_choice("dtype", dtype)
        self.model, self.model_config = loaded.model, loaded.config
        self.tokenizer, self.model_id = loaded.tokenizer, loaded.model_id
        self.dtype = loaded.dtype
        self.loras = LoRARegistry()
        self.admission_rejections = 0  # requests refused for a full waiting queue
        self._rejections_lock = threading.Lock()
        self.model_name = path.name if config.model in (None, TINY_MODEL) else config.model
        mc = self.model_config
        kv_dtype = choose_kv_cache_dtype(config.kv_cache_dtype, str(loaded.dtype), self.device.type)
        log_dtype_choice("kv_cache_dtype", kv_dtype)
        self.cache_dtype = resolve_cache_dtype(kv_dtype.name, loaded.dtype)
        self.cache_scheme = cache_scheme(self.cache_dtype)
        self.pool = BlockPool(self._num_blocks(), config.replicas)
        on_phase("kv cache", f"allocating the KV cache ({self.pool.num_blocks} blocks)")
        self.kv_caches = allocate_kv_caches(
            mc.num_layers,
            self.pool.num_blocks,
            mc.num_kv_heads,
            BLOCK_SIZE,
            mc.head_dim,
            self.cache_dtype,
            self.device,
        )
        reserve = config.free_block_reserve
        if reserve is None:
            reserve = max(1, self.pool.share // 50)
        # One request may hold at most its replica's share (less the admission reserve, so it
        # can always be admitted) and the conversation share of the pool.
        per_request = min(
            self.pool.share - reserve,
            int(config.conversation_cache_share * self.pool.share * config.replicas),
        )
        self.max_model_len = min(
            config.max_model_len or mc.max_model_len, mc.max_model_len, per_request * BLOCK_SIZE
        )
        if self.max_model_len < 2:
            raise ValueError("kv_cache_memory is too small to hold one request of 2 tokens")
        backend = get_attention_backend(config.attention_backend, self.device)
        runner = ModelRunner(self.model, self.kv_caches, backend, BLOCK_SIZE, self.device)
        spec = config.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # parsed by EngineConfig
        num_spec = 0 if spec is None else spec.num_speculative_tokens
        self.replicas = [
            Replica(
                i,
                Scheduler(
                    KVCacheManager(self.pool, i, BLOCK_SIZE, config.enable_prefix_caching),
                    config.max_num_seqs,
                    config.max_num_batched_tokens,
                    reserve,
                    ServingMeter(self.max_model_len, num_spec),
                    config.max_loras,
                    None if spec is None else Speculator(spec),  # one each: a step thread's own
                ),
                runner,
                on_output,
                config.step_timeout_s,
            )
            for i in range(config.replicas)
        ]
        self.router = (
            make_router(
                config.routing, config.replicas, config.seed, prefilling=_PendingView(self.pool)
            )
            if config.replicas > 1
            else None
        )
        self._roots = functools.lru_cache(maxsize=MAX_SALT_ROOTS)(
            functools.partial(root_hash, self.model_id, self.cache_scheme, BLOCK_SIZE)
        )  # thread-safe LRU
        self._counter = itertools.count()
        self.limits = Limits(mc.vocab_size, self.max_model_len, config.max_prompt_tokens)
        self.prompts = PromptRules(self.tokenizer, self.limits)
        self.grammars = GrammarCache(
            self.tokenizer,
            mc.vocab_size,
            sorted(set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)),
            max_bytes=int(config.grammar_cache_bytes),
            max_spec_bytes=int(config.max_grammar_bytes),
        )

    def _num_blocks(self) -> int:
        mc, config = self.model_config, self.config
        per_block = BLOCK_SIZE * kv_bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, self.cache_dtype
        )
        if config.kv_cache_memory is not None:
            return int(config.kv_cache_memory) // per_block + 1  # + the null block
        budget = int(config.kv_cache_memory_fraction * free_memory_bytes(self.device.type))
        # Twice every slot of every replica at full length: the rest of the budget stays free.
        useful = (
            2 * config.replicas * config.max_num_seqs * math.ceil(mc.max_model_len / BLOCK_SIZE)
        )
        return min(budget // per_block, useful) + 1

    def hash_root(self, salt: str | None = None, adapter: LoRAAdapter | None = None) -> bytes:
        """The block-hash root for a tenant salt and LoRA adapter, memoised for the
        ``MAX_SALT_ROOTS`` most recent pairs (callers choose salts freely, so the memo must
        not grow with them)."""
        return self._roots(salt, None if adapter is None else adapter.identity)

    def add_lora(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        """Load the PEFT adapter at ``path`` as ``name`` (``AdapterError`` if it cannot be
        served; ``replace`` swaps an adapter of that name, running requests keep the old)."""
        if not self.config.enable_lora:
            raise AdapterError("LoRA adapters are not enabled on this engine (enable_lora)")
        adapter = load_adapter(
            name, path, self.model_config, self.config.max_lora_rank, self.dtype, self.device
        )
        self.loras.add(adapter, replace)
        return adapter

    def remove_lora(self, name: str) -> bool:
        """Forget ``name`` (False if it was not loaded); its running requests finish with it."""
        return self.loras.remove(name)

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        cache_key: str | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Validate and build a request; raises ValueError naming the bad field
        (``lora.UnknownAdapter`` for a ``lora_name`` not loaded)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        adapter = None if lora_name is None else self.loras.get(lora_name)
        limit = self.config.max_tokens_limit
        if limit is not None and params.max_tokens > limit:
            raise InvalidArgument(
                f"max_tokens: at most {limit} on this server, got {params.max_tokens}", "max_tokens"
            )
        vocab = self.model_config.vocab_size
        if params.logit_bias and (bad := [t for t in params.logit_bias if t >= vocab]):
            raise InvalidArgument(
                f"logit_bias: token id {min(bad)} is out of vocabulary (size {vocab})",
                "logit_bias",
            )
        token_ids = self.prompts.checked_prompt(prompt)
        grammar = (
            None
            if params.structured_outputs is None
            else self.grammars.state(params.structured_outputs)
        )
        arrival = next(self._counter)
        generator = None
        if not params.greedy:
            seed = (
                params.seed if params.seed is not None else self.config.seed * 1_000_003 + arrival
            )
            generator = torch.Generator(device=self.device).manual_seed(seed)
        root = self.hash_root(cache_salt, adapter)
        return Request(
            request_id=f"req-{arrival}",
            prompt_token_ids=token_ids,
            params=params,
            arrival=arrival,
            hash_root=root,
            block_hashes=block_hashes(token_ids, root, BLOCK_SIZE),
            eos_token_ids=frozenset(self.model_config.eos_token_ids)
            | frozenset(self.tokenizer.eos_token_ids),
            max_model_len=self.max_model_len,
            generator=generator,
            cache_key=cache_key,
            grammar=grammar,
            lora=adapter,
            cache_salt=cache_salt,
        )

    def make_embedding_request(
        self, prompt: Prompt, cache_key: str | None = None, cache_salt: str | None = None
    ) -> Request:
        """An embedding request (``Request.pooling``): its prompt, up to ``max_embedding_len``
        tokens, is prefilled and its last token's final hidden state comes back instead of a
        sampled token. Raises ValueError (``TooManyTokens`` with vLLM's wording) if bad."""
        token_ids = self.embedding_ids(prompt)
        arrival = next(self._counter)
        root = self.hash_root(cache_salt)
        return Request(
            request_id=f"embd-{arrival}",
            prompt_token_ids=token_ids,
            params=SamplingParams(max_tokens=1),  # never read: a pooling request is not sampled
            arrival=arrival,
            hash_root=root,
            block_hashes=block_hashes(token_ids, root, BLOCK_SIZE),
            eos_token_ids=frozenset(),
            max_model_len=self.max_model_len,
            cache_key=cache_key,
            pooling=True,
        )

    def embedding_ids(self, prompt: Prompt) -> list[int]:
        """An embedding input's token ids, checked (``PromptRules.embedding_ids``)."""
        return self.prompts.embedding_ids(prompt)

    @property
    def max_embedding_len(self) -> int:
        """The most tokens an embedding input may have: nothing is generated after it."""
        return self.prompts.limits.max_embedding_len

    @property
    def max_prompt_len(self) -> int:
        """The most prompt tokens a request may have (one more must fit in max_model_len)."""
        return self.prompts.limits.max_prompt_len

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids; one whose length alone shows it cannot fit is refused
        (``TooManyTokens``, a ValueError) without tokenizing it."""
        return self.prompts.encode_prompt(text, add_special_tokens)

    def choose_replica(self, request: Request, available: list[bool] | None = None) -> Replica:
        """The replica for a request: the configured router's choice (prefix hash with
        bounded load by default) among the ``available`` ones (default: those stepping)."""
        if self.router is None:
            return self.replicas[0]
        loads = [r.load for r in self.replicas]
        if available is None:
            available = [r.available for r in self.replicas]
        index = self.router.choose(
            request.block_hashes,
            request.cache_key,
            request.num_prompt_tokens,
            loads,
            available,
        )
        return self.replicas[index]

    def admit(self, request: Request) -> Replica:
        """The replica for a request, among those that are available and whose waiting queue
        has room (``max_waiting`` each); raises AdmissionRefused when there is none."""
        live = [r.available for r in self.replicas]
        if not any(live):
            raise EngineUnavailable(f"all {len(live)} engine replicas are stalled or failed")
        room = [
            ok and r.num_waiting < self.config.max_waiting
            for ok, r in zip(live, self.replicas, strict=True)
        ]
        if not any(room):
            with self._rejections_lock:
                self.admission_rejections += 1
            raise EngineOverloaded(
                f"the engine is at capacity ({self.config.max_waiting} waiting per replica)"
            )
        return self.choose_replica(request, room)

    def stats(self) -> EngineStats:
        per_replica = [r.stats() for r in self.replicas]
        return EngineStats(
            num_running=sum(s.num_running for s in per_replica),
            num_waiting=sum(s.num_waiting for s in per_replica),
            kv_usage=self.pool.num_in_use() / (self.pool.num_blocks - 1),
            prefix_queries=sum(s.prefix_queries for s in per_replica),
            prefix_hits=sum(s.prefix_hits for s in per_replica),
            num_cached_blocks=self.pool.num_cached(),
            block_size=BLOCK_SIZE,
            num_blocks=self.pool.num_blocks,
            cache_dtype=str(self.cache_dtype).removeprefix("torch."),
            enable_prefix_caching=self.config.enable_prefix_caching,
            per_replica=per_replica,
            grammar_cache_bytes=self.grammars.resident_bytes,
            grammar_cache_limit_bytes=self.grammars.max_bytes,
            grammar_cache_entries=len(self.grammars),
            max_grammar_bytes=self.grammars.max_spec_bytes,
            serving=ServingStats.total(r.scheduler.meter.snapshot() for r in self.replicas),
            admission_rejections=self.admission_rejections,
            max_loras=self.config.max_loras if self.config.enable_lora else None,
            running_adapters=_adapters(r.scheduler.running for r in self.replicas),
            waiting_adapters=_adapters(r.scheduler.waiting for r in self.replicas),
        )


def _adapters(queues: Iterable[list[Request]]) -> tuple[str, ...]:
    """The LoRA adapters of the requests in ``queues`` (read off the step threads: a list
    being changed meanwhile may be read short), by name."""
    return tuple(sorted({r.lora.name for q in queues for r in list(q) if r.lora is not None}))


class _PendingView:
    """``.get(block_hash)`` -> the replica prefilling that block now (what the router reads)."""

    def __init__(self, pool: BlockPool):
        self._pool = pool

    def get(self, block_hash: bytes, default: int | None = None, /) -> int | None:
        owner = self._pool.pending_owner(block_hash)
        return default if owner is None else owner


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
