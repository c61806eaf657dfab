"""From a fresh clone to a real answer: the README's first command, timed as a new user meets it.

    python benchmarks/first_start.py [--rev HEAD] [--keep] [--json PATH]

Clones the repository at ``--rev`` into an empty folder and runs the README's first command
there verbatim, with pip's cache empty (torch from the machine's local wheel, every other
package from the index, the CPU kernels compiled) and a kernel cache of its own; meanwhile it
sends the README's first curl example every half second until it answers. Then it stops the
server and starts it again (``kvgate serve``: the same install) and times that answer too.
Each phase is read off the output as it arrives: each pip install done (its "Successfully
installed" line: torch, kvgate with its kernels, the model), the server's first line, ready
(its "ready in" line), the first answer. The answer is printed, so a reader sees it is
a real one. Run it on a quiet machine: it is a wall-clock figure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/

from benchmarks import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ANSWER_WAIT_S = 900  # a bound on the whole first start, however slow the machine


def readme_commands(readme: str) -> tuple[str, str]:
    """The README's first command (install and serve) and its first curl example."""
    first = re.search(r"```bash\n(.+?)\n", readme)
    curl = re.search(r"```bash\n(curl .+?)\n```", readme, re.S)
    assert first and curl, "the README's first command or curl example is gone"
    return first.group(1), curl.group(1)


class Watched:
    """A process whose output lines are kept with the time each arrived."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str], began: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(
            ["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, args=(began,), daemon=True)
        self._reader.start()

    def _read(self, began: float) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic() - began, line.rstrip()))

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def stop(self) -> None:
        """SIGINT to its process group (the server drains and exits), then SIGKILL."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._reader.join(5)


def answer(curl: str, cwd: Path, began: float, server: Watched) -> tuple[float, str]:
    """Seconds from ``began`` to the curl example's first answer, and the answer."""
    while time.monotonic() - began < ANSWER_WAIT_S:
        if server.process.poll() is not None:
            tail = "\n".join(line for _, line in server.lines[-20:])
            raise SystemExit(f"the command ended ({server.process.returncode}):\n{tail}")
        done = subprocess.run(["bash", "-c", curl], cwd=cwd, capture_output=True, text=True)
        if done.returncode == 0 and '"choices"' in done.stdout:
            return time.monotonic() - began, done.stdout
        time.sleep(0.5)
    raise SystemExit(f"no answer within {ANSWER_WAIT_S} s")


def phases(server: Watched, answered: float) -> dict[str, Any]:
    installed = [t for t, line in server.lines if line.startswith("Successfully installed")]
    return {
        **{f"pip_install_{i + 1}_done_s": t for i, t in enumerate(installed)},
        "server_first_line_s": server.first(r"\d\d:\d\d:\d\d,\d+ kvgate"),
        "ready_s": server.first(r"ready in"),
        "answer_s": answered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--keep", action="store_true", help="keep the clone (default: removed)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kvgate-first-start."))
    clone = folder / "kvgate"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", args.rev], check=True)
    command, curl = readme_commands((clone / "README.md").read_text())
    env = {
        key: value for key, value in os.environ.items()
        if key not in ("VIRTUAL_ENV", "PYTHONPATH") and not key.startswith("KVGATE_")
    }  # fmt: skip
    env |= {"PIP_CACHE_DIR": str(folder / "pip-cache"), "KVGATE_CACHE_DIR": str(folder / "cache")}
    env["PATH"] = os.pathsep.join(
        p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT))
    )
    print(f"{record.cpu_model()}, {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}")
    print(f"$ {command}")
    results: list[dict[str, Any]] = []
    try:
        began = time.monotonic()
        server = Watched(command, clone, env, began)
        try:
            answered, reply = answer(curl, clone, began, server)
        finally:
            server.stop()
        first = {"start": "fresh clone", **phases(server, answered)}
        results.append(first)
        print(f"answer: {reply.strip()[:400]}")
        began = time.monotonic()
        again = ". .venv/bin/activate && kvgate serve"
        server = Watched(again, clone, env, began)
        try:
            answered, _ = answer(curl, clone, began, server)
        finally:
            server.stop()
        results.append({"start": "second start", **phases(server, answered)})
        for row in results:
            figures = "  ".join(
                f"{key.removesuffix('_s').replace('_', ' ')} {value:.1f} s"
                for key, value in row.items()
                if isinstance(value, float)
            )
            print(f"{row['start']:13} {figures}")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    record.write(args.json, "first_start", results)


if __name__ == "__main__":
    main()
