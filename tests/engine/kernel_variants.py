"""The native library's variants a kernel test runs on: this machine's (``native``) and each
other ISA variant its CPU runs, AVX2 above all (the build an AVX2-only CPU gets)."""

from __future__ import annotations

from typing import Any

import pytest

import kvgate.engine.native as native
from kvgate.engine.config import cpu_flags
from kvgate.engine.native_variants import BY_NAME, host_variants


def ops_for(name: str) -> Any:
    """The op namespace of variant ``name`` (``native``: the one this machine loads), or a skip
    where the test cannot run it. The variant an install builds (see `host_variants`) must be
    there: a missing one fails the test instead of skipping it. AVX2's, the build an AVX2-only
    CPU gets, is built here at run time where the install left it out (once per cache)."""
    if not native.enabled():
        pytest.skip(f"{native.DISABLE_ENV}=0: the torch path serves")
    if name != "native":
        variant = BY_NAME[name]
        if not variant.cpu_flags <= cpu_flags():
            pytest.skip(f"this CPU does not run the {name} variant")
        if variant == native.variant():
            pytest.skip(f"{name} is this machine's own variant: the native case")
    ops = native.library(None if name == "native" else name)
    if ops is None and name == "avx2":
        ops = native.built(name)
    required = {v.name for v in host_variants(cpu_flags())} | {"native"}
    if ops is None:
        assert name not in required, f"the {name} library is not installed (pip install -e .)"
        pytest.skip(f"the {name} library is not installed (a wheel carries every variant)")
    return ops
