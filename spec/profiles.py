"""The rules of the semantics profiles (docs/semantics.md, "Semantics profiles").

``SchedulerConfig.semantics`` selects a profile. ``kvsched`` is R1-R11 as written;
``vllm-v1`` and ``nano-vllm`` replace some of them with the named rules below, each a
pure function beside the text of its rule and the peer source it follows (paths in
vLLM 0.32.0's ``vllm/`` and nano-vllm-fork 20260210's ``nanovllm/``). This is the one
module of the spec's logic that names a profile: the phases in ``spec.scheduler``,
``spec.lifecycle`` and ``spec.liveness`` ask these functions, never the profile's name,
so each rule is written once. A profile's block-pool rules (where its prefix cache
differs from PC1-PC9) are written in ``spec.prefix_cache`` beside the rule they
replace, and chosen there by a predicate of this module; this module imports nothing
of ``spec.prefix_cache``.

The settings a profile implies are ``profile_defaults``'s; its config-time constraints
are ``SchedulerConfig.__post_init__``'s (in ``spec.types``, which the engine may import).
"""

from __future__ import annotations

from typing import TypedDict

from spec.kv import cdiv, never_fits
from spec.types import RequestState, SchedulerConfig, Semantics

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
    a setting given explicitly wins.

    post: SchedulerConfig(num_gpu_blocks=1, semantics=semantics, **__return__) is not None
    """
    if semantics is Semantics.NANO_VLLM:
        return {"enable_chunked_prefill": False, "enable_prefix_caching": True}
    return {}


# --- vllm-v1/max-model-len (V1, V5) ----------------------------------------------------


def model_len(config: SchedulerConfig) -> int | None:
    """``max_model_len`` where the profile has one (vllm-v1), else None.

    post: (__return__ is None) == (config.semantics is not Semantics.VLLM_V1)
    """
    return config.max_model_len if config.semantics is Semantics.VLLM_V1 else None


def too_large(config: SchedulerConfig, prompt_len: int, max_tokens: int) -> bool:
    """R4 check 5, by profile: whether ``add_request`` refuses the request's size.

    ``kvsched``, ``nano-vllm``: ``never_fits`` (it could never be scheduled alone).

    **vllm-v1/max-model-len**, first half: a prompt of ``max_model_len`` tokens or more
    (vLLM's front end, ``v1/engine/input_processor.py:574-602``; its scheduler's
    ``add_request`` checks nothing, ``v1/core/sched/scheduler.py:2616``). There is no
    per-request fit check: the profile's config guarantees that ``max_model_len``
    tokens fit the GPU cache (``check_enough_kv_cache_memory``) and, with chunked
    prefill off, one step's budget, and the second half (``length_capped``) stops every
    request before it holds ``max_model_len`` tokens, so what is accepted fits alone.

    pre: prompt_len >= 1
    pre: max_tokens >= 1
    post: model_len(config) is not None or __return__ == never_fits(config, prompt_len, max_tokens)
    """
    length = model_len(config)
    if length is None:
        return never_fits(config, prompt_len, max_tokens)
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
    ``v1/core/sched/utils.py:114-119``, after the EOS check as in R10).

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
    """Whether ``running`` never holds more than ``max_num_seqs`` (R8), i.e. not nano-vllm.

    post: __return__ == (config.semantics is not Semantics.NANO_VLLM)
    """
    return config.semantics is not Semantics.NANO_VLLM


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
