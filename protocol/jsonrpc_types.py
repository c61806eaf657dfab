"""The parsed shape of one inbound JSON-RPC message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RequestId = str | int


@dataclass(frozen=True, slots=True)
class Message:
    """A request (``id`` set) or a notification (``id`` None); params always a dict."""

    method: str
    params: dict[str, Any]
    id: RequestId | None = None

    @property
    def is_notification(self) -> bool:
        return self.id is None

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.params.get("_meta")
        return meta if isinstance(meta, dict) else {}
