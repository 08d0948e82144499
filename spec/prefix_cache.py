"""Prefix caching: shared GPU blocks, keyed by the token prefix they end (PC1-PC9).

When ``config.enable_prefix_caching`` is on, the state carries the GPU block pool
explicitly (``SchedulerState.prefix_cache`` and each running request's ``block_ids``)
and the phases call the pure functions below instead of only counting blocks. The
rules, as in docs/semantics.md:

- **PC1 (pool).** Every GPU block is either in the free queue or held by at least one
  running request (never both); a block's reference count is the number of running
  requests that hold it. Between steps a running request holds ``cdiv(computed, bs)``
  distinct blocks, in table order; ``num_free_gpu_blocks`` is the free queue's length.
- **PC2 (keys).** Only full blocks get a key: block ``i`` of a request gets
  ``tokens[:(i + 1) * bs]``, the whole prefix up to its end, so equal keys mean equal
  prefixes (not only equal block contents). Keys are given when a chunk is scheduled,
  to each block of the request that is full once the chunk is computed and has no key
  yet (vLLM's ``cache_blocks`` at allocation); a request admitted later in the same
  step may hit them, because the forward writes every chunk's K/V before any
  attention reads the cache.
- **PC3 (lookup).** At admission (phase C, which is also where a preempted request
  comes back), the hit is the longest run of the request's blocks ``0 .. k-1`` whose
  keys are cached, with ``k <= (num_tokens - 1) // bs``: at least one token is always
  computed, so that the request has logits to sample from (vLLM caps the hit at
  ``num_tokens - 1`` tokens and keeps whole blocks: a prompt of exactly ``m * bs``
  tokens hits at most ``m - 1`` blocks and recomputes its last block). A key naming
  several blocks resolves to the one that got it first.
- **PC4 (admission).** ``h = k * bs`` hit tokens are computed already: the request's
  computed count becomes ``h`` and its chunk starts there; ``n = min(num_tokens - h,
  budget)`` with chunked prefill on, else ``num_tokens - h`` (stop if it exceeds the
  budget); only ``n`` counts against the budget. It needs ``new = cdiv(h + n, bs) - k``
  new blocks, and stops if ``new`` plus the hit blocks that sit in the free queue
  exceed the free blocks (vLLM counts evictable hit blocks as taken). Admitted, its
  hit blocks leave the free queue first (**touch**), then the new blocks are taken, so
  a hit block is never reclaimed between lookup and use.
- **PC5 (allocation and reclaim).** New blocks come from the head of the free queue
  (the least recently freed); a block taken that still has a key loses it
  (**reclaim**).
- **PC6 (freeing).** A request that finishes, is preempted or aborted gives up its
  blocks in reverse table order; each block that no other running request holds
  comes free: with a key it joins the tail of the free queue and keeps the key
  (cached but free), so a request's last blocks are reclaimed before its first ones;
  without one (a partly filled block, which nothing can hit) it goes to the head, to
  be reused first (vLLM 0.32's ``BlockPool.free_blocks``: ``prepend_n`` for blocks
  without a hash, ``append_n`` for the others). Requests finishing in one step give
  up their blocks one after the other, in plan order.
- **PC7 (preemption).** A victim gives up its blocks as in PC6 and holds none; when
  it is admitted again, PC3 may hit its own freed blocks (or another request's) for
  as long as they are not reclaimed.
- **PC8 (growth).** A running request's chunk takes ``cdiv(computed + n, bs) -
  len(block_ids)`` new blocks by PC5, and phase A preempts while that exceeds the
  free queue's length (R5); blocks a victim shares with another request do not come
  free.
- **PC9 (invariants)**, checked by ``pool_violations``: PC1; each block has at most
  one key; a block held by a running request has a key only if it is full of
  computed tokens, and then the key is that request's prefix at the block; a block
  held by two requests has a key.

Swap preemption is refused with caching on (``ConfigError``): vLLM V1 has no swap.

**Profile variants** sit beside the rule they replace (docs/semantics.md, "Semantics
profiles"): nano-vllm/last-key-wins beside PC2 (``give_keys_last_wins``),
vllm-v1/undone-chunk-unkeyed after it (``unkey_undone_chunk``), nano-vllm/drop-key-on-free
beside PC6 (``release_dropping_keys``), nano-vllm's invariants beside PC9
(``nano_pool_violations``). The phases call the rules *by profile*: ``key_blocks`` (PC2),
``grow`` (PC4, PC5 and PC2 together: the one way a chunk takes blocks, in phases A and C
and in Rule P's replay), ``release_blocks`` (PC6) and ``pool_violations`` (PC1, PC9),
which choose the variant with a predicate of ``spec.profiles`` (this module imports it,
never the other way).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from spec.kv import cdiv, table_blocks
from spec.profiles import nano_caching, speculative
from spec.types import PrefixCacheState, RequestState, SchedulerConfig

Key = tuple[int, ...]


# --- PC2, PC3: keys and lookup ------------------------------------------------------


def request_tokens(request: RequestState) -> tuple[int, ...]:
    """The request's prompt followed by its outputs: what its blocks hold, in order.

    post: len(__return__) == request.num_tokens
    """
    return (*request.request.prompt_token_ids, *request.output_token_ids)


def block_key(tokens: tuple[int, ...], index: int, block_size: int) -> Key:
    """PC2: the key of block ``index``: every token up to the end of that block.

    pre: block_size >= 1
    pre: 0 <= index and (index + 1) * block_size <= len(tokens)
    post: len(__return__) == (index + 1) * block_size and tokens[: len(__return__)] == __return__
    """
    return tokens[: (index + 1) * block_size]


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """PC3: the most blocks a lookup may hit: ``(num_tokens - 1) // bs``.

    At least one token is left to compute, and only whole blocks are hit.

    pre: num_tokens >= 1
    pre: block_size >= 1
    post: 0 <= __return__ * block_size < num_tokens <= (__return__ + 1) * block_size
    """
    return (num_tokens - 1) // block_size


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """PC2: how many blocks are full once ``num_tokens`` tokens are in them.

    pre: num_tokens >= 0
    pre: block_size >= 1
    post: __return__ * block_size <= num_tokens < (__return__ + 1) * block_size
    """
    return num_tokens // block_size


def cached_block(cache: PrefixCacheState, key: Key) -> int | None:
    """PC3: the block that got ``key`` first, or None.

    post: __return__ is None or (key, __return__) in cache.cached
    """
    for cached_key, block in cache.cached:
        if cached_key == key:
            return block
    return None


def longest_hit(
    cache: PrefixCacheState, tokens: tuple[int, ...], block_size: int
) -> tuple[int, ...]:
    """PC3: the blocks of the longest cached prefix of ``tokens``, capped by ``max_hit_blocks``.

    pre: len(tokens) >= 1
    pre: block_size >= 1
    post: len(__return__) <= max_hit_blocks(len(tokens), block_size)
    """
    by_key: dict[Key, int] = {}
    for key, block in cache.cached:
        by_key.setdefault(key, block)
    hit: list[int] = []
    for index in range(max_hit_blocks(len(tokens), block_size)):
        found = by_key.get(block_key(tokens, index, block_size))
        if found is None:
            break
        hit.append(found)
    return tuple(hit)


# --- PC4, PC5: a hit's free blocks, touch, take -------------------------------------


def num_evictable(cache: PrefixCacheState, blocks: Iterable[int]) -> int:
    """PC4: how many of ``blocks`` sit in the free queue (a hit on them takes a free block).

    post: __return__ >= 0
    """
    free = set(cache.free_queue)
    return sum(1 for block in blocks if block in free)


def touched(cache: PrefixCacheState, blocks: tuple[int, ...], after: PrefixCacheState) -> bool:
    """``touch``'s contract: the keys kept; ``blocks`` out of the free queue, nothing added."""
    return (
        after.cached == cache.cached
        and all(block not in after.free_queue for block in blocks)
        and all(block in cache.free_queue for block in after.free_queue)
    )


