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

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] | None = None  # None for a leaf: most nodes are leaves

    def child(self, token: int) -> _Node:
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = _Node()
        return node


@dataclass(frozen=True)
class SuffixLimits:
    depth: int
    spec_factor: float
    min_prob: float


class SuffixTrie:
    """Counts of every run of at most ``depth`` tokens of the sequences fed to it."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self._open: list[_Node] = []  # nodes of the runs ending at the last token fed, by length

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the current sequence: O(depth) per token."""
        for token in tokens:
            ends = [self.root, *self._open]
            self._open = []
            for length, node in enumerate(ends, start=1):
                child = node.child(token)
                child.count += 1
                if length < self.depth:
                    self._open.append(child)

    def end_sequence(self) -> None:
        """The next tokens fed start a new sequence (no run spans the two)."""
        self._open = []

    def remove(self, tokens: Sequence[int]) -> None:
        """Forget a sequence fed before as a whole; nodes whose count falls to 0 go."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                assert node.children is not None
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def _find(self, run: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for token in run:
            if node is None or node.children is None:
                return None
            node = node.children.get(token)
        return node

    @property
    def empty(self) -> bool:
        return not self.root.children

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
            candidate = _follow(node, min(k, int(limits.spec_factor * m)), limits.min_prob)
            if candidate[0] >= best[0] and candidate[1]:
                best = candidate
        return best


def _follow(node: _Node, limit: int, min_prob: float) -> tuple[float, list[int]]:
    """The most frequent path below ``node``: (sum of its cumulative probabilities, tokens)."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < limit and node.children:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / node.count
        if prob < min_prob:
            break
        tokens.append(token)
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
