"""The drained-pool invariant: once every request has left, the pools are whole again.

A leak or a lost reference shows up in a drained pool directly, rather than later as a
request that can never be admitted (a ``DrainError``). After a drain:

* every GPU and CPU block is free, each once, and nothing is live;
* with prefix caching, no block is referenced (every reference count is zero), the
  keys are whole-block prefixes, one per block, and they agree with the free queue's
  order: the unkeyed blocks first, then the keyed ones (PC6: a freed block without a
  key goes to the head, one with a key to the tail; allocation takes from the head and
  a key is only given to a held block), and under nano-vllm/drop-key-on-free no free
  block has a key at all.

``spec_pool_violations`` checks the spec's state, ``engine_pool_violations`` the
engine scheduler's (its GPU ``BlockPool`` through its public reads and its spec view,
``observe``, held to the same rules by the same code); each returns one line per broken
rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import spec
from impl.block_manager import BlockAllocationError, BlockPool
from impl.scheduler import Scheduler
from spec.prefix_cache import pool_violations
from spec.profiles import nano_caching
from spec.types import PrefixCacheState, SchedulerConfig, SchedulerState


def queue_violations(
    free_queue: Sequence[int], keyed: set[int], num_blocks: int, *, keys_kept: bool
) -> list[str]:
    """A drained free queue: every block once, unkeyed ones before keyed ones."""
    found: list[str] = []
    if sorted(free_queue) != list(range(num_blocks)):
        found.append(f"free queue {list(free_queue)} is not every one of {num_blocks} blocks once")
    if not keyed <= set(free_queue):
        found.append(f"keyed blocks {sorted(keyed - set(free_queue))} are not free")
    if not keys_kept and keyed:
        found.append(f"nano-vllm/drop-key-on-free: free blocks {sorted(keyed)} have keys")
    flags = [block in keyed for block in free_queue]
    if flags != sorted(flags):
        found.append(f"PC6: a keyed block is ahead of an unkeyed one in {list(free_queue)}")
    return found


def drained_cache_violations(config: SchedulerConfig, cache: PrefixCacheState) -> list[str]:
    """A drained prefix cache, either side's: the pool's rules with nothing running (PC1,
    PC2, PC9: ``spec.prefix_cache.pool_violations``) and the free queue's order."""
    keyed = {block for _, block in cache.cached}
    return pool_violations(config, cache, ()) + queue_violations(
        cache.free_queue, keyed, config.num_gpu_blocks, keys_kept=not nano_caching(config)
    )


def spec_pool_violations(state: SchedulerState) -> list[str]:
    """The spec's state after a drain (``[]``: whole)."""
    config = state.config
    found: list[str] = []
    if spec.has_unfinished_requests(state):
        found.append(f"live requests {spec.live_request_ids(state)}")
    free = (state.num_free_gpu_blocks, state.num_free_cpu_blocks)
    if free != (config.num_gpu_blocks, config.num_cpu_blocks):
        found.append(
            f"free GPU/CPU blocks {free}, not {(config.num_gpu_blocks, config.num_cpu_blocks)}"
        )
    if state.prefix_cache is not None:
        found += drained_cache_violations(config, state.prefix_cache)
    return found


def engine_pool_violations(scheduler: Scheduler) -> list[str]:
    """The engine scheduler's pools after a drain (``[]``: whole)."""
    found: list[str] = []
    if scheduler.has_unfinished_requests():
        found.append(f"{scheduler.num_unfinished_requests} live requests")
    for name, pool in (("GPU", scheduler.gpu), ("CPU", scheduler.cpu)):
        if pool.num_free_blocks != pool.num_blocks:
            found.append(f"{name} free {pool.num_free_blocks} of {pool.num_blocks} blocks")
    return found + cache_violations(scheduler.gpu, scheduler.config)


def cache_violations(pool: BlockPool, config: SchedulerConfig) -> list[str]:
    """A drained GPU pool: no references, its own bookkeeping consistent (``check``) and,
    with prefix caching, its spec view (``observe``) as ``drained_cache_violations`` says."""
    found: list[str] = []
    referenced = [b for b in range(pool.num_blocks) if pool.ref_count(b)]
    if referenced:
        found.append(f"blocks {referenced} are still referenced")
    try:
        pool.check()
    except BlockAllocationError as e:
        found.append(f"the pool's own check: {e}")
    cache = pool.observe()
    if cache is not None:
        found += drained_cache_violations(config, cache)
    return found