def touch(cache: PrefixCacheState, blocks: tuple[int, ...]) -> PrefixCacheState:
    """PC4: hit blocks that were free leave the free queue; the queue keeps its order.

    post: touched(cache, blocks, __return__)
    """
    hit = set(blocks)
    return PrefixCacheState(
        free_queue=tuple(b for b in cache.free_queue if b not in hit), cached=cache.cached
    )


def taken_from_head(
    cache: PrefixCacheState, num_blocks: int, after: PrefixCacheState, blocks: tuple[int, ...]
) -> bool:
    """``take``'s contract: ``blocks`` are the free queue's head, gone from it, with no key."""
    return (
        blocks == cache.free_queue[:num_blocks]
        and after.free_queue == cache.free_queue[num_blocks:]
        and all(block not in blocks for _, block in after.cached)
    )


def take(cache: PrefixCacheState, num_blocks: int) -> tuple[PrefixCacheState, tuple[int, ...]]:
    """PC5: ``num_blocks`` blocks from the head of the free queue; reclaimed ones lose their key.

    pre: 0 <= num_blocks <= len(cache.free_queue)
    post: taken_from_head(cache, num_blocks, *__return__)
    """
    blocks = cache.free_queue[:num_blocks]
    if not blocks:
        return cache, ()
    taken = set(blocks)
    return (
        PrefixCacheState(
            free_queue=cache.free_queue[num_blocks:],
            cached=tuple(pair for pair in cache.cached if pair[1] not in taken),
        ),
        blocks,
    )


