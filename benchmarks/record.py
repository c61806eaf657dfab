"""What a benchmark writes with ``--json PATH``: its figures beside the date, the CPU and the
command that measured them, for ``benchmarks/plot.py`` and the benchmarks page. No torch."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def write(path: str | None, benchmark: str, results: list[dict[str, Any]]) -> None:
    """Write ``results`` (one object per measurement) to ``path``, if one was given."""
    if path is None:
        return
    document = {
        "benchmark": benchmark,
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load": round(os.getloadavg()[0], 2),
        "command": " ".join(["python", *sys.argv]),
        "results": results,
    }
    Path(path).write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")
