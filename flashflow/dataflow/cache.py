"""Caches of a fixed size in bytes, fed one access at a time.

Blocks have sizes (edge tiles are smaller), so capacity is counted in bytes: a miss inserts the
block and evicts until it fits; a block larger than the whole cache is never kept.

Two replacement policies:
- ``LRUCache``: least recently used, what GPU L2s approximate.
- ``BeladyCache``: evicts the block whose next use is furthest in the future, and does not keep
  an incoming block that is needed later than everything it would displace. With equal block
  sizes this is Belady's optimal policy (the fewest misses any cache of that size can have);
  with mixed sizes it is the usual furthest-next-use heuristic, not a proven optimum. It needs
  the whole future trace, which the model knows because timing does not depend on hits.

``PartitionedL2`` is an L2 cut into equal LRU partitions joined by a crossbar, as on the A100
and H100 (two partitions of half the L2 each). Every SM reads through its *near* partition,
which keeps what its SMs read, so data read on both sides is held twice and the capacity left
for shared data is about half. What a near miss costs is the ``sharing`` rule:

- ``"home"``: every line has a home partition (addresses interleave across partitions, so each
  block is split into one equal piece per partition); the home is the point of coherence. A
  near miss on a piece homed elsewhere asks its home over the crossbar: a hit there costs no
  DRAM bytes (Nsight Compute counts such fills as L2-to-L2 ``ltcfabric`` traffic), a miss
  fills both the home and the near partition from DRAM.
- ``"far"``: no homes; a near miss that some other partition holds is copied across without
  DRAM traffic, otherwise it is read from DRAM into the near partition only.
- ``"copies"``: partitions never serve each other; every near miss reads DRAM (an upper bound
  of duplication).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Hashable

NEVER = float("inf")


def _capacity(capacity: int) -> int:
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 bytes, got {capacity!r}")
    return capacity


class LRUCache:
    def __init__(self, capacity: int):
        self.capacity = _capacity(capacity)
        self.used = 0
        self._blocks: OrderedDict[Hashable, int] = OrderedDict()

    def access(self, key: Hashable, size: int, next_use: float = NEVER) -> bool:
        """Touch ``key``; return True on a hit. A miss brings the block in (if it fits).
        ``next_use`` is ignored (the signature is shared with BeladyCache)."""
        blocks = self._blocks
        if key in blocks:
            blocks.move_to_end(key)
            return True
        if size <= self.capacity:
            blocks[key] = size
            self.used += size
            while self.used > self.capacity:
                _, evicted = blocks.popitem(last=False)
                self.used -= evicted
        return False

    def __contains__(self, key) -> bool:
        return key in self._blocks

    def contents(self) -> list:
        """Keys held, least recently used first."""
        return list(self._blocks)

    def state(self) -> tuple:
        """Everything that decides future hits: a hashable snapshot for searches."""
        return tuple(self._blocks)

    def copy(self) -> "LRUCache":
        other = LRUCache(self.capacity)
        other.used = self.used
        other._blocks = self._blocks.copy()
        return other


class BeladyCache:
    def __init__(self, capacity: int):
        self.capacity = _capacity(capacity)
        self.used = 0
        self._blocks: dict[Hashable, tuple[int, float]] = {}   # key -> (size, next use)
        self._heap: list[tuple[float, int, Hashable]] = []      # (-next use, tiebreak, key)
        self._tiebreak = 0

    def _push(self, key, next_use):
        self._tiebreak += 1
        heapq.heappush(self._heap, (-next_use, self._tiebreak, key))

    def _furthest(self):
        """Key held whose next use is furthest; stale heap entries are dropped lazily."""
        heap = self._heap
        while heap:
            neg_next, _, key = heap[0]
            entry = self._blocks.get(key)
            if entry is not None and entry[1] == -neg_next:
                return key, -neg_next
            heapq.heappop(heap)
        return None, None

    def access(self, key: Hashable, size: int, next_use: float = NEVER) -> bool:
        blocks = self._blocks
        if key in blocks:
            blocks[key] = (blocks[key][0], next_use)
            self._push(key, next_use)
            return True
        if size > self.capacity or next_use == NEVER:
            return False  # never used again: keeping it can only displace something useful
        while self.used + size > self.capacity:
            victim, victim_next = self._furthest()
            if victim_next < next_use:
                return False  # everything held is needed sooner than the newcomer: bypass
            self.used -= blocks.pop(victim)[0]
            heapq.heappop(self._heap)
        blocks[key] = (size, next_use)
        self.used += size
        self._push(key, next_use)
        return False

    def __contains__(self, key) -> bool:
        return key in self._blocks

    def contents(self) -> list:
        """Keys held, soonest next use first."""
        return sorted(self._blocks, key=lambda k: self._blocks[k][1])


class PartitionedL2:
    """``partitions`` LRUs of ``capacity // partitions`` bytes each; ``access`` takes the
    requesting SM's side (its near partition) and returns the DRAM bytes the access cost."""

    SHARING = ("home", "far", "copies")

    def __init__(self, capacity: int, partitions: int = 2, sharing: str = "home"):
        _capacity(capacity)
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"partitions must be a positive int, got {partitions!r}")
        if sharing not in self.SHARING:
            raise ValueError(f"sharing must be one of {self.SHARING}, got {sharing!r}")
        self.capacity = capacity
        self.sharing = sharing
        self.parts = [LRUCache(capacity // partitions) for _ in range(partitions)]
        self.fabric_bytes = 0    # bytes one partition filled from another, not from DRAM

    def _pieces(self, key, size) -> list:
        """A block's lines as one piece per home partition (sizes differ by at most 1 byte)."""
        n = len(self.parts)
        return [((key, p), size // n + (p < size % n)) for p in range(n)]

    def access(self, key: Hashable, size: int, side: int, next_use: float = NEVER) -> int:
        near = self.parts[side]
        if self.sharing == "home":
            dram = 0
            for (piece, piece_size), home in zip(self._pieces(key, size), self.parts):
                if near.access(piece, piece_size):
                    continue
                if home is not near and piece in home:
                    home.access(piece, piece_size)    # the home's copy served it: now recent
                    self.fabric_bytes += piece_size
                    continue
                home.access(piece, piece_size)        # DRAM fills the home (and the near copy)
                dram += piece_size
            return dram
        if near.access(key, size):
            return 0
        if self.sharing == "far":
            for other in self.parts:
                if other is not near and key in other:
                    other.access(key, size)
                    self.fabric_bytes += size
                    return 0
        return size

    def __contains__(self, key) -> bool:
        """Whether any partition holds the block (any of its pieces, under ``"home"``)."""
        if self.sharing == "home":
            return any(piece in p for piece, _ in self._pieces(key, 0) for p in self.parts)
        return any(key in p for p in self.parts)

    def contents(self) -> list:
        """Block keys held anywhere (pieces of a split block count once), partition 0 first."""
        seen: dict = {}
        for part in self.parts:
            for k in part.contents():
                seen.setdefault(k[0] if self.sharing == "home" else k, None)
        return list(seen)


POLICIES = {"lru": LRUCache, "belady": BeladyCache}


def make_cache(policy: str, capacity: int):
    try:
        return POLICIES[policy](capacity)
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}") from None
