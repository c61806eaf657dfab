"""Runs the official MCP conformance suite (``@modelcontextprotocol/conformance``, pinned)
against one URL: its generic server scenarios on both wires, judged from each run's
``checks.json``.

The CLI needs Node >= 22: one on PATH is used, else the official binary shipped as the npm
package ``node-linux-<arch>``; both are installed once from the npm registry into the user's
cache dir (``$KVGATE_CACHE_DIR/conformance``, default ``~/.cache/kvgate/conformance``).
"""

from __future__ import annotations

import fcntl
import json
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.engine.config import cache_dir as kvgate_cache_dir

CLI_PACKAGE = "@modelcontextprotocol/conformance"
CLI_VERSION = "0.2.0-alpha.12"
NODE_VERSION = "22.23.5"
SCENARIO_TIMEOUT_S = 120

# (scenario, revision): those that need no tool, resource or prompt of the suite's own server.
GENERIC_SCENARIOS = [
    *(
        (name, "2025-11-25")
        for name in (
            "server-initialize",
            "server-session-lifecycle",
            "ping",
            "tools-list",
            "resources-list",
            "prompts-list",
            "server-sse-multiple-streams",
            "dns-rebinding-protection",
        )
    ),
    *(
        (name, "2026-07-28")
        for name in (
            "server-stateless",
            "tools-list",
            "resources-list",
            "prompts-list",
            "server-sse-multiple-streams",
            "dns-rebinding-protection",
            "caching",
            "sep-2164-resource-not-found",
            "http-header-validation",
            "input-required-result-unsupported-methods",
        )
    ),
]
# Checks only the suite's diagnostic fixture tools can exercise (test_missing_capability,
# test_streaming_elicitation, test_logging_tool): reported, not counted against a scenario.
FIXTURE_ONLY_CHECKS = frozenset(
    {
        ("server-stateless", "sep-2575-server-rejects-undeclared-capability"),
        ("server-stateless", "sep-2575-missing-capability-http-400"),
        ("server-stateless", "sep-2575-http-server-no-independent-requests-on-stream"),
        ("server-stateless", "sep-2575-server-no-log-without-loglevel"),
    }
)


class SetupError(RuntimeError):
    """Node or the CLI could not be installed (no npm, or the registry refused)."""


@dataclass
class ScenarioResult:
    scenario: str
    revision: str
    failures: list[str] = field(default_factory=list)
    scored: int = 0

    @property
    def passed(self) -> bool:
        """No failing check (some scenarios only report INFO/WARNING: nothing to score)."""
        return not self.failures

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        text = f"{verdict}  {self.revision}  {self.scenario} ({self.scored} checks)"
        return "\n".join([text, *(f"      x {f}" for f in self.failures)])


def cache_dir() -> Path:
    return kvgate_cache_dir() / "conformance"


def _node_major(node: str) -> int:
    try:
        out = subprocess.run(
            [node, "-p", "process.versions.node"], capture_output=True, text=True, timeout=30
        )
        return int(out.stdout.split(".")[0])
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def _npm_install(target: Path, spec: str) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise SetupError(f"npm is needed once to install {spec}")
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".install-"))
    (work / "package.json").write_text('{"name": "kvgate-conformance", "private": true}\n')
    run = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", spec],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise SetupError(f"npm install {spec} failed: {run.stderr[-2000:]}")
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)


def install() -> tuple[str, Path]:
    """(node binary, CLI entry point), installing what is missing (serialised by a lock)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        node = shutil.which("node")
        if node is None or _node_major(node) < 22:
            arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64"}.get(platform.machine())
            if arch is None:
                raise SetupError(f"no Node >= 22 for {platform.machine()}: put one on PATH")
            node_dir = root / f"node-{NODE_VERSION}"
            node = str(node_dir / "node_modules" / f"node-linux-{arch}" / "bin" / "node")
            if _node_major(node) < 22:
                _npm_install(node_dir, f"node-linux-{arch}@{NODE_VERSION}")
        cli_dir = root / f"cli-{CLI_VERSION}"
        cli = cli_dir / "node_modules" / CLI_PACKAGE / "dist" / "index.js"
        if not cli.is_file():
            _npm_install(cli_dir, f"{CLI_PACKAGE}@{CLI_VERSION}")
    return node, cli


def run_scenario(node: str, cli: Path, url: str, scenario: str, revision: str) -> ScenarioResult:
    result = ScenarioResult(scenario, revision)
    with tempfile.TemporaryDirectory(prefix="kvgate-conformance-") as out:
        command = [node, str(cli), "server", "--url", url, "--scenario", scenario]
        command += ["--spec-version", revision, "-o", out]
        try:
            run = subprocess.run(
                command, capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            result.failures.append(f"no result within {SCENARIO_TIMEOUT_S} s")
            return result
        found = sorted(Path(out).rglob("checks.json"))
        if not found:
            result.failures.append("no checks.json: " + (run.stdout + run.stderr)[-800:])
            return result
        for check in json.loads(found[0].read_text()):
            if (scenario, check.get("id")) in FIXTURE_ONLY_CHECKS:
                continue
            if check.get("status") in ("SUCCESS", "FAILURE"):
                result.scored += 1
            if check.get("status") == "FAILURE":
                message = " ".join(str(check.get("errorMessage", "")).split())[:300]
                result.failures.append(f"{check.get('id')} [{check.get('name')}]: {message}")
    return result


def run_suite(url: str) -> list[ScenarioResult]:
    node, cli = install()
    return [run_scenario(node, cli, url, s, r) for s, r in GENERIC_SCENARIOS]
