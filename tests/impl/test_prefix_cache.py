"""The engine's prefix-caching block pool: LRU free queue, hits, keys, journaled undo."""

from __future__ import annotations

from impl.prefix_cache import PrefixCachingBlockManager
from impl.sequence import Sequence
from spec.types import Request, SamplingParams, SchedulerConfig
from tests.oracles.pool import cache_violations


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(
        Request(request_id=rid, prompt_token_ids=tuple(tokens), params=SamplingParams(), arrival=0)
    )


def drained_violations(pool: PrefixCachingBlockManager) -> list[str]:
    """The drained-pool invariant (tests/oracles/pool.py) on a bare pool."""
    config = SchedulerConfig(
        num_gpu_blocks=pool.num_blocks, block_size=pool.block_size, enable_prefix_caching=True
    )
    return cache_violations(pool, config)


def pool_state(pool: PrefixCachingBlockManager) -> object:
    return (
        pool.free_queue(),
        pool.cached(),
        [pool.ref_count(b) for b in range(pool.num_blocks)],
    )


def admit(pool: PrefixCachingBlockManager, s: Sequence) -> int:
    """Admit ``s`` whole: touch its hit, grow, key its full blocks; its hit tokens."""
    hit = pool.lookup(s)
    pool.touch(s.block_table, hit)
    pool.grow(s.block_table, -(-s.num_tokens // pool.block_size))
    start = len(hit) * pool.block_size
    pool.cache_blocks(s, start, s.num_tokens)
    return start


def test_freed_blocks_keep_their_keys_and_are_hit_again() -> None:
    pool = PrefixCachingBlockManager(8, 2)
    a = seq([1, 2, 3, 4, 5])
    assert admit(pool, a) == 0
    blocks = list(a.block_table)
    pool.free(a.block_table)
    assert drained_violations(pool) == []
    # The partly filled last block goes to the head, the keyed ones to the tail.
    assert pool.free_queue() == [blocks[2], 3, 4, 5, 6, 7, blocks[1], blocks[0]]
    b = seq([1, 2, 3, 4, 9], "b")
    assert admit(pool, b) == 4
    assert b.block_table[:2] == blocks[:2]
    pool.check()


def test_a_colliding_hash_is_not_a_hit() -> None:
    pool = PrefixCachingBlockManager(4, 2)
    a = seq([1, 2, 3])
    admit(pool, a)
    other = seq([7, 8, 3], "o")
    other.block_hashes.append(a.block_hashes[0])  # force the same hash, other tokens
    other.block_nodes.append((None, (7, 8)))
    assert pool.lookup(other) == []


def test_undo_restores_queue_order_keys_and_counts() -> None:
    pool = PrefixCachingBlockManager(6, 2)
    first = seq([1, 2, 3, 4, 5, 6, 7])
    admit(pool, first)
    pool.free(first.block_table)
    assert drained_violations(pool) == []
    before = pool_state(pool)
    pool.begin()
    again = seq([1, 2, 3, 4, 8], "again")
    admit(pool, again)
    filler = seq([9] * 7, "filler")  # reclaims the cached blocks
    pool.grow(filler.block_table, 3)
    pool.cache_blocks(filler, 0, 6)
    assert pool.reclaimed_blocks()
    pool.undo()
    assert pool_state(pool) == before
    assert drained_violations(pool) == []
