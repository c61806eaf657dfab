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
    def request_id(self) -> RequestId:
        """The id of a request (a notification has none: answer those before asking)."""
        if self.id is None:
            raise ValueError("a notification has no id")
        return self.id

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.params.get("_meta")
        return meta if isinstance(meta, dict) else {}
