"""One declaration per flag: the ``serve`` parser, the environment twins and the configuration
reference (docs/configuration.md) all come from the Settings fields, and stay what they were."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest

from kvgate.gateway.cli import (
    REFERENCE,
    add_flags,
    build_parser,
    flags_table,
    main,
    settings_from_args,
)
from kvgate.gateway.settings import GROUPS, Option, SettingError, Settings, env_only, flag, options

ROOT = Path(__file__).resolve().parents[2]

SERVE_FLAGS = {  # flag: (dest, type, action, choices, group), as build_parser declared them by hand
    "--host": ("host", str, "store", None, "server"),
    "--port": ("port", int, "store", None, "server"),
    "--workers": ("workers", int, "store", None, "server"),
    "--in-process-engine": ("in_process_engine", str, "bool", None, "engine"),
    "--gguf-dequantize": ("gguf_dequantize", str, "bool", None, "model"),
    "--model": ("model", str, "store", None, "model"),
    "--revision": ("revision", str, "store", None, "model"),
    "--served-model-name": ("served_model_name", str, "store", None, "model"),
    "--max-model-len": ("max_model_len", int, "store", None, "model"),
    "--dtype": ("dtype", str, "store", None, "model"),
    "--tool-call-parser": ("tool_call_parser", str, "store", None, "model"),
    "--reasoning-parser": ("reasoning_parser", str, "store", None, "model"),
    "--threads": ("threads", int, "store", None, "engine"),
    "--max-num-seqs": ("max_num_seqs", int, "store", None, "engine"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "store", None, "engine"),
    "--replicas": ("replicas", int, "store", None, "engine"),
    "--routing": ("routing", str, "store", ("prefix", "round_robin", "random"), "engine"),
    "--kv-cache-dtype": ("kv_cache_dtype", str, "store", None, "kv cache"),
    "--kv-cache-memory": ("kv_cache_memory", str, "store", None, "kv cache"),
    "--kv-events-config": ("kv_events_config", str, "store", None, "kv cache"),
    "--speculative-config": ("speculative_config", str, "store", None, "engine"),
    "--redis-url": ("redis_url", str, "store", None, "redis"),
    "--allowed-origins": ("allowed_origins", str, "store", None, "server"),
    "--max-body-bytes": ("max_body_bytes", int, "store", None, "limits"),
    "--catalog-config": ("catalog_config", str, "store", None, "catalog"),
    "--admin-api-key": ("admin_api_key", str, "store", None, "admin"),
    "--api-key": ("api_key", str, "store", None, "authentication"),
    "--api-keys-file": ("api_keys_file", str, "store", None, "authentication"),
    "--oauth-issuer": ("oauth_issuer", str, "store", None, "authentication"),
    "--oauth-jwks-url": ("oauth_jwks_url", str, "store", None, "authentication"),
    "--oauth-resource": ("oauth_resource", str, "store", None, "authentication"),
    "--oauth-tenant-claim": ("oauth_tenant_claim", str, "store", None, "authentication"),
    "--budget-requests-per-min": ("budget_requests_per_min", int, "store", None, "authentication"),
    "--budget-tokens-per-min": ("budget_tokens_per_min", int, "store", None, "authentication"),
    "--budget-processes": ("budget_processes", int, "store", None, "authentication"),
    "--drain-timeout": ("drain_timeout_s", float, "store", None, "server"),
    "--ui": ("ui", str, "bool", None, "server"),
    "--log-format": ("log_format", str, "store", ("text", "json"), "logging"),
    "--stats-interval": ("stats_interval_s", float, "store", None, "logging"),
    "--access-log": ("access_log", str, "bool", None, "logging"),
    "--otlp-traces-endpoint": ("otlp_traces_endpoint", str, "store", None, "logging"),
    "--upstream": ("upstream", str, "extend", None, "fleet"),
    "--upstream-dns": ("upstream_dns", str, "extend", None, "fleet"),
    "--upstream-kv-events": ("upstream_kv_events", str, "extend", None, "fleet"),
    "--upstream-kv-index-blocks": ("upstream_kv_index_blocks", int, "store", None, "fleet"),
    "--upstream-refresh": ("upstream_refresh_s", float, "store", None, "fleet"),
    "--upstream-scrape-interval": ("upstream_scrape_interval_s", float, "store", None, "fleet"),
    "--tokenizer": ("tokenizer", str, "store", None, "fleet"),
    "--upstream-health-path": ("upstream_health_path", str, "store", None, "fleet"),
    "--upstream-health-interval": ("upstream_health_interval_s", float, "store", None, "fleet"),
    "--upstream-health-timeout": ("upstream_health_timeout_s", float, "store", None, "fleet"),
    "--upstream-unhealthy-after": ("upstream_unhealthy_after", int, "store", None, "fleet"),
    "--upstream-connect-timeout": ("upstream_connect_timeout_s", float, "store", None, "fleet"),
    "--upstream-read-timeout": ("upstream_read_timeout_s", float, "store", None, "fleet"),
    "--upstream-api-key": ("upstream_api_key", str, "store", None, "fleet"),
    "--tenant-salt-secret-file": ("tenant_salt_secret_file", str, "store", None, "fleet"),
    "--task-threshold-s": ("task_threshold_s", float, "store", None, "tasks"),
    "--task-ttl-s": ("task_ttl_s", float, "store", None, "tasks"),
    "--task-poll-interval-s": ("task_poll_interval_s", float, "store", None, "tasks"),
    "--task-lease-s": ("task_lease_s", float, "store", None, "tasks"),
    "--task-id-prefix": ("task_id_prefix", str, "store", None, "tasks"),
    "--max-tasks-per-tenant": ("max_tasks_per_tenant", int, "store", None, "tasks"),
    "--max-waiting": ("max_waiting", int, "store", None, "limits"),
    "--max-prompt-tokens": ("max_prompt_tokens", int, "store", None, "limits"),
    "--max-tokens-limit": ("max_tokens_limit", int, "store", None, "limits"),
    "--max-concurrency-per-client": ("max_concurrency_per_client", int, "store", None, "limits"),
    "--request-timeout": ("request_timeout_s", float, "store", None, "limits"),
    "--responses-ttl": ("responses_ttl_s", int, "store", None, "redis"),
    "--step-timeout": ("step_timeout_s", float, "store", None, "limits"),
    "--body-timeout": ("body_timeout_s", float, "store", None, "limits"),
    "--header-timeout": ("header_timeout_s", float, "store", None, "limits"),
    "--max-header-bytes": ("max_header_bytes", int, "store", None, "limits"),
    "--max-json-depth": ("max_json_depth", int, "store", None, "limits"),
    "--max-listen-streams": ("max_listen_streams", int, "store", None, "limits"),
    # Added since, with vLLM's spellings (issue 26); repeated flags extend: --flag A B.
    "--enable-lora": ("enable_lora", str, "bool", None, "lora"),
    "--lora-modules": ("lora_modules", str, "extend", None, "lora"),
    "--max-lora-rank": ("max_lora_rank", int, "store", None, "lora"),
    "--max-loras": ("max_loras", int, "store", None, "lora"),
    "--allow-runtime-lora-updating": ("allow_runtime_lora_updating", str, "bool", None, "lora"),
    "--endpoints-file": ("endpoints_file", str, "store", None, "epp"),
    "--epp-idle-timeout": ("epp_idle_timeout_s", float, "store", None, "epp"),
    "--epp-max-streams": ("epp_max_streams", int, "store", None, "epp"),
}

# Settings fields that had no flag before the declarations (environment twins only).
ENV_ONLY = {
    "catalog_ttl_ms",
    "keepalive_s",
    "listen_max_s",
    "server_name",
    "oauth_leeway_s",
    "oauth_jwks_min_refresh_s",
    "oauth_inference_scope",
    "oauth_admin_scope",
    "upstream_healthy_after",
    "upstream_cooldown_s",
    "upstream_placement_timeout_s",
    "tenant_salt_secret",
    "instructions",
}


def serve_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve = commands.choices["serve"]
    assert isinstance(serve, argparse.ArgumentParser)
    return serve


def declared(serve: argparse.ArgumentParser) -> dict[str, tuple[Any, ...]]:
    group_of = {id(a): g.title for g in serve._action_groups for a in g._group_actions}
    actions = {
        argparse._StoreAction: "store",
        argparse._ExtendAction: "extend",
        argparse.BooleanOptionalAction: "bool",
    }
    return {
        a.option_strings[0]: (
            a.dest,
            a.type or str,
            actions[type(a)],
            tuple(a.choices) if a.choices is not None else None,
            group_of[id(a)],
        )
        for a in serve._actions
        if a.dest != "help"
    }


def flagged() -> list[Option]:
    return [o for o in options() if o.flag is not None]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for option in options():
        monkeypatch.delenv(option.env, raising=False)


def test_the_flags_are_the_ones_written_by_hand_before() -> None:
    serve = serve_parser()
    assert declared(serve) == SERVE_FLAGS
    titles = [g.title for g in serve._action_groups][2:]  # after positionals and --help's
    assert titles == ["server", "model", "engine", "kv cache", "redis", "catalog", "admin",
                      "logging", "authentication", "limits", "tasks", "fleet", "lora", "epp"]  # fmt: skip
    assert all(g.description for g in serve._action_groups[2:])
    assert all(a.default is None for a in serve._actions if a.dest != "help")


def test_every_field_is_declared_once_with_its_env_twin() -> None:
    assert [o.name for o in options()] == [f.name for f in fields(Settings)]
    assert {o.name for o in options() if o.flag is None} == ENV_ONLY
    assert all(o.env == "KVGATE_" + o.name.upper() for o in options())
    assert all(o.default == getattr(Settings(), o.name) for o in options())
    assert all(o.meta.help for o in options())


def sample(option: Option, other: bool = False) -> tuple[list[str], str]:
    """A flag's arguments and its environment twin's text, for the same non-default value
    (``other``: a second one)."""
    assert option.flag is not None
    if option.kind is bool:  # --flag / --no-flag: the one that is not the default first
        on, off = ([option.flag], "1"), ([option.flag.replace("--", "--no-", 1)], "false")
        first, second = (off, on) if option.default else (on, off)
        return second if other else first
    if option.kind is tuple:
        values = ["http://c.example:3"] if other else ["http://a.example:1/", "http://b.example:2"]
        if option.meta.repeat:
            return [arg for value in values for arg in (option.flag, value)], ", ".join(values)
        return [option.flag, ", ".join(values)], ", ".join(values)
    if option.meta.choices is not None:
        raw = option.meta.choices[0 if other else -1]
    elif option.kind is str:
        raw = f"y-{option.name}" if other else f"x-{option.name}"
    else:  # a number a little above its declared lower bound
        meta = option.meta
        low = meta.ge if meta.ge is not None else (meta.gt or 0)
        step = (9 if other else 7) if option.kind is int else (4.5 if other else 2.5)
        raw = str(option.kind(low + step))
    return [option.flag, raw], raw


@pytest.mark.parametrize("option", flagged(), ids=lambda o: o.flag)
def test_every_flag_parses_like_its_env_twin(option: Option, clean_env: None) -> None:
    argv, raw = sample(option)
    from_flag = settings_from_args(build_parser().parse_args(["serve", *argv]))
    from_env = Settings.from_env({option.env: raw})
    assert from_flag == from_env
    assert getattr(from_flag, option.name) != option.default
    if option.kind is tuple:
        assert getattr(from_flag, option.name) == ("http://a.example:1", "http://b.example:2")


@pytest.mark.parametrize("option", flagged(), ids=lambda o: o.flag)
def test_a_flag_beats_its_env_twin(option: Option, monkeypatch: pytest.MonkeyPatch) -> None:
    _, raw = sample(option)
    argv, other = sample(option, other=True)
    monkeypatch.setenv(option.env, raw)
    from_env = getattr(Settings.from_env({option.env: raw}), option.name)
    assert (
        getattr(settings_from_args(build_parser().parse_args(["serve"])), option.name) == from_env
    )
    given = getattr(settings_from_args(build_parser().parse_args(["serve", *argv])), option.name)
    assert given == getattr(Settings.from_env({option.env: other}), option.name) != from_env


def test_an_empty_env_var_keeps_the_default() -> None:
    assert Settings.from_env({o.env: "" for o in options()}) == Settings()


def test_an_env_only_setting_has_no_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert Settings.from_env({"KVGATE_UPSTREAM_COOLDOWN_S": "1.5"}).upstream_cooldown_s == 1.5
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--upstream-cooldown", "1.5"])
    assert exited.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_choices_are_enforced_on_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--routing", "sticky"])
    assert "invalid choice: 'sticky'" in capsys.readouterr().err


def test_help_lists_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for option in flagged():
        assert option.flag is not None and option.flag in text
        if option.default_text() != "none":
            assert f"(default: {option.default_text()})" in text
    assert "10% of free memory" in text  # a % in a help is escaped for argparse


def test_the_configuration_reference_is_the_generated_one() -> None:
    assert (ROOT / REFERENCE).read_text() == flags_table(), (
        f"{REFERENCE} drifted from kvgate/gateway/settings.py: "
        f"run `python -m kvgate flags-table --write {REFERENCE}`"
    )


def rows(page: str) -> dict[str, list[list[str]]]:
    """The reference's table rows under each ``## group`` heading, as a reader sees them."""
    found: dict[str, list[list[str]]] = {}
    group = ""
    for line in page.splitlines():
        if line.startswith("## "):
            group = line.removeprefix("## ")
            found[group] = []
        elif line.startswith("| ") and "---" not in line and not line.startswith("| flag "):
            found[group].append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return found


