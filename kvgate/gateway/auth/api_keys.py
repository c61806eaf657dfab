"""API keys: ``--api-key KEY`` (one tenant, ``default``) and ``--api-keys-file FILE``.

The file holds one ``tenant: sha256-hex-of-key`` per line (``#`` comments and blank lines
skipped), so it never stores a usable key; it is re-read on SIGHUP, and a file that cannot be
read, is not UTF-8 or fails to parse leaves the keys in force unchanged (and is logged). Every stored digest is compared, in constant time,
so neither a key nor how many are configured leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from pathlib import Path

log = logging.getLogger("kvgate.auth")
TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")


class KeysFileError(ValueError):
    """The keys file is unreadable or has a bad line (the message names the line)."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys_file(text: str, source: str = "keys file") -> list[tuple[str, bytes]]:
    entries: list[tuple[str, bytes]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tenant, sep, value = (part.strip() for part in line.partition(":"))
        if not sep or not TENANT.match(tenant) or not DIGEST.match(value):
            raise KeysFileError(
                f"{source} line {number}: expected 'tenant: <64 hex digits of sha256(key)>'"
            )
        entries.append((tenant, bytes.fromhex(value)))
    return entries


class ApiKeys:
    def __init__(self, key: str | None = None, keys_file: str | None = None) -> None:
        self._static = [("default", digest(key))] if key else []
        self._file = keys_file
        self._entries = self._static + (self._read() if keys_file else [])

    def __bool__(self) -> bool:
        return bool(self._static or self._file)

    def tenant_of(self, token: str) -> str | None:
        """The tenant whose key this is, else None (all digests compared, constant time)."""
        given = digest(token)
        found = None
        for tenant, expected in self._entries:
            if hmac.compare_digest(given, expected) and found is None:
                found = tenant
        return found

    def reload(self) -> None:
        """Re-read the keys file; on error keep serving the keys already loaded."""
        if not self._file:
            return
        try:
            entries = self._read()
        except KeysFileError as exc:
            log.error("API keys file not reloaded, the previous keys stay in force: %s", exc)
            return
        self._entries = self._static + entries
        log.info("API keys file reloaded: %d keys", len(entries))

    def _read(self) -> list[tuple[str, bytes]]:
        assert self._file is not None
        try:
            text = Path(self._file).read_bytes().decode("utf-8")
        except OSError as exc:
            raise KeysFileError(f"cannot read API keys file {self._file}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise KeysFileError(
                f"API keys file {self._file} is not UTF-8 text: byte "
                f"0x{exc.object[exc.start]:02x} at offset {exc.start}"
            ) from None
        return parse_keys_file(text, self._file)
