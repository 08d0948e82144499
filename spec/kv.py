"""KV-cache block arithmetic (R2, R4).

The cache is counted in blocks of ``block_size`` token slots. A request whose first
``num_computed_tokens`` tokens have their K/V in a pool owns
``cdiv(num_computed_tokens, block_size)`` blocks of that pool (R2): a partly filled
last block is still a whole block. Everything here is integer arithmetic on token
counts; nothing knows which physical block holds what.

The contracts in the docstrings are PEP 316 (``pre:`` / ``post:``, ``__return__``), the
one style used throughout ``spec/``, checked by ``crosshair check spec/``.
"""

from __future__ import annotations

from spec.types import PreemptionMode, SchedulerConfig


def cdiv(a: int, b: int) -> int:
    """Ceiling division, ``ceil(a / b)``, for a count ``a >= 0`` and a size ``b >= 1``.

    pre: a >= 0
    pre: b >= 1
    post: (__return__ - 1) * b < a <= __return__ * b
    """
    return -(-a // b)


def blocks_held(num_computed_tokens: int, block_size: int) -> int:
    """R2: the blocks a request owns when ``num_computed_tokens`` tokens are cached.

    pre: num_computed_tokens >= 0
    pre: block_size >= 1
    post: (__return__ - 1) * block_size < num_computed_tokens <= __return__ * block_size
    """
    return cdiv(num_computed_tokens, block_size)


def blocks_needed(num_computed_tokens: int, num_new_tokens: int, block_size: int) -> int:
    """The new blocks a chunk of ``num_new_tokens`` tokens takes (R5 step 2).

    A request grows from ``cdiv(computed, bs)`` to ``cdiv(computed + n, bs)`` blocks:
    the chunk first fills the free slots of its last block, then takes whole blocks.

    pre: num_computed_tokens >= 0
    pre: num_new_tokens >= 0
    pre: block_size >= 1
    post: 0 <= __return__ <= cdiv(num_new_tokens, block_size)
    """
    return cdiv(num_computed_tokens + num_new_tokens, block_size) - cdiv(
        num_computed_tokens, block_size
    )


def blocks_to_grow(
    num_computed_tokens: int, num_new_tokens: int, num_blocks_ahead: int, block_size: int
) -> int:
    """The new blocks a chunk takes from a request that holds ``num_blocks_ahead``
    blocks past its computed tokens' (vllm-v1/spec-rejected-blocks-kept: its rejected
    drafts' blocks, which the chunk fills first); ``blocks_needed`` without them. No
    contract: the phases call it on every chunk, and CrossHair would assume a looser
    one in its place; without blocks ahead it is ``blocks_needed``'s, no more.
    """
    needed = blocks_needed(num_computed_tokens, num_new_tokens, block_size)
    if num_blocks_ahead == 0:  # without drafts: no comparison for the solver to branch on
        return needed
    return max(0, needed - num_blocks_ahead)


def table_blocks(
    num_cached: int, num_computed_tokens: int, num_blocks_ahead: int, block_size: int
) -> int:
    """R2 for a running request: the blocks its table holds with ``num_cached`` tokens
    cached (its computed count, or mid-step its chunk's end): ``cdiv(num_cached, bs)``,
    or its blocks ahead of its computed tokens when they reach further
    (vllm-v1/spec-rejected-blocks-kept). No contract, as for ``blocks_to_grow``:
    without blocks ahead it is ``cdiv``'s, no more.
    """
    held = cdiv(num_cached, block_size)
    if num_blocks_ahead == 0:  # without drafts: no comparison for the solver to branch on
        return held
    return max(held, cdiv(num_computed_tokens, block_size) + num_blocks_ahead)


def max_cached_tokens(prompt_len: int, max_tokens: int) -> int:
    """R4: ``L = P + M - 1``, the most tokens a request ever holds in the cache.

    Its last output is sampled but never written to the cache (it finishes first), so
    at most ``P`` prompt tokens and ``M - 1`` outputs are ever cached.

    pre: prompt_len >= 1
    pre: max_tokens >= 1
    post: prompt_len <= __return__ < prompt_len + max_tokens
    """
    return prompt_len + max_tokens - 1


def largest_prefill(prompt_len: int, max_tokens: int, mode: PreemptionMode) -> int:
    """R4: the largest prefill a request may ever need in one step.

    ``P`` in restart mode (a restarted request re-prefills only its prompt); ``L``
    otherwise, because a recompute re-prefills prompt + outputs, and a swap that does
    not fit the CPU pool falls back to recompute.

    pre: prompt_len >= 1
    pre: max_tokens >= 1
    post: prompt_len <= __return__ <= max_cached_tokens(prompt_len, max_tokens)
    """
    if mode is PreemptionMode.RESTART:
        return prompt_len
    return max_cached_tokens(prompt_len, max_tokens)


def fits_alone(config: SchedulerConfig, prompt_len: int, max_tokens: int) -> bool:
    """R4: a request alone in the engine fits: its ``L`` cached tokens fit the GPU pool's
    slots, and (chunked prefill off) its largest prefill one step's budget."""
    slots = config.num_gpu_blocks * config.block_size
    return max_cached_tokens(prompt_len, max_tokens) <= slots and (
        config.enable_chunked_prefill
        or largest_prefill(prompt_len, max_tokens, config.preemption_mode)
        <= config.max_num_batched_tokens
    )


def never_fits(config: SchedulerConfig, prompt_len: int, max_tokens: int) -> bool:
    """R4 check 5: whether a request could never be scheduled, even alone.

    True if its ``L`` tokens need more blocks than the whole GPU pool has, or, with
    chunked prefill off, if its largest prefill exceeds ``max_num_batched_tokens``
    (an unchunked prefill must fit one step's budget). A request for which this is
    false always fits when it is alone: that is the base of the liveness argument
    (see ``spec.liveness``).

    pre: prompt_len >= 1
    pre: max_tokens >= 1
    post: __return__ == (not fits_alone(config, prompt_len, max_tokens))
    """
    cached = max_cached_tokens(prompt_len, max_tokens)
    if blocks_held(cached, config.block_size) > config.num_gpu_blocks:
        return True
    if config.enable_chunked_prefill:
        return False
    prefill = largest_prefill(prompt_len, max_tokens, config.preemption_mode)
    return prefill > config.max_num_batched_tokens


def chunk_for_prefill(remaining: int, budget: int, chunked_prefill: bool) -> int:
    """R7 step 2 / R8 step 2: the chunk a swapped or waiting request asks for.

    ``min(remaining, budget)`` with chunked prefill on; the whole ``remaining``
    otherwise, in which case the caller stops when it is larger than the budget.

    pre: remaining >= 1
    pre: budget >= 1
    post: 1 <= __return__ <= remaining and (not chunked_prefill or __return__ <= budget)
    """
    if chunked_prefill:
        return min(remaining, budget)
    return remaining