# --- PC2 by profile: the blocks a chunk fills get their keys -------------------------


def keys_added(cache: PrefixCacheState, after: PrefixCacheState) -> bool:
    """``give_keys``' contract: the free queue and the keys there were, in order, kept."""
    return (
        after.free_queue == cache.free_queue and after.cached[: len(cache.cached)] == cache.cached
    )


def chunk_keyed(cache: PrefixCacheState, after: PrefixCacheState, filled: tuple[int, ...]) -> bool:
    """``give_keys_last_wins``' contract: the free queue kept; every block of ``filled``
    (those the chunk filled) has a key."""
    keyed = {block for _, block in after.cached}
    return after.free_queue == cache.free_queue and set(filled) <= keyed


def give_keys(
    cache: PrefixCacheState,
    tokens: tuple[int, ...],
    block_ids: tuple[int, ...],
    num_tokens: int,
    block_size: int,
) -> PrefixCacheState:
    """PC2: every block of ``block_ids`` full once ``num_tokens`` tokens are computed gets its key.

    Blocks that already have a key keep it (by PC9 it is the same key).

    pre: block_size >= 1
    pre: 0 <= num_tokens <= len(tokens)
    pre: num_tokens // block_size <= len(block_ids)
    post: keys_added(cache, __return__)
    """
    keyed = {block for _, block in cache.cached}
    new = [
        (block_key(tokens, index, block_size), block_ids[index])
        for index in range(num_full_blocks(num_tokens, block_size))
        if block_ids[index] not in keyed
    ]
    if not new:
        return cache
    return PrefixCacheState(free_queue=cache.free_queue, cached=(*cache.cached, *new))


