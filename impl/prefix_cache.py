"""The GPU block pool with prefix caching (PC1-PC9 of docs/semantics.md).

Blocks are shared by reference count. Free blocks sit in a doubly linked free queue
(vLLM's ``FreeKVCacheBlockQueue``): allocation pops the head (the least recently
freed block), a freed block with a key is appended at the tail and one without a key
put at the head, and a hit on a free cached block unlinks it from the middle, all in
O(1). A full block is keyed by a chained hash,
``hash((parent_hash, block_tokens))``; the map from hash to blocks keeps, per hash,
the blocks in the order they got it, and a lookup compares the stored parent hash
and tokens (so two prefixes whose hashes collide are never confused, short of a
collision of the parent hashes too).

Every change to the pool between ``begin()`` and ``end()`` (one step's phases A-C)
is journaled; ``undo()`` replays the journal backwards, restoring the free queue's
order, the reference counts and the keys exactly, for a rolled-back step. Block
*tables* belong to the sequences and are restored by ``impl/rollback.py``, so
``shrink``/``unfree`` here only touch the table.

Over ~300 lines on purpose: the free queue, the reference counts, the key map and the
journal that undoes them change together in every operation, and each undo entry is
the inverse of one operation here; split apart they would have to expose each other's
internals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from impl.block_manager import BlockAllocationError
from spec.types import PrefixCacheState

if TYPE_CHECKING:
    from impl.sequence import Sequence

# A block's key as a chain, for observe(): (parent node, this block's tokens).
Node = tuple["Node | None", tuple[int, ...]]

_ROOT_HASH = 0  # the parent hash of a sequence's first block

# Journal entry kinds.
_UNLINK = 0  # (kind, block, previous block in the queue or the sentinel)
_LINK = 1  # (kind, block): linked into the queue (appended or prepended)
_REF = 2  # (kind, block, delta)
_SET_KEY = 3  # (kind, block)
_DROP_KEY = 4  # (kind, block, hash, parent hash, tokens, node, stamp)


def seq_block_hash(seq: Sequence, index: int, block_size: int) -> int:
    """The chained hash of ``seq``'s block ``index`` (which must be full), memoized."""
    hashes = seq.block_hashes
    nodes = seq.block_nodes
    tokens = seq.token_ids
    while len(hashes) <= index:
        i = len(hashes)
        parent = hashes[i - 1] if i else _ROOT_HASH
        chunk = tuple(tokens[i * block_size : (i + 1) * block_size])
        hashes.append(hash((parent, chunk)))
        nodes.append((nodes[i - 1] if i else None, chunk))
    return hashes[index]


