"""Coverage events for nano-vllm's prefix-cache rules (spec.profiles, N7/N8).

Computed from the spec's states around one step (``before`` it, ``mid`` after its
decisions, its ``plan``, ``after`` it), so they say what the ``nano-vllm`` profile's
cache rules did (``events.prefix_events`` yields them with its own).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from spec.kv import cdiv
from spec.prefix_cache import longest_hit, request_tokens
from spec.profiles import nano_caching
from spec.types import SchedulerState, StepPlan

HIT: Final = "nano-vllm cache: hit on blocks another running request holds"
GATE: Final = "nano-vllm/admission-tests-len-seq: the gate held back a request PC4 admits"
MOVED: Final = "nano-vllm/last-key-wins: a key moved to another block"
DROPPED: Final = "nano-vllm/drop-key-on-free: a freed block lost its key"

NANO_CACHE_EVENTS: Final = frozenset({HIT, GATE, MOVED, DROPPED})


def nano_cache_events(
    before: SchedulerState, mid: SchedulerState, plan: StepPlan, after: SchedulerState
) -> Iterator[str]:
    config = before.config
    cache, cache_mid, cache_after = before.prefix_cache, mid.prefix_cache, after.prefix_cache
    if not nano_caching(config) or cache is None or cache_mid is None or cache_after is None:
        return
    waiting = {r.request_id for r in before.waiting}
    admitted = [c for c in plan.scheduled if c.request_id in waiting]
    if any(c.start > 0 for c in admitted):
        yield HIT
    # Phase C runs first (nano-vllm/prefill-first): it saw ``before`` if it admitted
    # nobody, else it stopped at the waiting head of ``mid``.
    if _gate_held_back(
        mid if admitted else before, sum(c.num_tokens for c in admitted), len(admitted)
    ):
        yield GATE
    keys_before = dict(cache.cached)
    for key, block in (*cache_mid.cached, *cache_after.cached):
        if keys_before.get(key, block) != block:
            yield MOVED
            break
    keyed = {block for _, block in (*cache.cached, *cache_mid.cached)}
    if keyed & (set(cache_mid.free_queue) | set(cache_after.free_queue)):
        yield DROPPED


def _gate_held_back(state: SchedulerState, charged: int, num_admitted: int) -> bool:
    """Whether the waiting head phase C stopped at passes PC4 but not nano-vllm's gate,
    after ``num_admitted`` admissions that charged ``charged`` tokens in the step."""
    config = state.config
    cache = state.prefix_cache
    left = config.max_num_batched_tokens - charged
    if cache is None or not state.waiting or num_admitted >= config.max_num_seqs or left <= 0:
        return False
    head = state.waiting[0]
    bs = config.block_size
    free = state.num_free_gpu_blocks
    hit = len(longest_hit(cache, request_tokens(head), bs))
    pc4 = head.num_tokens - hit * bs <= left and cdiv(head.num_tokens, bs) - hit <= free
    nano = head.num_tokens <= left and cdiv(head.num_tokens, bs) <= free
    return pc4 and not nano
