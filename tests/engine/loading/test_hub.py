"""Hub ids resolve through huggingface_hub's own cache layout, offline (HF_HUB_OFFLINE=1,
HF_HOME in a temporary folder): no network. A subprocess each, as huggingface_hub reads its
environment once, at import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

ROOT = Path(__file__).resolve().parents[3]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CASES = [
    ("org/tiny", ""),
    ("org/tiny", "dev"),
    ("org/tiny", COMMIT),
    ("org/absent", ""),
    ("org/tiny", "v2"),
]
RESOLVE = """
import sys
from kvgate.engine.loading.model_source import resolve_model
from kvgate.engine.errors import ModelLoadError
for model, revision in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        print(resolve_model(model, revision or None))
    except ModelLoadError as exc:
        print("ModelLoadError:", exc)
"""


@pytest.fixture(scope="module")
def hf_home(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME holding org/tiny at one commit, which refs/main and refs/dev name."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--org--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    for branch in ("main", "dev"):
        (repo / "refs" / branch).write_text(COMMIT)
    return home


@pytest.fixture(scope="module")
def answers(hf_home: Path) -> dict[tuple[str, str], str]:
    """What `resolve_model` says to each of CASES, in one offline process."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, *(arg for case in CASES for arg in case)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(zip(CASES, done.stdout.splitlines(), strict=True))


def test_a_cached_snapshot_resolves_offline(
    hf_home: Path, answers: dict[tuple[str, str], str]
) -> None:
    snapshot = str(hf_home / "hub" / "models--org--tiny" / "snapshots" / COMMIT)
    assert answers["org/tiny", ""] == snapshot
    assert answers["org/tiny", "dev"] == snapshot
    assert answers["org/tiny", COMMIT] == snapshot


def test_an_uncached_model_or_revision_is_a_clear_error(
    answers: dict[tuple[str, str], str],
) -> None:
    assert answers["org/absent", ""].startswith(
        "ModelLoadError: Hub model 'org/absent' at revision 'main' is not in the Hub cache"
    )
    assert "at revision 'v2' is not in the Hub cache" in answers["org/tiny", "v2"]
