"""When a ``tools/call`` becomes a task: the caller's hint, else a predicted run time.

The rule (server-directed, per request, only for a request that declares the extension):

- ``_meta`` ``dev.kvgate/task: true`` always makes a task, ``false`` never does;
- otherwise a ``generate``/``chat`` call becomes a task when its predicted run is longer than
  ``--task-threshold-s``: ``max_tokens × n / rate`` plus, when requests are queued, the time
  the queue ahead takes to drain, ``waiting × run_s / running``.

``rate`` (tokens per second of one call, start to end) and ``run_s`` (one call's seconds) are
moving averages of the calls this process has finished, so the prediction follows the model,
the hardware and the load actually served; before the first call it uses a cautious prior
(20 tokens/s, CPU-like). ``max_tokens`` is an upper bound, so the rule errs toward a task:
a short answer to a large ``max_tokens`` just completes quickly, and a client that declared
the extension handles either result. A queued call waits for running ones to finish, which
leave at ``running / run_s`` per second: Little's law, without a model of the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.protocol.errors import invalid_params

HINT_KEY = "dev.kvgate/task"
TASK_TOOLS = frozenset(("generate", "chat"))
PRIOR_TOKENS_PER_S = 20.0
SMOOTHING = 0.2  # weight of the newest call in the moving averages


def hint(meta: Mapping[str, Any]) -> bool | None:
    """The caller's ``dev.kvgate/task``: True, False or None (absent); −32602 otherwise."""
    value = meta.get(HINT_KEY)
    if value is None or isinstance(value, bool):
        return value
    raise invalid_params(f"_meta[{HINT_KEY!r}] must be true or false")


@dataclass
class RunEstimate:
    tokens_per_s: float = PRIOR_TOKENS_PER_S
    run_s: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One finished call (its completion tokens and wall seconds)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        if self.run_s == 0.0:  # the first observation replaces the prior
            self.tokens_per_s, self.run_s = rate, seconds
            return
        self.tokens_per_s += SMOOTHING * (rate - self.tokens_per_s)
        self.run_s += SMOOTHING * (seconds - self.run_s)

    def predict_s(self, tokens: int, waiting: int = 0, running: int = 0) -> float:
        queue_s = waiting * self.run_s / max(1, running) if waiting else 0.0
        return tokens / self.tokens_per_s + queue_s


def predicted_tokens(arguments: Mapping[str, Any], default_max_tokens: int) -> int:
    """``max_tokens × n`` of a call's (validated) arguments."""
    max_tokens = arguments.get("max_tokens", default_max_tokens)
    n = arguments.get("n", 1)
    if not isinstance(max_tokens, int) or not isinstance(n, int):
        return 0
    return max(0, max_tokens) * max(1, n)