def give_keys_last_wins(
    cache: PrefixCacheState,
    tokens: tuple[int, ...],
    block_ids: tuple[int, ...],
    *,
    start: int,
    end: int,
    block_size: int,
) -> PrefixCacheState:
    """PC2 under **nano-vllm/last-key-wins**: the blocks a chunk ``start .. end`` fills.

    Each block that is full once ``end`` tokens are computed and was not full at
    ``start`` gets its key; if another block has that key, the key moves to the new
    block (the pair keeps its place): nano-vllm's ``hash_to_block_id[h] = block_id``
    overwrites, at admission for every full block that missed (``allocate``,
    ``engine/block_manager.py:79-81``) and at a decode that fills a block
    (``may_append``, ``:111-117``). So a lookup finds the block keyed last, and a block
    whose key moved (even one two requests share) has none and never gets it back.
    PC2 keys every full block without a key and a lookup takes the one keyed first.

    pre: block_size >= 1
    pre: 0 <= start <= end <= len(tokens)
    pre: end // block_size <= len(block_ids)
    post: chunk_keyed(cache, __return__, block_ids[start // block_size : end // block_size])
    """
    pairs = dict(cache.cached)
    new = False
    for index in range(start // block_size, num_full_blocks(end, block_size)):
        pairs[block_key(tokens, index, block_size)] = block_ids[index]
        new = True
    if not new:
        return cache
    return PrefixCacheState(free_queue=cache.free_queue, cached=tuple(pairs.items()))


def key_blocks(
    config: SchedulerConfig,
    cache: PrefixCacheState,
    tokens: tuple[int, ...],
    block_ids: tuple[int, ...],
    *,
    start: int,
    end: int,
) -> PrefixCacheState:
    """PC2 by profile, for a chunk ``start .. end`` whose blocks are ``block_ids``.

    pre: 0 <= start <= end <= len(tokens)
    pre: end // config.block_size <= len(block_ids)
    post: __return__.free_queue == cache.free_queue
    """
    if nano_caching(config):
        return give_keys_last_wins(
            cache, tokens, block_ids, start=start, end=end, block_size=config.block_size
        )
    return give_keys(cache, tokens, block_ids, end, config.block_size)


def chunk_unkeyed(
    cache: PrefixCacheState, after: PrefixCacheState, filled: tuple[int, ...]
) -> bool:
    """``unkey_undone_chunk``'s contract: the free queue kept, keys only dropped, and no
    block of ``filled`` keyed."""
    keyed = {block for _, block in after.cached}
    return (
        after.free_queue == cache.free_queue
        and set(after.cached) <= set(cache.cached)
        and not keyed & set(filled)
    )


def unkey_undone_chunk(
    cache: PrefixCacheState,
    block_ids: tuple[int, ...],
    *,
    start: int,
    end: int,
    block_size: int,
) -> PrefixCacheState:
    """**vllm-v1/undone-chunk-unkeyed** (V11): an undone chunk ``start .. end`` gives
    back the keys it gave its blocks ``block_ids``.

    PC2 keys the blocks a chunk fills when it is scheduled, before any forward writes
    them. When vllm-v1/priority-victim-any-running undoes the chunk, no forward ever
    will, so every block it filled (full at ``end``, not at ``start``: one for a decode,
    several for a prefill chunk) leaves the cache before the victim frees it (unkeyed,
    it goes to the head of the free queue, PC6). vLLM keeps their hashes
    (``kv_cache_manager.py:606-616`` keys at scheduling, ``scheduler.py:1571-1613`` frees
    keeping them): usually the request that needed the blocks takes them straight
    back, but a request can then hit a block whose K/V no forward wrote when (1) the
    requester then preempts itself (a later request hits it), or (2) the chunk filled
    several blocks and the requester takes back only one (the victim itself hits the
    others when it comes back; vLLM reaches it with ``long_prefill_token_threshold``,
    which this profile does not model yet). That is a bug in the peer (docs/peers.md
    V11), which the profile does not copy under either trigger; lockstep classifies the
    divergence it makes (``kvsched.peers.known.V11``).

    pre: block_size >= 1
    pre: 0 <= start <= end
    pre: end // block_size <= len(block_ids)
    post: chunk_unkeyed(cache, __return__, block_ids[start // block_size : end // block_size])
    """
    filled = set(block_ids[start // block_size : num_full_blocks(end, block_size)])
    if not filled:
        return cache
    return PrefixCacheState(
        free_queue=cache.free_queue,
        cached=tuple(pair for pair in cache.cached if pair[1] not in filled),
    )


# --- PC4, PC5, PC2 together: a chunk takes its blocks (PC8) --------------------------


def grown(
    held: tuple[int, ...], num_blocks: int, after: PrefixCacheState, blocks: tuple[int, ...]
) -> bool:
    """``grow``'s contract: ``num_blocks`` distinct blocks, ``held`` first, none free."""
    return (
        len(blocks) == num_blocks
        and blocks[: len(held)] == held
        and len(set(blocks)) == len(blocks)
        and not set(blocks) & set(after.free_queue)
    )


def grow(
    config: SchedulerConfig,
    cache: PrefixCacheState,
    tokens: tuple[int, ...],
    held: tuple[int, ...],
    *,
    start: int,
    end: int,
) -> tuple[PrefixCacheState, tuple[int, ...]]:
    """PC4, PC5, PC2 (PC8): a request holding ``held`` takes the blocks of its chunk
    ``start .. end``; the pool after, and the request's blocks.

    ``held`` is a running request's blocks (PC8) or a waiting one's hit (PC4). First the
    held blocks that sit in the free queue leave it (**touch**: a hit block is never
    reclaimed between lookup and use); then the blocks that make ``cdiv(end, bs)`` are
    taken from the head of the free queue, reclaiming their keys (PC5); then the blocks
    the chunk fills get their keys, by profile (``key_blocks``). Whether the new blocks
    are free is the caller's to decide, with its own arithmetic (phase A's ``need``,
    phase C's PC4 test, Rule P's ``_fits``), which this count does not replace.

    Under async scheduling (vllm-v1/async-placeholders) a chunk may end past the known
    tokens, on placeholders: its blocks are taken for ``end``, but keys only go up to
    the known tokens (``allocate_slots`` caches ``min(computed + n, num_tokens)``,
    ``v1/core/kv_cache_manager.py:612-616``); the rest are keyed when the outputs are
    applied (``spec.pipeline``).

    pre: 0 <= start <= min(end, len(tokens))
    pre: len(set(cache.free_queue)) == len(cache.free_queue) and len(set(held)) == len(held)
    pre: len(held) <= cdiv(end, config.block_size) or speculative(config)
    pre: cdiv(end, config.block_size) <= len(held) + len(touch(cache, held).free_queue)
    post: grown(held, max(len(held), cdiv(end, config.block_size)), *__return__)
    """
    count = cdiv(end, config.block_size) - len(held)
    if speculative(config):  # blocks ahead may already cover the chunk: take none
        count = max(0, count)
    cache, new = take(touch(cache, held), count)
    block_ids = (*held, *new)
    known = min(end, len(tokens))
    return key_blocks(config, cache, tokens, block_ids, start=start, end=known), block_ids


# --- PC1, PC6 by profile: holders and freeing ----------------------------------------


def holders(running: tuple[RequestState, ...]) -> Counter[int]:
    """PC1: each block's reference count, the number of these requests that hold it.

    post: sum(__return__.values()) == sum(len(r.block_ids) for r in running)
    """
    counts: Counter[int] = Counter()
    for request in running:
        counts.update(request.block_ids)
    return counts


def released(cache: PrefixCacheState, block_ids: tuple[int, ...], after: PrefixCacheState) -> bool:
    """``release``'s contract: the keys kept; the free queue keeps its blocks and gains at
    most ``block_ids``."""
    return (
        after.cached == cache.cached
        and len(after.free_queue) <= len(cache.free_queue) + len(block_ids)
        and all(block in after.free_queue for block in cache.free_queue)
    )


def release(
    cache: PrefixCacheState, block_ids: tuple[int, ...], others: Mapping[int, int]
) -> PrefixCacheState:
    """PC6: give up ``block_ids``, last block first; those no other holder has come free.

    ``others`` counts the holders besides the request that lets go. A freed block with
    a key joins the tail of the free queue and keeps its key; one without a key (never
    hittable) goes to the head, to be reused first. Both groups keep the reverse table
    order.

    post: released(cache, block_ids, __return__)
    """
    freed = [block for block in reversed(block_ids) if not others.get(block, 0)]
    if not freed:
        return cache
    keyed = {block for _, block in cache.cached}
    first = tuple(block for block in freed if block not in keyed)
    last = tuple(block for block in freed if block in keyed)
    return PrefixCacheState(free_queue=(*first, *cache.free_queue, *last), cached=cache.cached)


def released_unkeyed(cache: PrefixCacheState, after: PrefixCacheState) -> bool:
    """``release_dropping_keys``' contract: keys only dropped, the free queue only grows at
    its tail, and (if no free block had a key before) no free block has one after."""
    keyed_free_before = {block for _, block in cache.cached} & set(cache.free_queue)
    keyed_free_after = {block for _, block in after.cached} & set(after.free_queue)
    return (
        set(after.cached) <= set(cache.cached)
        and after.free_queue[: len(cache.free_queue)] == cache.free_queue
        and (not keyed_free_after or bool(keyed_free_before))
    )


def release_dropping_keys(
    cache: PrefixCacheState, block_ids: tuple[int, ...], others: Mapping[int, int]
) -> PrefixCacheState:
    """PC6 under **nano-vllm/drop-key-on-free**: freed blocks lose their key, join the tail.

    The request gives up ``block_ids`` last block first; each one no other holder has
    (``others`` counts them) comes free at the tail of the free queue, keyed or not,
    and its key leaves the cache (the fork's ``deallocate``,
    ``engine/block_manager.py:84-98``: it deletes ``hash_to_block_id[block.hash]`` when
    that names the block, and ``_deallocate_block`` appends). So nothing hits a freed
    block: not another request, not a preempted request coming back (PC7). PC6 keeps
    the key and puts unkeyed blocks at the head. (Upstream nano-vllm keeps the key.)

    post: released_unkeyed(cache, __return__)
    """
    freed = tuple(block for block in reversed(block_ids) if not others.get(block, 0))
    if not freed:
        return cache
    gone = set(freed)
    return PrefixCacheState(
        free_queue=(*cache.free_queue, *freed),
        cached=tuple(pair for pair in cache.cached if pair[1] not in gone),
    )


def release_blocks(
    config: SchedulerConfig,
    cache: PrefixCacheState,
    block_ids: tuple[int, ...],
    others: Mapping[int, int],
) -> PrefixCacheState:
    """PC6 by profile: ``release`` or, nano-vllm, ``release_dropping_keys``.

    post: len(__return__.free_queue) <= len(cache.free_queue) + len(block_ids)
    """
    if nano_caching(config):
        return release_dropping_keys(cache, block_ids, others)
    return release(cache, block_ids, others)


# --- PC1, PC9 by profile: the pool's invariants --------------------------------------


def pool_violations(
    config: SchedulerConfig,
    cache: PrefixCacheState,
    running: tuple[RequestState, ...],
    *,
    extra_tokens: dict[str, int] | None = None,
) -> list[str]:
    """PC1 and PC9, by profile, on the pool and the running requests; one line per broken rule.

    Under nano-vllm's cache (``nano_caching``) "a block held by two requests has a key"
    is left out, since nano-vllm/last-key-wins does not keep it, and
    ``nano_pool_violations`` is added.

    Between steps a running request holds ``cdiv(computed, bs)`` blocks (and its blocks
    ahead, vllm-v1/spec-rejected-blocks-kept: ``table_blocks``); in the middle
    of a step a scheduled one already holds the blocks of its chunk, which
    ``extra_tokens`` (request id -> chunk size) adds to its computed count.
    """
    num_blocks, block_size = config.num_gpu_blocks, config.block_size
    nano = nano_caching(config)
    found: list[str] = []
    extra = extra_tokens or {}
    free = cache.free_queue
    if len(set(free)) != len(free) or not all(0 <= b < num_blocks for b in free):
        found.append("PC1: the free queue repeats a block or names one outside the pool")
    counts = holders(running)
    in_use = set(counts)
    if in_use & set(free):
        found.append(f"PC1: blocks {sorted(in_use & set(free))} are in use and free")
    if len(in_use) + len(set(free)) != num_blocks or not all(0 <= b < num_blocks for b in in_use):
        found.append(
            f"PC1: blocks not conserved: {len(set(free))} free + {len(in_use)} in use "
            f"!= {num_blocks}"
        )
    key_of: dict[int, Key] = {}
    for key, block in cache.cached:
        if block in key_of:
            found.append(f"PC9: block {block} has two keys")
        key_of[block] = key
        if not key or len(key) % block_size:
            found.append(f"PC2: block {block} has a key of {len(key)} tokens, not whole blocks")
    for request in running:
        rid = request.request_id
        ids = request.block_ids
        computed = request.num_computed_tokens + extra.get(rid, 0)
        if len(set(ids)) != len(ids):
            found.append(f"PC1: request {rid!r} holds a block twice")
        if len(ids) != _table_length(request, computed, block_size):
            found.append(
                f"PC1: request {rid!r} holds {len(ids)} blocks for {computed} tokens "
                f"({request.num_blocks_ahead} ahead)"
            )
        tokens = request_tokens(request)
        for index, held in enumerate(ids):
            held_key = key_of.get(held)
            if held_key is None:
                if not nano and counts[held] > 1:
                    found.append(f"PC9: block {held} is shared but has no key")
                continue
            # min: a malformed request computed past its tokens is reported, not indexed
            if (index + 1) * block_size > min(computed, len(tokens)) or held_key != block_key(
                tokens, index, block_size
            ):
                found.append(
                    f"PC9: block {held} of {rid!r} (index {index}) has a key that is not "
                    "its computed prefix"
                )
    if nano:
        found.extend(nano_pool_violations(cache))
    return found


def _table_length(request: RequestState, computed: int, block_size: int) -> int:
    """PC1: the blocks ``request`` should hold with ``computed`` tokens cached (with
    blocks ahead, -1, never a length, for a malformed request: counts below zero)."""
    if request.num_blocks_ahead == 0:  # without drafts: cdiv, no branch for the solver
        return -(-computed // block_size)
    if min(computed, request.num_computed_tokens, request.num_blocks_ahead) < 0:
        return -1
    cached = max(computed, request.num_computed_tokens)
    return table_blocks(cached, request.num_computed_tokens, request.num_blocks_ahead, block_size)


def nano_pool_violations(cache: PrefixCacheState) -> list[str]:
    """What nano-vllm's cache keeps besides PC1 and PC9 (which hold there too, except
    that a shared block may have lost its key, nano-vllm/last-key-wins): each key
    names one block, and no free block has a key (nano-vllm/drop-key-on-free).
    """
    found: list[str] = []
    keys = [key for key, _ in cache.cached]
    if len(set(keys)) != len(keys):
        found.append("nano-vllm/last-key-wins: a key names two blocks")
    keyed_free = sorted({block for _, block in cache.cached} & set(cache.free_queue))
    if keyed_free:
        found.append(f"nano-vllm/drop-key-on-free: free blocks {keyed_free} have keys")
    return found
