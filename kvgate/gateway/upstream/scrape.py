"""An upstream's own load figures, read from its Prometheus ``/metrics`` every few seconds.

vLLM exports ``vllm:num_requests_waiting`` / ``vllm:num_requests_running`` and
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before v0.10), kvgate the same
names, SGLang ``sglang:num_queue_reqs`` / ``sglang:num_running_reqs`` / ``sglang:token_usage``.
A series per engine (data parallel ranks, several models) is summed (counts) or maxed (usage).
An upstream is a remote process, so its figures are checked like input: a body the
Prometheus parser rejects, or a value that is not a finite count >= 0 (a usage above 1), is
dropped and counted, never routed on. Only the lines that name a figure read go to the
parser (found by ``str.find``: the parser spends ~20 µs a line, four seconds on an 8 MiB
page, on the event loop), and a page naming them more than ``MAX_MENTIONS`` times is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# figure → the metric names that report it, first found wins
NAMES = {
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
}
_FIGURE = {name: figure for figure, names in NAMES.items() for name in names}
# Lines a page may have that mention the names above: their HELP and TYPE, and one sample
# per engine, model or adapter (vLLM: a few).
MAX_MENTIONS = 1024
_DECLARED = ("# HELP ", "# TYPE ")


@dataclass(frozen=True, slots=True)
class Scraped:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0


class ScrapeError(ValueError):
    """The body is not Prometheus text."""


def relevant(text: str) -> str:
    """The lines of a ``/metrics`` body that declare or sample a figure read, each name's
    in page order (ScrapeError past ``MAX_MENTIONS`` lines that mention one)."""
    kept, mentions = [], 0
    for name in _FIGURE:
        at = text.find(name)
        while at >= 0:
            mentions += 1
            if mentions > MAX_MENTIONS:
                raise ScrapeError(f"over {MAX_MENTIONS} lines name the load figures")
            declared = text[max(at - 7, 0) : at] in _DECLARED
            start = at - 7 if declared else at
            end = text.find("\n", at)
            end = len(text) if end < 0 else end
            after = text[at + len(name) : at + len(name) + 1]
            if (start == 0 or text[start - 1] == "\n") and after in ("{", " ", "\t"):
                kept.append(text[start:end])
            at = text.find(name, end)
    return "".join(line + "\n" for line in kept)


def parse(text: str) -> tuple[Scraped | None, int]:
    """The load figures in a ``/metrics`` body (None when it has none of them) and how many
    samples were refused as invalid. ScrapeError when the body does not parse."""
    found: dict[str, dict[str, list[float]]] = {}
    invalid = 0
    text = relevant(text)
    try:
        for family in text_string_to_metric_families(text):
            figure = _FIGURE.get(family.name)
            if figure is None:
                continue
            for sample in family.samples:
                if sample.name != family.name:  # _created and the like
                    continue
                value = sample.value
                if not math.isfinite(value) or value < 0 or (figure == "kv_usage" and value > 1):
                    invalid += 1
                    continue
                found.setdefault(figure, {}).setdefault(family.name, []).append(value)
    except (ValueError, TypeError, IndexError) as exc:  # what the parser raises on garbage
        raise ScrapeError(f"not Prometheus text: {exc}") from None
    if not found:
        return None, invalid
    figures: dict[str, float] = {}
    for figure, names in NAMES.items():
        values = next((found[figure][n] for n in names if n in found.get(figure, {})), None)
        if values is not None:
            figures[figure] = max(values) if figure == "kv_usage" else sum(values)
    return Scraped(**figures), invalid
