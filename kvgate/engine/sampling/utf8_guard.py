"""Valid UTF-8 in constrained outputs, beside the grammar's own mask.

xgrammar's byte-level matcher takes some byte sequences as characters that no UTF-8 decoder
accepts: UTF-16 surrogates (``ED A0..BF ..``), overlong forms (``E0 80..9F``, ``F0 80..8F``,
``C0``, ``C1``) and code points past U+10FFFF (``F4 90..``, ``F5..FF``). A JSON string built
of them is valid to the grammar and U+FFFD to every reader (a ``maxLength: 6`` name came back
as ``'paily���'``). The guard bans every token holding such a sequence and, after a token that
ends on a lead byte whose second byte is restricted, every token whose first byte that lead
cannot take (RFC 3629's table): two packed masks per state, ANDed into the grammar's bitmask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A lead byte's second bytes that never make a valid character (RFC 3629, section 4).
FORBIDDEN_SECOND: dict[int, range] = {
    0xE0: range(0x80, 0xA0),  # overlong
    0xED: range(0xA0, 0xC0),  # UTF-16 surrogates
    0xF0: range(0x80, 0x90),  # overlong
    0xF4: range(0x90, 0xC0),  # past U+10FFFF
}
NEVER = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})  # bytes no valid UTF-8 holds


def invalid_inside(data: bytes) -> bool:
    """Whether ``data`` itself holds a byte or a lead/second-byte pair no UTF-8 text has."""
    for i, byte in enumerate(data):
        if byte in NEVER:
            return True
        second = FORBIDDEN_SECOND.get(byte)
        if second is not None and i + 1 < len(data) and data[i + 1] in second:
            return True
    return False


class Utf8Guard:
    """Per-vocabulary tables: which tokens may follow, given the restricted lead byte (or 0)
    that the output so far ends on."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int):
        valid, starts = [True] * vocab_size, [-1] * vocab_size  # lists: one tensor each, once
        self._trailing = [0] * vocab_size
        for token_id, data in enumerate(token_bytes[:vocab_size]):
            if not data:
                continue
            valid[token_id] = not invalid_inside(data)
            starts[token_id] = data[0]
            if data[-1] in FORBIDDEN_SECOND:
                self._trailing[token_id] = data[-1]
        allowed = torch.tensor(valid, dtype=torch.bool)
        first = torch.tensor(starts, dtype=torch.int32)
        self.masks = {0: _packed(allowed)}
        for lead, second in FORBIDDEN_SECOND.items():
            banned = (first >= second.start) & (first < second.stop)
            self.masks[lead] = _packed(allowed & ~banned)

    def lead_after(self, token_id: int) -> int:
        """The restricted lead byte an output ends on after ``token_id`` (0: none)."""
        return self._trailing[token_id] if 0 <= token_id < len(self._trailing) else 0


def _packed(allowed: torch.Tensor) -> torch.Tensor:
    """A bool vector as xgrammar's int32 bitmask words (bit j of word i: token 32 i + j)."""
    words = (allowed.numel() + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: allowed.numel()] = allowed.to(torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
