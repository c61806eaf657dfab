"""The repository speaks the project's language, not the language of how it was made.

Numbered work rounds, work sessions and "this round" say nothing to a user: a figure carries its date and CPU instead, and history lives in git and
CHANGELOG.md. "Session" keeps the meanings the project has for it: MCP and HTTP (kvgate is
stateless, no ``Mcp-Session-Id``), pytest's session scope, and a conversation whose turns a
``cache_key`` routes together (the agent traces of the benchmarks)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".txt", ".conf"}
TEXT_SUFFIXES |= {".cpp", ".h", ".cu", ".in"}
TEXT_NAMES = {"Dockerfile", "run", ".gitignore"}  # .ci/run
SKIPPED_DIRS = {".git", ".venv", "site", "build", "dist", "node_modules", "__pycache__"}
SKIPPED_DIRS |= {".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis", "tmp"}
# Third-party text kept verbatim: the MCP spec's schemas speak of sessions, and chat templates
# are the model vendors' own.
THIRD_PARTY = ("kvgate/schemas/mcp/", "tests/engine/tokenization/chat_templates/")

# A numbered round of work, or one named relative to the present.
WORK_ROUND = re.compile(
    r"\bstops?[ -]?\d+\b"
    r"|\b(?:this|last|previous|earlier|next)\s+(?:stop|round)\b"
    r"|\bearlier\s+runs?\b",
    re.IGNORECASE,
)
SESSION = re.compile(r"\bsessions?\b", re.IGNORECASE)
# The meanings "session" keeps, matched around each occurrence.
ALLOWED_SESSION = [
    # MCP and HTTP: kvgate mints none; the spec's and the SDK's names for them.
    r"mcp-session-id|no (?:mcp )?sessions?\b|session-wide|server-session-lifecycle|ctx\.session"
    r"|no session is minted",
    # pytest's scope.
    r'scope="session"|session-scoped|test session|pytest_session',
    # A conversation routed by its cache_key (the agent traces, fleet placement).
    r"sticky sessions?|session affinity|session(?:'s|[- ](?:id|key|tokens)\b)"
    r"|\b(?:\d+|s)[ -]sessions?\b|sessions? (?:x|×) |--sessions|\.sessions?\b|session-[{\d]"
    r"|another-session|per[- ]session|each session|across sessions|for session in"
    r"|\bsessions?(?:\(|\[|\]|\)|\s*=|: (?:int|list)|,$)|[(\[$]session\b|in sessions\b"
    r"|sessions (?:kept|on one|start|run|per|that start|fell)\b"
    r"|\bsessions? (?:to|for|up|went|pinned|keys)\b|\ba session$|acme's session",
]
ALLOWED = re.compile("|".join(f"(?:{a})" for a in ALLOWED_SESSION), re.IGNORECASE)
WINDOW = 30  # characters either side of a "session" the allow-list reads


def scanned_files() -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        relative = path.relative_to(ROOT)
        if any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in relative.parts):
            continue
        if not path.is_file() or path == THIS or str(relative).startswith(THIRD_PARTY):
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
            found.append(path)
    return found


def offending(line: str) -> list[str]:
    """The work-history phrases in ``line``."""
    found = [m.group(0) for m in WORK_ROUND.finditer(line)]
    for m in SESSION.finditer(line):
        around = line[max(0, m.start() - WINDOW) : m.end() + WINDOW]
        if not ALLOWED.search(around):
            found.append(around.strip())
    return found


def test_the_patterns_catch_work_history_and_keep_the_project_meanings() -> None:
    # Spelt from parts, so that this file does not hold the phrases it keeps out.
    stop, session, earlier, last = "st" + "op", "sess" + "ion", "earl" + "ier", "la" + "st"
    caught = [
        f"{stop.title()} 43, AMD EPYC Zen 4",
        f"measured in {stop}-12",
        f"{stop}31 figures",
        f"before this {stop}",
        f"on a Zen 4 {last} round",
        f"an {earlier} run gave 1.2x",
        f"2-core Zen 4, an earlier {session}: prefill",
        f"figures from the previous {session}",
    ]
    for phrase in caught:
        assert offending(phrase), phrase
    kept = [
        "stateless: no sessions, per-request _meta",
        'headers={"Mcp-Session-Id": "x"}',
        "12 sessions x 6 turns",
        "cache_key = the session id",
        '@pytest.fixture(scope="session")',
        "sticky sessions on the balancer",
        "stop strings, stop_reason and stop tokens",
    ]
    for phrase in kept:
        assert not offending(phrase), phrase


def test_no_work_history_wording_in_the_repository() -> None:
    files = scanned_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    # Not vacuous: the scan reaches the code, the docs and the benchmarks.
    assert len(files) > 300, len(files)
    assert {"README.md", "CHANGELOG.md", "kvgate/gateway/cli.py", "benchmarks/fleet.py"} <= names
    problems = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for phrase in offending(line):
                problems.append(f"{path.relative_to(ROOT)}:{number}: {phrase!r}")
    assert not problems, "work-history wording (say the date and CPU instead):\n" + "\n".join(
        problems
    )
