"""The members from a file that may change while the picker runs (as llm-d's file discovery).

One upstream base URL a line, ``#`` comments and blank lines ignored. The file is looked at
every ``POLL_S``; when its modification time or size changed it is read again (at most
``MAX_BYTES``, ``MAX_URLS`` lines) and the fleet's ``Membership.refresh`` admits the new
addresses once their ``/v1/models`` names the fleet's model (one not serving yet is asked
again each round) and drains those gone, exactly as it does for ``--upstream-dns``. A file that is missing or unreadable keeps the members
there were: a half-written file during a deploy must not empty the pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from kvgate.gateway.upstream.membership import Membership

logger = logging.getLogger("kvgate.epp")
POLL_S = 1.0
MAX_BYTES = 1 << 20
MAX_URLS = 4096


def read(path: str) -> list[str]:
    """The URLs the file lists, in order, each once (OSError, ValueError: unreadable)."""
    with Path(path).open("rb") as file:
        data = file.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError(f"{path}: over {MAX_BYTES} bytes")
    urls: list[str] = []
    for line in data.decode().splitlines():
        url = line.split("#", 1)[0].strip()
        if url:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{path}: not an http(s) URL: {url!r}")
            urls.append(url.rstrip("/"))
    if len(urls) > MAX_URLS:
        raise ValueError(f"{path}: over {MAX_URLS} URLs")
    return list(dict.fromkeys(urls))


class EndpointsFile:
    """Follows one file into a fleet's members."""

    def __init__(self, path: str, static: tuple[str, ...], members: Membership) -> None:
        self.path, self.static, self.members = path, static, members
        self._seen: tuple[int, int] | None = None

    def _stamp(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    async def follow(self) -> None:
        """Forever: each change of the file applied (cancel to end)."""
        while True:
            stamp = self._stamp()
            if stamp is not None and stamp != self._seen:
                try:
                    urls = read(self.path)
                except (OSError, ValueError, UnicodeDecodeError) as exc:
                    logger.warning("endpoints file %s: %s; keeping the members", self.path, exc)
                else:
                    self._seen = stamp
                    self.members.listed = tuple(dict.fromkeys([*self.static, *urls]))
                    try:
                        await self.members.refresh()
                    except Exception:  # noqa: BLE001 - one bad round must not end the loop
                        logger.exception("endpoints file %s: refresh failed", self.path)
                        self._seen = None
                    joined = {u.url for u in self.members.upstreams}
                    if any(url not in joined for url in self.members.listed):
                        self._seen = None  # one not serving yet: asked again at the next poll
            await asyncio.sleep(POLL_S)