def test_the_reference_rows_name_real_settings_under_their_group() -> None:
    """Read the page apart from the renderer: every declared setting has a row under its
    group with its flag, env twin, default and allowed values, and no row names another."""
    page = rows((ROOT / REFERENCE).read_text())
    assert list(page) == [g for g in GROUPS if any(o.meta.group == g for o in options())]
    by_env = {
        row[1].split(" ")[0].strip("`"): (group, row) for group, r in page.items() for row in r
    }
    assert set(by_env) == {o.env for o in options()}
    for option in options():
        group, (spelling, env, default, allowed, meaning) = by_env[option.env]
        assert group == option.meta.group
        if option.flag is None:
            assert spelling == "—"
        else:
            assert spelling.strip("`").split(" ")[0] == option.flag
        assert default == option.default_text("`")
        if option.kind in (int, float):
            assert float(default.split(" ")[0].strip("`")) == option.default
        if option.meta.allowed():
            assert allowed == option.meta.allowed()
        assert meaning


def test_flags_table_writes_the_reference(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    main(["flags-table", "--write", str(page)])
    assert page.read_text() == flags_table()


def test_flags_table_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    main(["flags-table"])
    assert capsys.readouterr().out == flags_table()


@dataclass(frozen=True)
class Extended(Settings):
    verbose: bool = flag(False, "talk more", group="limits")
    peers: tuple[str, ...] = flag((), "peer URLs", group="fleet", cli="--peer", repeat=True)
    secret: str = env_only("s", "not on the command line", group="authentication")


def test_one_declaration_is_all_a_new_flag_takes() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Extended)
    args = parser.parse_args(["--verbose", "--peer", "http://p:1/", "--peer", "http://q:2"])
    assert (args.verbose, args.peers) == (True, ["http://p:1/", "http://q:2"])
    assert parser.parse_args(["--no-verbose"]).verbose is False
    assert not hasattr(args, "secret")
    from_env = Extended.from_env({"KVGATE_VERBOSE": "yes", "KVGATE_PEERS": "http://p:1/"})
    assert isinstance(from_env, Extended)
    assert (from_env.verbose, from_env.peers, from_env.secret) == (True, ("http://p:1",), "s")
    assert Extended.from_env({}, peers=args.peers).peers == ("http://p:1", "http://q:2")
    reference = flags_table(Extended)
    assert "| `--peer` | `KVGATE_PEERS` (comma list) | none | — | peer URLs |" in reference
    assert "| — | `KVGATE_SECRET` | `s` | — | not on the command line |" in reference


