"""``kvgate``: ``serve`` the MCP gateway, or ``make-tiny-model`` for tests and demos.

Every ``serve`` flag has a ``KVGATE_<NAME>`` environment twin; flags win.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from gateway.ops.logs import configure_logging
from gateway.settings import Settings

logger = logging.getLogger("kvgate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve MCP over Streamable HTTP at /mcp")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--model", help="Hugging Face model folder (default: embedded tiny model)")
    serve.add_argument(
        "--served-model-name", help="the model id OpenAI clients pass (default: the model's name)"
    )
    serve.add_argument(
        "--max-model-len", type=int, help="context length served (default: the model's own)"
    )
    serve.add_argument("--dtype", help="auto | float32 | bfloat16 (default auto)")
    serve.add_argument(
        "--tool-call-parser",
        help="tool call syntax: hermes | llama3_json | mistral (default: from the chat template)",
    )
    serve.add_argument(
        "--threads", type=int, help="CPU compute threads (default: all cores but one, for HTTP)"
    )
    serve.add_argument("--max-num-seqs", type=int, help="running requests per replica (64)")
    serve.add_argument(
        "--max-num-batched-tokens", type=int, help="tokens computed per replica step (2048)"
    )
    serve.add_argument("--replicas", type=int, help="engine replicas sharing one KV pool")
    serve.add_argument(
        "--routing",
        choices=("prefix", "round_robin", "random"),
        help="replica and upstream choice (default prefix; the others are baselines)",
    )
    serve.add_argument("--kv-cache-dtype", help="auto | float32 | bfloat16 | fp8")
    serve.add_argument(
        "--kv-cache-memory", help="KV cache size, e.g. 256MiB (default: share of free)"
    )
    serve.add_argument("--redis-url", help="share the discovery cache through Redis")
    serve.add_argument("--allowed-origins", help="comma-separated Origins allowed beyond localhost")
    serve.add_argument("--max-body-bytes", type=int, help="largest request body (default 1 MiB)")
    serve.add_argument(
        "--catalog-config",
        help="JSON file: instructions, resources, prompts (re-read on SIGHUP and admin reload)",
    )
    serve.add_argument("--admin-api-key", help="enable /admin/* for 'Authorization: Bearer KEY'")
    auth = serve.add_argument_group("authentication", "API keys and OAuth 2.1 access tokens")
    auth.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (tenant 'default')")
    auth.add_argument("--api-keys-file", help="'tenant: sha256-hex-of-key' lines (SIGHUP re-reads)")
    auth.add_argument("--oauth-issuer", help="accept JWT access tokens from this issuer")
    auth.add_argument("--oauth-jwks-url", help="the issuer's JWKS URL")
    auth.add_argument("--oauth-resource", help="this server's canonical URI (the token audience)")
    auth.add_argument("--oauth-tenant-claim", help="claim naming the tenant (default sub)")
    auth.add_argument(
        "--budget-requests-per-min", type=int, help="inference calls per tenant per minute"
    )
    auth.add_argument("--budget-tokens-per-min", type=int, help="tokens per tenant per minute")
    auth.add_argument(
        "--budget-processes", type=int, help="gateway processes sharing the budget (Redis down)"
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        dest="drain_timeout_s",
        help="seconds in-flight requests get after SIGTERM (default 30)",
    )
    serve.add_argument("--log-format", choices=("text", "json"), help="log lines (default text)")
    fleet = serve.add_argument_group(
        "fleet", "route to engine servers (vLLM, SGLang, kvgate) instead of an embedded engine"
    )
    fleet.add_argument(
        "--upstream",
        action="append",
        help="an upstream's base URL, e.g. http://10.0.0.5:8000 (repeat for each)",
    )
    fleet.add_argument(
        "--upstream-dns",
        action="append",
        help="HOST:PORT resolving to many upstreams, e.g. a Kubernetes headless Service",
    )
    fleet.add_argument(
        "--upstream-refresh",
        type=float,
        dest="upstream_refresh_s",
        help="seconds between re-resolving --upstream-dns (default 10)",
    )
    fleet.add_argument(
        "--upstream-scrape-interval",
        type=float,
        dest="upstream_scrape_interval_s",
        help="seconds between reads of each upstream's /metrics load; 0 = off (default 2)",
    )
    fleet.add_argument("--tokenizer", help="tokenizer folder for token-aligned prefix hashes")
    fleet.add_argument("--upstream-health-path", help="active health check path (default /health)")
    fleet.add_argument(
        "--upstream-health-interval",
        type=float,
        dest="upstream_health_interval_s",
        help="seconds between health checks; 0 = passive only (default 2)",
    )
    fleet.add_argument(
        "--upstream-health-timeout",
        type=float,
        dest="upstream_health_timeout_s",
        help="seconds a health check may take (default 1)",
    )
    fleet.add_argument(
        "--upstream-unhealthy-after",
        type=int,
        help="consecutive failures that take an upstream out (default 2)",
    )
    fleet.add_argument("--upstream-connect-timeout", type=float, dest="upstream_connect_timeout_s")
    fleet.add_argument(
        "--upstream-read-timeout",
        type=float,
        dest="upstream_read_timeout_s",
        help="longest silence between stream chunks (default 60)",
    )
    limits = serve.add_argument_group("limits", "admission control and abuse limits")
    limits.add_argument(
        "--max-waiting",
        type=int,
        help="requests waiting per engine replica; beyond -> 503 (default 256)",
    )
    limits.add_argument("--max-prompt-tokens", type=int, help="longest prompt (default: context)")
    limits.add_argument(
        "--max-tokens-limit",
        type=int,
        help="largest max_tokens a call may ask for (default: context)",
    )
    limits.add_argument(
        "--max-concurrency-per-client",
        type=int,
        help="calls in flight per API key or cache_key; beyond -> 429 (default off)",
    )
    limits.add_argument(
        "--request-timeout",
        type=float,
        dest="request_timeout_s",
        help="tools/call deadline in seconds (default 300)",
    )
    limits.add_argument(
        "--step-timeout",
        type=float,
        dest="step_timeout_s",
        help="engine step seconds before its replica counts as stuck (default 120)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        dest="body_timeout_s",
        help="seconds for a request body to arrive (default 30)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        dest="header_timeout_s",
        help="seconds for request headers to arrive (default 30)",
    )
    limits.add_argument(
        "--max-header-bytes", type=int, help="request line + headers (default 32 KiB)"
    )
    limits.add_argument("--max-json-depth", type=int, help="JSON nesting depth (default 64)")
    limits.add_argument(
        "--max-listen-streams",
        type=int,
        help="open subscriptions/listen streams; beyond -> 503 (default 1024)",
    )
    tiny = commands.add_parser("make-tiny-model", help="write the tiny test model to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--preset", default="tiny", help="size preset (tiny, bench55m)")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    names = (
        "host",
        "port",
        "model",
        "served_model_name",
        "max_model_len",
        "tool_call_parser",
        "dtype",
        "threads",
        "max_num_seqs",
        "max_num_batched_tokens",
        "replicas",
        "routing",
        "kv_cache_dtype",
        "kv_cache_memory",
        "redis_url",
        "allowed_origins",
        "max_body_bytes",
        "catalog_config",
        "admin_api_key",
        "api_key",
        "api_keys_file",
        "oauth_issuer",
        "oauth_jwks_url",
        "oauth_resource",
        "oauth_tenant_claim",
        "budget_requests_per_min",
        "budget_tokens_per_min",
        "budget_processes",
        "drain_timeout_s",
        "log_format",
        "max_waiting",
        "max_prompt_tokens",
        "max_tokens_limit",
        "max_concurrency_per_client",
        "request_timeout_s",
        "step_timeout_s",
        "body_timeout_s",
        "header_timeout_s",
        "max_header_bytes",
        "max_json_depth",
        "max_listen_streams",
        "upstream",
        "upstream_dns",
        "upstream_refresh_s",
        "upstream_scrape_interval_s",
        "tokenizer",
        "upstream_health_path",
        "upstream_health_interval_s",
        "upstream_health_timeout_s",
        "upstream_unhealthy_after",
        "upstream_connect_timeout_s",
        "upstream_read_timeout_s",
    )
    return Settings.from_env(**{name: getattr(args, name) for name in names})


def engine_limits(settings: Settings) -> dict[str, Any]:
    """The EngineConfig admission fields a Settings sets (0 = no limit)."""
    return {
        "max_waiting": settings.max_waiting,
        "step_timeout_s": settings.step_timeout_s,
        "max_prompt_tokens": settings.max_prompt_tokens or None,
        "max_tokens_limit": settings.max_tokens_limit or None,
        "max_model_len": settings.max_model_len or None,
    }


def serve(settings: Settings) -> None:
    if settings.upstream or settings.upstream_dns:
        serve_fleet(settings)
        return
    from engine import AsyncLLM, EngineConfig
    from engine.config import serving_threads

    try:
        engine = AsyncLLM(
            EngineConfig(
                model=settings.model,
                dtype=settings.dtype,
                threads=settings.threads or serving_threads(),
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                replicas=settings.replicas,
                routing=settings.routing,
                kv_cache_dtype=settings.kv_cache_dtype,
                kv_cache_memory=settings.kv_cache_memory,
                **engine_limits(settings),
            )
        )
    except (OSError, ValueError) as exc:  # a wrong folder or setting: say so, no traceback
        sys.exit(f"kvgate: cannot load the model: {exc}")
    try:
        stats = engine.stats()
        logger.info(
            "model %s (context %d), %d replica(s), KV cache %d tokens (%d blocks x %d, %s)",
            engine.model_name,
            engine.max_model_len,
            settings.replicas,
            stats.num_blocks * stats.block_size,
            stats.num_blocks,
            stats.block_size,
            stats.cache_dtype,
        )
        run_app(settings, engine=engine)
    finally:
        engine.shutdown()


def serve_fleet(settings: Settings) -> None:
    """Fleet mode: no embedded engine; calls go to the upstreams (a model mismatch among
    them, or none answering, is a startup error)."""
    from gateway.upstream import Fleet, FleetConfigError

    try:
        fleet = Fleet.connect(settings)
    except FleetConfigError as exc:
        sys.exit(f"kvgate: {exc}")
    logger.info(
        "fleet mode: model %s on %d upstream(s): %s",
        fleet.model_name,
        len(fleet.upstreams),
        ", ".join(u.url for u in fleet.upstreams),
    )
    run_app(settings, backend=fleet)


def run_app(settings: Settings, **backend: Any) -> None:
    from gateway.app import create_app
    from gateway.catalog.config import CatalogConfigError
    from gateway.http.serving import http_protocol, serve_app

    base = f"http://{settings.host}:{settings.port}"
    logger.info("MCP endpoint %s/mcp, OpenAI-compatible API %s/v1", base, base)
    try:
        app = create_app(settings, **backend)
    except (CatalogConfigError, ValueError) as exc:  # a bad catalog, keys file or OAuth setting
        sys.exit(f"kvgate: {exc}")
    serve_app(
        app,
        settings.host,
        settings.port,
        settings.drain_timeout_s,
        uvicorn_logging=settings.log_format == "text",
        http=http_protocol(settings),
    )
    logger.info("stopped")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "make-tiny-model":
        from engine.tiny_model import make_tiny_model

        print(make_tiny_model(args.dir, seed=args.seed, preset=args.preset))
        return
    try:
        settings = settings_from_args(args)
        configure_logging(settings.log_format)
        if settings.tool_call_parser:  # refused before a model is loaded
            from gateway.function_calls.formats import resolve

            resolve(settings.tool_call_parser, None)
    except ValueError as exc:
        sys.exit(f"kvgate: {exc}")
    serve(settings)
