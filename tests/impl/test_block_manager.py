"""BlockManager: allocation order, conservation, double free, exact undo."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl.block_manager import BlockAllocationError, BlockManager
from impl.sequence import Sequence
from spec.types import Request, SamplingParams


def test_allocation_order_is_fifo() -> None:
    pool = BlockManager(6)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    b = pool.allocate(1)
    assert b == [3]
    pool.free(a)  # freed blocks go to the tail: reused after 4 and 5
    assert a == []
    assert pool.allocate(4) == [4, 5, 0, 1]
    assert pool.num_free_blocks == 1


def test_grow_extends_a_table_and_frees_nothing_when_already_big_enough() -> None:
    pool = BlockManager(5)
    table: list[int] = []
    pool.grow(table, 2)
    assert table == [0, 1]
    pool.grow(table, 2)
    pool.grow(table, 1)
    assert table == [0, 1]
    pool.grow(table, 4)
    assert table == [0, 1, 2, 3]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 4
    assert pool.can_allocate(1) and not pool.can_allocate(2)


def test_the_plain_pool_answers_the_caching_questions_with_no_cache() -> None:
    """Nothing hits, keying changes nothing, nothing is journaled or reclaimed; a block
    in a table has one holder; the spec sees no pool."""
    pool = BlockManager(4)
    request = Request(
        request_id="a", prompt_token_ids=(1, 2, 1, 2), params=SamplingParams(), arrival=0
    )
    seq = Sequence(request)
    pool.grow(seq.block_table, 2)
    pool.begin()
    assert pool.lookup(seq) == [] and pool.num_evictable([0, 1]) == 0
    pool.touch(seq.block_table, [])
    pool.cache_blocks(seq, 0, 4)
    pool.uncache_blocks(seq.block_table, 0, 4)
    pool.undo()
    assert seq.block_table == [0, 1] and pool.num_free_blocks == 2
    assert pool.reclaimed_blocks() == [] and pool.num_reclaimed == 0
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    assert pool.observe() is None
    pool.check()


def test_over_allocation_raises_and_changes_nothing() -> None:
    pool = BlockManager(3)
    table = pool.allocate(2)
    with pytest.raises(BlockAllocationError):
        pool.grow(table, 4)
    assert table == [0, 1]
    assert pool.num_free_blocks == 1


def test_double_free_is_detected_and_changes_nothing() -> None:
    pool = BlockManager(4)
    table = pool.allocate(2)
    alias = list(table)
    pool.free(table)
    with pytest.raises(BlockAllocationError, match="freed twice"):
        pool.free(alias)
    assert alias == [0, 1]
    assert pool.num_free_blocks == 4
    pool.check()
    with pytest.raises(BlockAllocationError):
        pool.free([3, 3])  # one table holding a block twice


def test_zero_blocks_pool() -> None:
    pool = BlockManager(0)
    assert pool.num_free_blocks == 0
    assert pool.can_allocate(0) and not pool.can_allocate(1)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(-1)


def test_unallocate_and_unfree_restore_the_free_list_exactly() -> None:
    pool = BlockManager(6)
    before = list(pool._free)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(1)  # [2]
    victim = list(a)
    pool.free(a)  # free list: 3 4 5 0 1
    c = pool.allocate(4)  # 3 4 5 0
    # Undo in reverse order.
    pool.unallocate(c)
    pool.unfree(victim)
    pool.unallocate(b)
    pool.unallocate(victim)
    assert list(pool._free) == before
    pool.check()


def test_unfree_refuses_blocks_that_were_not_freed_last() -> None:
    pool = BlockManager(4)
    a = pool.allocate(2)
    b = pool.allocate(1)
    ids_a = list(a)
    pool.free(a)
    pool.free(b)
    with pytest.raises(BlockAllocationError):
        pool.unfree(ids_a)


def test_shrink_undoes_grow() -> None:
    pool = BlockManager(5)
    table = pool.allocate(2)
    before = list(pool._free)
    pool.grow(table, 5)
    pool.shrink(table, 2)
    assert table == [0, 1]
    assert list(pool._free) == before


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 4)), max_size=40))
def test_conservation_under_random_allocs_and_frees(ops: list[tuple[bool, int]]) -> None:
    pool = BlockManager(8)
    tables: list[list[int]] = []
    for allocate, n in ops:
        if allocate:
            if pool.can_allocate(n):
                tables.append(pool.allocate(n))
        elif tables:
            pool.free(tables.pop(n % len(tables)))
        owned = [block for table in tables for block in table]
        assert len(set(owned)) == len(owned)
        assert pool.num_free_blocks + len(owned) == pool.num_blocks
        assert set(pool._free).isdisjoint(owned)
        pool.check()
