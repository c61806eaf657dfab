"""Suffix decoding: a trie counting every run of up to ``depth`` tokens of a sequence, and the
speculation it supports (vLLM's ``suffix`` method, after arctic-inference's suffix trees).

    fed:  a b c a b d a b          trie (counts): a:3 ─ b:3 ─┬ c:1 ─ a:1 …
                                                             └ d:1 ─ a:1 …
    context ends "a b": the node a→b has seen c once and d once in 3 occurrences, so each
    continuation is estimated at 1/3 (the current occurrence has none yet)

A proposal tries every match length m of the context's tail that the trie holds with a
continuation; from each it follows the most frequent child while the product of the
estimated probabilities stays >= ``min_prob``, for at most ``spec_factor * m`` tokens, and the
path with the largest expected accepted length (the sum of those products) wins. The depth
bounds match plus speculation. ``ReplyCache`` keeps finished replies in one trie per hash
root (model, adapter, tenant salt), so no tenant is ever proposed another tenant's text.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0
_SHIFT = 32  # an edge's key: its parent node << 32 | its token (token ids are below 2**32)


@dataclass(frozen=True)
class SuffixLimits:
    depth: int
    spec_factor: float
    min_prob: float


class SuffixTrie:
    """Counts of every run of at most ``depth`` tokens of the sequences fed to it.

    Nodes are integers in flat containers: the edges in one dict, counts and tokens in lists,
    each node's children in an ``array`` (which the garbage collector does not track). Held as
    an object per node, a request's few thousand new runs each step set off collections that
    scanned the engine's whole heap: 9% of a story's decode time once the engine had served a
    few requests."""

    def __init__(self, depth: int):
        self.depth = depth
        self._edges: dict[int, int] = {}  # parent << 32 | token -> child
        self._counts = [0]  # by node; the root's stays 0
        self._tokens = [-1]  # by node: the token on the edge into it
        self._children: dict[int, array[int]] = {}  # by node, in the order first seen
        self._free: list[int] = []  # nodes removed, to reuse
        self._open: list[int] = []  # nodes of the runs ending at the last token fed, by length

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the current sequence: O(depth) per token."""
        counts = self._counts
        for token in tokens:
            ends = [ROOT, *self._open]
            self._open = []
            for length, node in enumerate(ends, start=1):
                child = self._child(node, token)
                counts[child] += 1
                if length < self.depth:
                    self._open.append(child)

    def _child(self, node: int, token: int) -> int:
        key = node << _SHIFT | token
        child = self._edges.get(key)
        if child is None:
            if self._free:
                child = self._free.pop()
                self._counts[child], self._tokens[child] = 0, token
            else:
                child = len(self._counts)
                self._counts.append(0)
                self._tokens.append(token)
            self._edges[key] = child
            self._children.setdefault(node, array("q")).append(child)
        return child

    def end_sequence(self) -> None:
        """The next tokens fed start a new sequence (no run spans the two)."""
        self._open = []

    def remove(self, tokens: Sequence[int]) -> None:
        """Forget a sequence fed before as a whole; nodes whose count falls to 0 go, with
        everything below them."""
        counts = self._counts
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start : start + self.depth]:
                child = self._edges[node << _SHIFT | token]
                counts[child] -= 1
                if counts[child] == 0:
                    self._drop(node, child)
                    break
                node = child

    def _drop(self, parent: int, node: int) -> None:
        del self._edges[parent << _SHIFT | self._tokens[node]]
        self._children[parent].remove(node)
        below = [node]
        while below:
            gone = below.pop()
            for child in self._children.pop(gone, ()):
                del self._edges[gone << _SHIFT | self._tokens[child]]
                below.append(child)
            self._free.append(gone)

    def _find(self, run: Sequence[int]) -> int | None:
        node: int | None = ROOT
        for token in run:
            if node is None:
                return None
            node = self._edges.get(node << _SHIFT | token)
        return node

    def count(self, run: Sequence[int]) -> int:
        """How many times ``run`` occurs in the sequences fed (0 if at all longer than
        ``depth``)."""
        node = self._find(run)
        return 0 if node is None else self._counts[node]

    @property
    def empty(self) -> bool:
        return not self._children.get(ROOT)

    def propose(
        self, context: Sequence[int], k: int, limits: SuffixLimits
    ) -> tuple[float, list[int]]:
        """The best speculation (expected accepted length, tokens) of up to ``k`` tokens after
        ``context`` (whose tail this trie may or may not hold)."""
        best: tuple[float, list[int]] = (0.0, [])
        for m in range(1, min(len(context), self.depth - 1) + 1):
            node = self._find(context[-m:])
            if node is None:
                break  # a longer tail holds this one: absent too
            candidate = self._follow(node, min(k, int(limits.spec_factor * m)), limits.min_prob)
            if candidate[0] >= best[0] and candidate[1]:
                best = candidate
        return best

    def _follow(self, node: int, limit: int, min_prob: float) -> tuple[float, list[int]]:
        """The most frequent path below ``node`` (ties: the child first seen): (sum of its
        cumulative probabilities, tokens)."""
        counts = self._counts
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit:
            children = self._children.get(node)
            if not children:
                break
            child = max(children, key=counts.__getitem__)
            prob *= counts[child] / counts[node]
            if prob < min_prob:
                break
            tokens.append(self._tokens[child])
            score += prob
            node = child
        return score, tokens


class ReplyCache:
    """Finished replies, one trie per hash root (model, adapter, tenant salt), the oldest of
    all forgotten first beyond ``capacity`` replies."""

    def __init__(self, capacity: int, depth: int):
        self.capacity = capacity
        self.depth = depth
        self._tries: dict[bytes, SuffixTrie] = {}
        self._order: deque[tuple[bytes, list[int]]] = deque()

    def add(self, root: bytes, reply: list[int]) -> None:
        if self.capacity <= 0 or not reply:
            return
        trie = self._tries.get(root)
        if trie is None:
            trie = self._tries[root] = SuffixTrie(self.depth)
        trie.extend(reply)
        trie.end_sequence()
        self._order.append((root, reply))
        while len(self._order) > self.capacity:
            old_root, old = self._order.popleft()
            old_trie = self._tries[old_root]
            old_trie.remove(old)
            if old_trie.empty:
                del self._tries[old_root]

    def propose(
        self, root: bytes, context: Sequence[int], k: int, limits: SuffixLimits
    ) -> tuple[float, list[int]]:
        trie = self._tries.get(root)
        return (0.0, []) if trie is None else trie.propose(context, k, limits)
