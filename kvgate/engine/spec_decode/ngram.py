"""N-gram prompt lookup: propose the tokens that followed the context's last n tokens where
they occurred before (vLLM's ``ngram`` method, same choice of match).

    context  ... a b c d [x y z] e f g ... a b [x y z]      (n = 3 matches, earlier)
    proposal                     e f g                      (up to k tokens)

The longest n in ``[min_n, max_n]`` whose last-n tokens occur earlier wins, and of its
occurrences the first one (what vLLM's reversed prefix-function scan finds); the proposal may
run into the context's own tail. The search is ``bytes.find`` over the context packed as
int32, so a step pays a C-speed scan of the context per n tried, no Python loop per token.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

_WIDTH = 4  # bytes per packed token id


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the first earlier occurrence of the longest suffix of
    ``tokens`` of ``min_n`` to ``max_n`` tokens; [] when none occurs."""
    total = len(tokens)
    if k <= 0 or total <= min_n:
        return []
    packed = array.array("i", tokens).tobytes()
    end = (total - 1) * _WIDTH  # an occurrence ends before the last token
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        start = _find_aligned(packed, packed[-n * _WIDTH :], end)
        if start >= 0:
            follow = start + n
            return list(tokens[follow : follow + k])
    return []


def _find_aligned(packed: bytes, pattern: bytes, end: int) -> int:
    """The first token index where ``pattern`` occurs in ``packed[:end]``; -1 if none."""
    at = packed.find(pattern, 0, end)
    while at >= 0 and at % _WIDTH:
        at = packed.find(pattern, at + 1, end)
    return at // _WIDTH if at >= 0 else -1