def forget_hashes(seq: Sequence, num_tokens: int, block_size: int) -> None:
    """Drop the memoized hashes of blocks past ``num_tokens`` (restart drops outputs)."""
    del seq.block_hashes[num_tokens // block_size :]
    del seq.block_nodes[num_tokens // block_size :]


class PrefixCachingBlockManager:
    """``num_blocks`` GPU blocks shared by reference count, with a hash-keyed cache."""

    __slots__ = (
        "_by_hash",
        "_hash",
        "_in_queue",
        "_journal",
        "_next",
        "_node",
        "_num_free",
        "_parent",
        "_prev",
        "_ref",
        "_stamp",
        "_tokens",
        "block_size",
        "drop_key_on_free",
        "last_key_wins",
        "next_stamp",
        "num_blocks",
        "num_reclaimed",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        last_key_wins: bool = False,
        drop_key_on_free: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        #: nano-vllm/last-key-wins: a block given a key takes it from the block that had it.
        self.last_key_wins = last_key_wins
        #: nano-vllm/drop-key-on-free: a freed block loses its key and joins the tail.
        self.drop_key_on_free = drop_key_on_free
        sentinel = num_blocks
        # Circular doubly linked list through the sentinel; initially 0, 1, 2, ...
        self._next = [*range(1, num_blocks + 1), 0]
        self._prev = [sentinel, *range(num_blocks)]
        if num_blocks == 0:
            self._next = [sentinel]
            self._prev = [sentinel]
        self._in_queue = bytearray(b"\x01" * num_blocks)
        self._num_free = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._parent = [0] * num_blocks
        self._tokens: list[tuple[int, ...]] = [()] * num_blocks
        self._node: list[Node | None] = [None] * num_blocks
        self._stamp = [0] * num_blocks
        self.next_stamp = 0
        self._by_hash: dict[int, list[int]] = {}
        self._journal: list[tuple[object, ...]] | None = None
        self.num_reclaimed = 0  # keyed blocks reclaimed since the last begin()

    # --- counts -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._num_free

    # --- the free queue ---------------------------------------------------------------

    def _unlink(self, block: int) -> None:
        prev, nxt = self._prev[block], self._next[block]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._in_queue[block] = 0
        self._num_free -= 1
        if self._journal is not None:
            self._journal.append((_UNLINK, block, prev))

    def _insert_after(self, prev: int, block: int) -> None:
        nxt = self._next[prev]
        self._next[prev] = block
        self._prev[block] = prev
        self._next[block] = nxt
        self._prev[nxt] = block
        self._in_queue[block] = 1
        self._num_free += 1

    def _append(self, block: int) -> None:
        self._insert_after(self._prev[self.num_blocks], block)
        if self._journal is not None:
            self._journal.append((_LINK, block))

    def free_queue(self) -> list[int]:
        """The free blocks, head first (O(free): for observe and tests)."""
        blocks = []
        block = self._next[self.num_blocks]
        while block != self.num_blocks:
            blocks.append(block)
            block = self._next[block]
        return blocks

    # --- reference counts and keys -----------------------------------------------------

    def _add_ref(self, block: int, delta: int) -> None:
        self._ref[block] += delta
        if self._journal is not None:
            self._journal.append((_REF, block, delta))

    def _drop_key(self, block: int) -> None:
        """PC5: a reclaimed block leaves the cache."""
        if self._forget_key(block):
            self.num_reclaimed += 1

    def _forget_key(self, block: int) -> bool:
        """The block leaves the cache (journaled); whether it had a key."""
        block_hash = self._hash[block]
        if block_hash is None:
            return False
        same = self._by_hash[block_hash]
        same.remove(block)
        if not same:
            del self._by_hash[block_hash]
        if self._journal is not None:
            self._journal.append(
                (
                    _DROP_KEY,
                    block,
                    block_hash,
                    self._parent[block],
                    self._tokens[block],
                    self._node[block],
                    self._stamp[block],
                )
            )
        self._hash[block] = None
        self._node[block] = None
        return True

    def cache_blocks(self, seq: Sequence, num_computed: int, num_tokens: int) -> None:
        """PC2: key the blocks of ``seq`` that ``num_tokens`` computed tokens fill.

        Blocks that ``num_computed`` tokens already filled have their keys (given when
        they were scheduled, or hit); the others in the range get theirs now.
        """
        bs = self.block_size
        table = seq.block_table
        for index in range(num_computed // bs, num_tokens // bs):
            block = table[index]
            if self._hash[block] is not None:
                continue
            block_hash = seq_block_hash(seq, index, bs)
            parent = seq.block_hashes[index - 1] if index else _ROOT_HASH
            tokens = seq.block_nodes[index][1]
            stamp = self.next_stamp
            if self.last_key_wins:  # the key moves here and keeps its place in the order
                for other in self._by_hash.get(block_hash, ()):
                    if self._parent[other] == parent and self._tokens[other] == tokens:
                        stamp = self._stamp[other]
                        self._forget_key(other)
                        break
            if stamp == self.next_stamp:
                self.next_stamp += 1
            self._hash[block] = block_hash
            self._parent[block] = parent
            self._tokens[block] = tokens
            self._node[block] = seq.block_nodes[index]
            self._stamp[block] = stamp
            self._by_hash.setdefault(block_hash, []).append(block)
            if self._journal is not None:
                self._journal.append((_SET_KEY, block))

    def uncache_blocks(self, table: list[int], num_computed: int, num_tokens: int) -> None:
        """vllm-v1/undone-chunk-unkeyed: an undone chunk's blocks lose the keys
        ``cache_blocks`` gave them when it was scheduled (no forward will write them)."""
        bs = self.block_size
        for block in table[num_computed // bs : num_tokens // bs]:
            self._forget_key(block)

    def lookup(self, seq: Sequence) -> list[int]:
        """PC3: the blocks of the longest cached prefix, at most ``(num_tokens-1)//bs``."""
        bs = self.block_size
        by_hash = self._by_hash
        hit: list[int] = []
        parent = _ROOT_HASH
        for index in range((seq.num_tokens - 1) // bs):
            block_hash = seq_block_hash(seq, index, bs)
            match = None
            for block in by_hash.get(block_hash, ()):
                if (
                    self._parent[block] == parent
                    and self._tokens[block] == (seq.block_nodes[index][1])
                ):
                    match = block
                    break
            if match is None:
                break
            hit.append(match)
            parent = block_hash
        return hit

    def num_evictable(self, blocks: list[int]) -> int:
        """PC4: how many of ``blocks`` are free (a hit on them takes a free block)."""
        in_queue = self._in_queue
        return sum(in_queue[block] for block in blocks)

    def touch(self, table: list[int], blocks: list[int]) -> None:
        """PC4: ``table`` takes the hit ``blocks``; free ones leave the queue."""
        for block in blocks:
            if self._in_queue[block]:
                self._unlink(block)
            self._add_ref(block, 1)
        table.extend(blocks)

    # --- allocation and freeing ------------------------------------------------------

    def grow(self, table: list[int], num_blocks: int) -> None:
        """PC5: extend ``table`` to ``num_blocks`` blocks from the head of the free queue."""
        need = num_blocks - len(table)
        if need <= 0:
            return
        if need > self._num_free:
            raise BlockAllocationError(f"need {need} blocks, only {self._num_free} free")
        sentinel = self.num_blocks
        for _ in range(need):
            block = self._next[sentinel]
            self._unlink(block)
            self._drop_key(block)
            self._add_ref(block, 1)
            table.append(block)

    def free(self, table: list[int]) -> None:
        """PC6: give up ``table``'s blocks in reverse order; unreferenced ones come free.

        A keyed block joins the tail (it may still be hit); one without a key goes to
        the head, to be reused first. Under nano-vllm/drop-key-on-free every freed block
        loses its key and joins the tail.
        """
        ref = self._ref
        for block in table:
            if ref[block] < 1:
                raise BlockAllocationError(f"block {block} freed twice")
        first: list[int] = []
        for block in reversed(table):
            self._add_ref(block, -1)
            if ref[block] == 0:
                if self.drop_key_on_free:
                    self._forget_key(block)
                    self._append(block)
                elif self._hash[block] is None:
                    first.append(block)
                else:
                    self._append(block)
        prev = self.num_blocks  # the sentinel: the head
        for block in first:
            self._insert_after(prev, block)
            if self._journal is not None:
                self._journal.append((_LINK, block))
            prev = block
        table.clear()

    # --- the step's journal ------------------------------------------------------------

    def begin(self) -> None:
        """Start journaling one step's changes."""
        self._journal = []
        self.num_reclaimed = 0

    def end(self) -> None:
        """The step committed: stop journaling."""
        self._journal = None

    def reclaimed_blocks(self) -> list[int]:
        """Keyed blocks reclaimed since ``begin()`` (their old K/V is what a rollback needs)."""
        journal = self._journal or []
        return [entry[1] for entry in journal if entry[0] == _DROP_KEY]  # type: ignore[misc]

    def undo(self) -> None:
        """Undo every change since ``begin()``, newest first, and stop journaling."""
        journal = self._journal
        self._journal = None
        if journal is None:
            return
        for entry in reversed(journal):
            kind, block = entry[0], entry[1]
            assert isinstance(block, int)
            if kind == _UNLINK:
                prev = entry[2]
                assert isinstance(prev, int)
                self._insert_after(prev, block)
            elif kind == _LINK:
                prev, nxt = self._prev[block], self._next[block]
                self._next[prev] = nxt
                self._prev[nxt] = prev
                self._in_queue[block] = 0
                self._num_free -= 1
            elif kind == _REF:
                delta = entry[2]
                assert isinstance(delta, int)
                self._ref[block] -= delta
            elif kind == _SET_KEY:
                block_hash = self._hash[block]
                assert block_hash is not None
                same = self._by_hash[block_hash]
                same.remove(block)
                if not same:
                    del self._by_hash[block_hash]
                self._hash[block] = None
                self._node[block] = None
            else:
                self._restore_key(entry)
        self.num_reclaimed = 0

    def _restore_key(self, entry: tuple[object, ...]) -> None:
        _, block, block_hash, parent, tokens, node, stamp = entry
        assert isinstance(block, int) and isinstance(block_hash, int)
        assert isinstance(parent, int) and isinstance(tokens, tuple) and isinstance(stamp, int)
        self._hash[block] = block_hash
        self._parent[block] = parent
        self._tokens[block] = tokens
        self._node[block] = cast("Node | None", node)
        self._stamp[block] = stamp
        same = self._by_hash.setdefault(block_hash, [])
        at = 0
        while at < len(same) and self._stamp[same[at]] < stamp:
            at += 1
        same.insert(at, block)

    # --- for the rolled-back tables -----------------------------------------------------

    def shrink(self, table: list[int], num_blocks: int) -> None:
        """Cut ``table`` to ``num_blocks`` (the pool itself is restored by ``undo``)."""
        del table[num_blocks:]

    def unfree(self, blocks: list[int]) -> None:
        """Nothing to do: ``undo`` restores the pool."""

    # --- the spec's view and checks ----------------------------------------------------

    def observe(self) -> PrefixCacheState:
        """The pool as the spec's ``PrefixCacheState`` (queue order and key order kept)."""
        return PrefixCacheState(free_queue=tuple(self.free_queue()), cached=tuple(self.cached()))

    def cached(self) -> list[tuple[tuple[int, ...], int]]:
        """``(full prefix key, block)`` pairs in the order the keys were given (O(cache))."""
        keyed = [b for b in range(self.num_blocks) if self._hash[b] is not None]
        keyed.sort(key=self._stamp.__getitem__)
        return [(self._full_key(b), b) for b in keyed]

    def _full_key(self, block: int) -> tuple[int, ...]:
        parts: list[tuple[int, ...]] = []
        node = self._node[block]
        while node is not None:
            parts.append(node[1])
            node = node[0]
        return tuple(token for part in reversed(parts) for token in part)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def check(self) -> None:
        """Assert the queue, flags and counts agree (for tests)."""
        queue = self.free_queue()
        if len(queue) != self._num_free or len(set(queue)) != len(queue):
            raise BlockAllocationError("the free queue's length or contents drifted")
        in_queue = set(queue)
        for block in range(self.num_blocks):
            if bool(self._in_queue[block]) != (block in in_queue):
                raise BlockAllocationError(f"block {block}: queue flag is wrong")
            if self._in_queue[block] and self._ref[block]:
                raise BlockAllocationError(f"block {block} is free but referenced")
            if not self._in_queue[block] and self._ref[block] < 1:
                raise BlockAllocationError(f"block {block} is neither free nor referenced")
        for block_hash, blocks in self._by_hash.items():
            for block in blocks:
                if self._hash[block] != block_hash:
                    raise BlockAllocationError(f"block {block} is under a hash it lacks")
