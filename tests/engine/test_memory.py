"""Importing the engine puts torch's large CPU allocations (the KV cache, the weights) on
transparent huge pages, unless the user opted out with ``THP_MEM_ALLOC_ENABLE=0``
(kvgate/engine/memory.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# A fresh interpreter: the engine first, then a KV cache of 64 MiB, touched; its huge-page KiB.
PROBE = textwrap.dedent(
    """
    import kvgate.engine, torch
    from kvgate.engine.attention import allocate_kv_caches

    caches = allocate_kv_caches(1, 2048, 4, 16, 64, torch.float32, "cpu")  # 2 x 32 MiB
    caches[0].k.fill_(1.0)
    caches[0].v.fill_(1.0)
    rollup = open("/proc/self/smaps_rollup").read()
    print(next(line.split()[1] for line in rollup.splitlines() if line.startswith("AnonHuge")))
    """
)


def _mode() -> str | None:
    """The kernel's THP mode (always, madvise, never), None where it has none."""
    if not THP_MODE.exists() or not Path("/proc/self/smaps_rollup").exists():
        return None
    chosen = re.search(r"\[(\w+)\]", THP_MODE.read_text())
    return chosen.group(1) if chosen else None


def _huge_kib(**env: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env,
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip())


@pytest.mark.skipif(_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_the_kv_cache_lies_on_huge_pages() -> None:
    assert _huge_kib() >= 32 * 1024


@pytest.mark.skipif(_mode() != "madvise", reason="only where pages are huge on request")
def test_the_user_can_opt_out() -> None:
    assert _huge_kib(THP_MEM_ALLOC_ENABLE="0") == 0