def test_a_declaration_mistake_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown flag group"):
        flag(0, "x", group="nope")
    with pytest.raises(ValueError, match="starts with --"):
        flag(0, "x", group="server", cli="-x")

    @dataclass(frozen=True)
    class Repeating(Settings):
        count: int = flag(0, "x", group="server", repeat=True)

    with pytest.raises(TypeError, match="only a tuple field"):
        options(Repeating)

    @dataclass(frozen=True)
    class Listed(Settings):
        counts: list[int] = flag(None, "x", group="server")  # type: ignore[arg-type]

    with pytest.raises(TypeError, match="no flag for"):
        options(Listed)

    @dataclass(frozen=True)
    class Undeclared(Settings):
        bare: int = 0

    with pytest.raises(TypeError, match="without flag"):
        options(Undeclared)


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"KVGATE_ENABLE_LORA": "ture"}, "KVGATE_ENABLE_LORA='ture': expected true or false"),
        ({"KVGATE_MAX_NUM_SEQS": "abc"}, "KVGATE_MAX_NUM_SEQS='abc'"),
        (
            {"KVGATE_DRAIN_TIMEOUT_S": "-5"},
            "KVGATE_DRAIN_TIMEOUT_S): -5 is not allowed; expected ≥ 0",
        ),
        ({"KVGATE_ROUTING": "sticky"}, "one of prefix, round_robin, random"),
        ({"KVGATE_PORT": "70000"}, "expected ≥ 0 and ≤ 65535"),
    ],
)
def test_a_bad_environment_value_names_the_variable_and_what_is_allowed(
    environ: dict[str, str], named: str
) -> None:
    with pytest.raises(SettingError) as refused:
        Settings.from_env(environ)
    assert named in str(refused.value)


def test_bounds_hold_however_the_value_came(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SettingError, match="--workers"):
        Settings(workers=0)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--max-num-seqs", "0"])
    assert exited.value.code != 0


def test_a_misspelt_flag_gets_the_nearest_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--modle", "x", "--max-num-sqes", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--modle: did you mean --model" in err
    assert "--max-num-sqes: did you mean --max-num-seqs" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert re.fullmatch(r"kvgate \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
