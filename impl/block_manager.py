"""A pool of fixed-size KV blocks: a free list and the block tables drawn from it.

The same class manages the GPU pool (without prefix caching) and the CPU swap pool. A
block table is a plain
``list[int]`` owned by its ``Sequence``; the manager grows, frees and (for a rolled-back
step) un-grows it. Every operation costs O(blocks touched): nothing scans the pool or
the requests.

Allocation order is nano-vllm's: the free list is a FIFO, blocks are taken from its
head and freed blocks go to its tail, so a freshly freed block is reused last
(initially blocks come out as 0, 1, 2, ...). ``unallocate`` and ``unfree`` are the
exact inverses of the last ``allocate``/``grow`` and ``free``: applied in reverse
order they restore the free list block for block, which is how a failed step is
rolled back (see ``Scheduler.rollback``).

``BlockPool`` is the GPU pool's interface, the one the scheduler holds: this class or,
with prefix caching, ``impl.prefix_cache.PrefixCachingBlockManager``. As vLLM's
``KVCacheManager`` answers ``get_computed_blocks()`` whether caching is on or off, the
phases ask every pool the caching questions, and this one answers them with no-ops: no
block is ever cached, so nothing hits, nothing gets a key and nothing is reclaimed.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from spec.types import KVSchedError, PrefixCacheState

if TYPE_CHECKING:
    from impl.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``: the blocks of ``b`` tokens that hold ``a`` tokens."""
    return -(-a // b)


class BlockAllocationError(KVSchedError, RuntimeError):
    """A block operation that would break conservation (R2): double free, over-allocation."""


class BlockPool(Protocol):
    """The GPU pool as the scheduler uses it, with or without prefix caching (PC1-PC9)."""

    num_blocks: int

    # Allocation (R2, PC5, PC6).
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    def grow(self, table: list[int], num_blocks: int) -> None: ...
    def free(self, table: list[int]) -> None: ...

    # The caching questions (PC2-PC4): the longest cached prefix, how many of its blocks
    # are free, taking it, keying the blocks a chunk fills, unkeying an undone chunk's.
    def lookup(self, seq: Sequence) -> list[int]: ...
    def num_evictable(self, blocks: list[int]) -> int: ...
    def touch(self, table: list[int], blocks: list[int]) -> None: ...
    def cache_blocks(self, seq: Sequence, num_computed: int, num_tokens: int) -> None: ...
    def uncache_blocks(self, table: list[int], num_computed: int, num_tokens: int) -> None: ...

    # One step's journal and its rollback (``impl/rollback.py``).
    def begin(self) -> None: ...
    def end(self) -> None: ...
    def undo(self) -> None: ...
    def shrink(self, table: list[int], num_blocks: int) -> None: ...
    def unfree(self, blocks: list[int]) -> None: ...
    def reclaimed_blocks(self) -> list[int]: ...
    @property
    def num_reclaimed(self) -> int: ...

    # The spec's view and the tests' checks.
    def observe(self) -> PrefixCacheState | None: ...
    def ref_count(self, block: int) -> int: ...
    def check(self) -> None: ...


class BlockManager:
    """``num_blocks`` blocks, numbered ``0 .. num_blocks-1``; free + owned == total."""

    __slots__ = ("_free", "_is_free", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = bytearray(b"\x01" * num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free list."""
        table: list[int] = []
        self.grow(table, num_blocks)
        return table

    def grow(self, table: list[int], num_blocks: int) -> None:
        """Extend ``table`` to ``num_blocks`` blocks (vLLM's ``append_slots``)."""
        need = num_blocks - len(table)
        if need <= 0:
            return
        free = self._free
        if need > len(free):
            raise BlockAllocationError(f"need {need} blocks, only {len(free)} free")
        is_free = self._is_free
        for _ in range(need):
            block = free.popleft()
            is_free[block] = 0
            table.append(block)

    def free(self, table: list[int]) -> None:
        """Return every block of ``table`` to the tail of the free list and empty it."""
        is_free = self._is_free
        for block in table:
            if is_free[block]:
                raise BlockAllocationError(f"block {block} freed twice")
        # Checked first so a double free changes nothing.
        if len(set(table)) != len(table):
            raise BlockAllocationError(f"block table {table} holds a block twice")
        for block in table:
            is_free[block] = 1
        self._free.extend(table)
        table.clear()

    # --- exact inverses, for rolling a step back ----------------------------------------

    def shrink(self, table: list[int], num_blocks: int) -> None:
        """Undo ``grow(table, ...)``: give back the blocks past ``num_blocks``."""
        if num_blocks < len(table):
            self.unallocate(table[num_blocks:])
            del table[num_blocks:]

    def unallocate(self, blocks: list[int]) -> None:
        """Undo the allocation of ``blocks``: put them back at the head, in order."""
        free = self._free
        is_free = self._is_free
        for block in reversed(blocks):
            if is_free[block]:
                raise BlockAllocationError(f"block {block} is already free")
            is_free[block] = 1
            free.appendleft(block)

    def unfree(self, blocks: list[int]) -> None:
        """Undo ``free(blocks)``: take them back from the tail of the free list."""
        free = self._free
        n = len(blocks)
        if n == 0:
            return
        if n > len(free) or any(free[k - n] != blocks[k] for k in range(n)):
            raise BlockAllocationError(f"blocks {blocks} are not the last ones freed")
        is_free = self._is_free
        for _ in range(n):
            is_free[free.pop()] = 0

    # --- the caching questions, for a pool that caches nothing ---------------------------

    def lookup(self, seq: Sequence) -> list[int]:
        """PC3 without a cache: nothing hits."""
        return []

    def num_evictable(self, blocks: list[int]) -> int:
        return 0

    def touch(self, table: list[int], blocks: list[int]) -> None:
        """Nothing hit, so there is nothing to take."""

    def cache_blocks(self, seq: Sequence, num_computed: int, num_tokens: int) -> None:
        """No block gets a key."""

    def uncache_blocks(self, table: list[int], num_computed: int, num_tokens: int) -> None:
        """No block has a key."""

    def begin(self) -> None:
        """Nothing to journal: ``shrink``, ``unallocate`` and ``unfree`` undo a step."""

    def end(self) -> None:
        """The step committed; nothing was journaled."""

    def undo(self) -> None:
        """Nothing was journaled."""

    def reclaimed_blocks(self) -> list[int]:
        """No cached block is ever reclaimed."""
        return []

    @property
    def num_reclaimed(self) -> int:
        return 0

    def observe(self) -> PrefixCacheState | None:
        """None: the spec's state has no block pool with prefix caching off."""
        return None

    def ref_count(self, block: int) -> int:
        """1 for a block in a table, 0 for a free one: nothing is shared."""
        return 1 - self._is_free[block]

    def check(self) -> None:
        """Assert conservation of this pool (for tests): the free list is a set of ids."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise BlockAllocationError("a block is on the free list twice")
        flagged = {b for b in range(self.num_blocks) if self._is_free[b]}
        if flagged != set(free):
            raise BlockAllocationError("free flags disagree with the free list")
