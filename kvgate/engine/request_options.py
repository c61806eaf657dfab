"""What a generation request carries besides its prompt and sampling parameters.

One type for every ``submit`` and ``generate`` (``AsyncLLM``, the engine process's client, the
gateway's engine backend), so a new per-request option is one field here, not a keyword
repeated in four signatures.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.engine.outputs import OutputKind


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """``cache_key`` routes the request (one conversation's calls to one replica);
    ``cache_salt`` keeps one tenant's cached blocks from another's; ``lora_name`` runs it with
    that loaded adapter; ``kind`` is the form its outputs take."""

    cache_key: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    kind: OutputKind = OutputKind.CUMULATIVE


DEFAULT_OPTIONS = RequestOptions()
