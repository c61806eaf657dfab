"""LoRA adapters as the server's flags and environment name them (vLLM's spellings).

``--lora-modules`` takes ``NAME=PATH`` or vLLM's JSON form ``{"name", "path",
"base_model_name"}``; the runtime endpoints ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` are served when ``--allow-runtime-lora-updating`` (or vLLM's own
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) says so: loading code paths from a request is for
trusted operators, as vLLM warns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvgate.gateway.settings import Settings

VLLM_RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str


def parse_lora_module(spec: str, base_model: str | None) -> LoRAModule:
    """One ``--lora-modules`` value; ValueError naming what is wrong. A JSON form's
    ``base_model_name`` must be the served model (kvgate serves one base model; None: not
    known yet, not checked)."""
    if spec.lstrip().startswith("{"):
        try:
            fields = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"{spec!r}: not JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"{spec!r}: not a JSON object")
        name, path = fields.get("name"), fields.get("path")
        base = fields.get("base_model_name")
        if base is not None and base_model is not None and base != base_model:
            raise ValueError(f"{spec!r}: base_model_name {base!r} is not the model served here")
    else:
        name, _, path = spec.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f'{spec!r}: give NAME=PATH or {{"name": …, "path": …}}')
    if name == base_model:
        raise ValueError(f"{spec!r}: {name!r} is the base model's own name")
    return LoRAModule(name, path)


def runtime_updating(settings: Settings, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the load/unload endpoints are served."""
    environ = os.environ if environ is None else environ
    vllm = environ.get(VLLM_RUNTIME_ENV, "").lower() in ("1", "true")
    return settings.allow_runtime_lora_updating or vllm
