"""The simulator's KV tiers, by blocks of `block_size` tokens named by chained hashes (as HiCache
names pages: block i's name covers every token before it, so a name is a whole prefix).

    DeviceCache  L1: the radix cache of one replica. Blocks are in the tree with a lock count;
                 unlocked ones are evictable, least recently released first, a request's deepest
                 blocks before its shallower ones (leaves before their parents, as the radix tree
                 evicts). Evicted blocks go to `on_evict` (demotion to L2).
    LRUBlocks    L2 (a replica's host pool) and L3 (storage, one per deployment: shared by every
                 replica): a bounded LRU set of block names.

Token accounting lives with the replica (what running requests hold privately); this module only
knows blocks. Whether an L3 hit is fetched, and how long a request waits for it, the replica asks
the engine's own functions (strata.cache.prefetch); which block goes first is this module's model
of the engine's LRU orders (the radix tree's leaves by last use, the host pool's and the file
backend's pages), not shared code: the engine orders tree nodes of any length, this blocks.
Matching is by whole blocks, so a simulated hit can be up to block_size - 1 tokens shorter than
the engine's (page_size 1 by default).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained names of the full blocks of `tokens`."""
    out, prev = [], 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(tokens[i : i + block_size])))
        out.append(prev)
    return out


class LRUBlocks:
    """A bounded set of block names, least recently used dropped first (capacity None: unbounded)."""

    def __init__(
        self, capacity_blocks: int | None, on_drop: Callable[[int], None] | None = None
    ):
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.on_drop = on_drop

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def put(self, h: int) -> None:
        if self.capacity == 0:
            return
        self.blocks[h] = None
        self.blocks.move_to_end(h)
        while self.capacity is not None and len(self.blocks) > self.capacity:
            dropped, _ = self.blocks.popitem(last=False)
            if self.on_drop is not None:
                self.on_drop(dropped)

    def run_from(self, hashes: Sequence[int], start: int, stop: int) -> int:
        """How many consecutive blocks hashes[start:stop] are here (touching them)."""
        n = 0
        for h in hashes[start:stop]:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n


class DeviceCache:
    """L1's prefix tree by blocks: name -> lock count; unlocked names in `evictable` (LRU order)."""

    def __init__(
        self, enabled: bool = True, on_evict: Callable[[int], None] | None = None
    ):
        self.enabled = enabled
        self.locks: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.on_evict = on_evict

    @property
    def num_blocks(self) -> int:
        return len(self.locks)

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """Leading blocks of hashes[:limit] in the tree."""
        if not self.enabled:
            return 0
        n = 0
        for h in hashes[:limit]:
            if h not in self.locks:
                break
            n += 1
        return n

    def lock(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            c = self.locks[h]
            if c == 0:
                del self.evictable[h]
            self.locks[h] = c + 1

    def unlock(self, hashes: Sequence[int]) -> None:
        for h in reversed(
            hashes
        ):  # deepest first: its parents end up more recently used
            c = self.locks[h] - 1
            self.locks[h] = c
            if c == 0:
                self.evictable[h] = None

    def insert_locked(self, h: int) -> bool:
        """Put block h in the tree, locked once more by the caller. True if it was new (the caller's
        private copy became the tree's); False if it was there (the caller's copy is a duplicate)."""
        if h in self.locks:
            self.lock((h,))
            return False
        self.locks[h] = 1
        return True

    def evict(self, num_blocks: int) -> int:
        """Evict up to num_blocks unlocked blocks, oldest first; returns how many went."""
        n = 0
        while n < num_blocks and self.evictable:
            h, _ = self.evictable.popitem(last=False)
            del self.locks[h]
            if self.on_evict is not None:
                self.on_evict(h)
            n += 1
        return n
