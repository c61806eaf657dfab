"""Server settings: one frozen dataclass, filled from defaults, then ``KVGATE_*``, then flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

ENV_PREFIX = "KVGATE_"
LISTS = ("allowed_origins", "upstream", "upstream_dns")  # comma lists in the environment


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None  # a Hugging Face folder; None = the embedded tiny model
    served_model_name: str | None = (
        None  # the id OpenAI clients pass as `model` (default: the model's)
    )
    max_model_len: int = 0  # 0 = the model's own context length
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral; None = from the template
    dtype: str = "auto"  # auto: bf16 where the CPU computes it natively (or on GPU), else fp32
    threads: int = 0  # CPU compute threads; 0 = all usable cores but one for the event loop (> 2)
    max_num_seqs: int = 64  # running requests per replica
    max_num_batched_tokens: int = 2048  # tokens computed per replica step (prefill chunk budget)
    replicas: int = 1
    routing: str = "prefix"  # prefix | round_robin | random: engine replicas and upstreams alike
    kv_cache_dtype: str = "auto"
    kv_cache_memory: str | None = None  # bytes or "256MiB"; None = a share of free memory
    redis_url: str | None = None
    allowed_origins: tuple[str, ...] = ()  # beyond localhost, which is always allowed
    max_body_bytes: int = 1 << 20
    catalog_ttl_ms: int = 3_600_000
    keepalive_s: float = 15.0  # SSE comment interval on subscriptions/listen
    listen_max_s: float = 3600.0  # a listen stream ends (gracefully) after this long
    server_name: str = "kvgate"
    catalog_config: str | None = (
        None  # JSON file: instructions, resources, prompts (re-read on SIGHUP)
    )
    admin_api_key: str | None = None  # enables /admin/* for "Authorization: Bearer <key>"
    # Authentication (gateway.auth): off unless keys or an OAuth issuer are configured.
    api_key: str | None = None  # one key for tenant "default" (like vLLM's --api-key)
    api_keys_file: str | None = None  # "tenant: sha256-hex-of-key" lines, re-read on SIGHUP
    oauth_issuer: str | None = None  # accept JWT access tokens from this authorization server
    oauth_jwks_url: str | None = None  # its signing keys
    oauth_resource: str | None = None  # this server's canonical URI: the audience tokens name
    oauth_tenant_claim: str = "sub"  # the claim naming the tenant
    oauth_leeway_s: float = 30.0  # clock skew allowed on exp/nbf
    oauth_jwks_min_refresh_s: float = 10.0  # an unknown kid re-fetches the JWKS at most this often
    oauth_inference_scope: str = "kvgate:infer"  # tools/call, completions, tokenize
    oauth_admin_scope: str = "kvgate:admin"  # /admin/*
    # Per-tenant budgets (authenticated tenants only), shared through redis_url when set.
    budget_requests_per_min: int = 0  # inference calls per tenant per minute; 0 = off
    budget_tokens_per_min: int = 0  # prompt + completion tokens per tenant per minute; 0 = off
    budget_processes: int = 1  # gateway processes: each enforces budget/N while Redis is down
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight requests may still run
    log_format: str = "text"  # text | json
    # Admission and abuse limits (0 = off where it says so).
    max_waiting: int = 256  # engine requests waiting per replica; beyond -> 503 + Retry-After
    max_prompt_tokens: int = 0  # 0 = only the context length bounds a prompt
    max_tokens_limit: int = 0  # largest max_tokens a call may ask for; 0 = the context length
    max_concurrency_per_client: int = 0  # calls in flight per API key or cache_key; 0 = off
    request_timeout_s: float = 300.0  # a tools/call deadline (a call's _meta may shorten it)
    step_timeout_s: float = 120.0  # an engine step running longer marks its replica unready
    body_timeout_s: float = 30.0  # the whole request body must arrive within this
    header_timeout_s: float = 30.0  # the request line and headers must arrive within this
    max_header_bytes: int = 32 * 1024  # request line plus headers; beyond -> 431
    max_json_depth: int = 64  # nesting of arrays/objects in a body; beyond -> -32600
    max_listen_streams: int = 1024  # open subscriptions/listen streams; beyond -> 503
    # Fleet mode: upstream engine servers (vLLM, SGLang, kvgate) instead of an embedded engine.
    upstream: tuple[str, ...] = ()  # base URLs; KVGATE_UPSTREAM takes a comma list
    upstream_dns: tuple[str, ...] = ()  # HOST:PORT names resolving to many upstreams
    upstream_refresh_s: float = 10.0  # re-resolve the upstream_dns names this often
    upstream_scrape_interval_s: float = 2.0  # read each upstream's /metrics load; 0 = off
    tokenizer: str | None = None  # a tokenizer folder for token-aligned prefix hashes
    upstream_health_path: str = "/health"  # vLLM's and kvgate's liveness path
    upstream_health_interval_s: float = 2.0  # active checks; 0 = passive only
    upstream_health_timeout_s: float = 1.0
    upstream_unhealthy_after: int = 2  # consecutive failures (passive or active) open the breaker
    upstream_healthy_after: int = 1  # consecutive successful checks close it again
    upstream_cooldown_s: float = 5.0  # an open breaker lets one trial call through after this
    upstream_connect_timeout_s: float = 2.0
    upstream_read_timeout_s: float = 60.0  # the longest silence between stream chunks
    instructions: str = field(
        default=(
            "LLM inference as tools: `generate` continues a prompt, `chat` answers a "
            "conversation, `tokenize` counts tokens. Pass the same `cache_key` for calls that "
            "share a prefix so they reuse its KV cache."
        )
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults, then ``KVGATE_<FIELD>`` variables, then non-None ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in fields(cls):
            raw = environ.get(ENV_PREFIX + spec.name.upper())
            if raw is not None and raw != "":
                values[spec.name] = _convert(spec.name, raw, cls)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name in LISTS:
            if isinstance(values.get(name), str):
                values[name] = _split(values[name])
            elif isinstance(values.get(name), list):
                values[name] = tuple(part.rstrip("/") for part in values[name])
        return cls(**values)


def _convert(name: str, raw: str, cls: type[Settings]) -> Any:
    default = cls.__dataclass_fields__[name].default
    if name in LISTS:
        return _split(raw)
    if isinstance(default, bool):
        return raw.lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw


def _split(raw: str) -> tuple[str, ...]:
    return tuple(part.strip().rstrip("/") for part in raw.split(",") if part.strip())
