"""An approximate radix tree of the prompts routed to one worker, for the cache_aware policy.

"Approximate": it records what the router *sent*, not what the worker's KV cache holds (which
evicts on its own schedule, tokenizes differently, and may have been flushed); it only has to be
right often enough to send a prompt where its prefix probably is.

Keys are strings. A text prompt is its characters; a token-id prompt is mapped to one character
per id (see `token_key`), marked so that text and token keys never match each other. Edges are
compressed: each child holds a substring, keyed in its parent by its first character.

    root ─"You are a helpful"─┬─" assistant. Q1"   (leaf)
                              └─" bot. Q2"         (leaf)

Size is counted in key characters; past `max_chars` the least recently used leaves are dropped
until the tree is below `evict_to` x max_chars (hysteresis, so eviction is not paid per insert).
"""

from __future__ import annotations

import heapq
import itertools

_TOKEN_MARK = "\x00ids\x00"
_TOKEN_BASE = 0x100
_MAX_CODEPOINT = 0x10FFFF


def token_key(token_ids: list[int]) -> str:
    """One character per token id (ids beyond the Unicode range wrap: the tree is approximate)."""
    span = _MAX_CODEPOINT - _TOKEN_BASE
    return _TOKEN_MARK + "".join(chr(_TOKEN_BASE + (t % span)) for t in token_ids)


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by slice comparisons (C speed) and bisection."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("children", "edge", "last_access", "parent")

    def __init__(self, edge: str, parent: _Node | None, last_access: int):
        self.edge = edge
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_access = last_access


class PrefixTree:
    def __init__(self, max_chars: int, evict_to: float = 0.8):
        self.max_chars = max_chars
        self.evict_to = evict_to
        self.root = _Node("", None, 0)
        self.num_chars = 0
        self._clock = itertools.count(
            1
        )  # logical time: LRU order without calling time()

    def match(self, key: str) -> int:
        """Length of the longest prefix of `key` in the tree (read-only)."""
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            n = common_prefix_len(child.edge, key[i : i + len(child.edge)])
            i += n
            if n < len(child.edge):
                break
            node = child
        return i

    def insert(self, key: str) -> None:
        """Add `key`, marking its whole path as just used; evicts if the tree grew past its bound."""
        now = next(self._clock)
        node, i = self.root, 0
        node.last_access = now
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = _Node(key[i:], node, now)
                node.children[key[i]] = leaf
                self.num_chars += len(leaf.edge)
                break
            n = common_prefix_len(child.edge, key[i : i + len(child.edge)])
            if n < len(child.edge):  # split: node ─edge[:n]─▶ mid ─edge[n:]─▶ child
                mid = _Node(child.edge[:n], node, now)
                node.children[key[i]] = mid
                child.edge = child.edge[n:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            child.last_access = now
            node, i = child, i + n
        if self.num_chars > self.max_chars:
            self.evict(int(self.max_chars * self.evict_to))

    def evict(self, target_chars: int) -> None:
        """Drop least recently used leaves until at most `target_chars` remain."""
        heap = [
            (n.last_access, id(n), n)
            for n in self._nodes()
            if not n.children and n is not self.root
        ]
        heapq.heapify(heap)
        while heap and self.num_chars > target_chars:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.num_chars -= len(leaf.edge)
            if not parent.children and parent is not self.root:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def clear(self) -> None:
        self.root = _Node("", None, 0)
        self.num_chars = 0

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
