"""What must hold of every state between steps, and of every step (R1-R10).

``state_violations(state)`` and ``plan_violations(before, plan, after)`` return one
readable line per broken rule (empty when all is well), so a failing test says which
rule broke and for which request. ``check_state`` / ``check_plan`` are the boolean
forms used by the PEP 316 contracts of the transitions (``pre: check_state(state)``,
``post: check_state(__return__)``).

These checks are written independently of the transitions: they restate the rules as
properties of the values, not as a second copy of the algorithm. The mid-step value
that ``schedule`` returns is not a state between steps and is not checked here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import groupby

from spec.kv import blocks_held
from spec.policies import is_registered
from spec.prefix_cache import pool_violations
from spec.profiles import (
    decode_unbudgeted,
    gpu_blocks_owned,
    length_capped,
    model_len,
    num_tokens_with_placeholders,
    num_tokens_with_spec,
    offloads_starved,
    prefill_first,
    reserves_generation,
    running_capped,
    single_prefill_violations,
    speculative,
    too_large,
)
from spec.speculative import PAD, num_drafts_run
from spec.types import (
    FinishedRequest,
    FinishReason,
    PreemptionMode,
    RequestState,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
)


def _duplicates(ids: Iterable[object]) -> list[object]:
    return sorted((x for x, n in Counter(ids).items() if n > 1), key=repr)


def _queue_violations(state: SchedulerState) -> list[str]:
    """R1: every live request is in exactly one queue, under a unique id."""
    found: list[str] = []
    ids = [r.request_id for r in (*state.waiting, *state.running, *state.swapped)]
    for rid in _duplicates(ids):
        found.append(f"R1: request {rid!r} appears more than once in the queues")
    # nano-vllm/seq-limit-per-step: max_num_seqs bounds a step's requests, not running.
    if running_capped(state.config) and len(state.running) > state.config.max_num_seqs:
        found.append(
            f"R8: {len(state.running)} running requests > max_num_seqs {state.config.max_num_seqs}"
        )
    return found


def _kv_violations(state: SchedulerState) -> list[str]:
    """R2: free + owned == total on both pools, and nothing below zero."""
    config = state.config
    found: list[str] = []
    gpu_owned, cpu_owned = blocks_in_use(state)
    pools = (
        ("GPU", state.num_free_gpu_blocks, gpu_owned, config.num_gpu_blocks),
        ("CPU", state.num_free_cpu_blocks, cpu_owned, config.num_cpu_blocks),
    )
    for pool, free, owned, total in pools:
        if free < 0:
            found.append(f"R2: {pool} free blocks {free} < 0")
        if free + owned != total:
            found.append(
                f"R2: {pool} blocks not conserved: free {free} + owned {owned} != total {total}"
            )
        if owned > total:
            found.append(f"R2: {pool} blocks used {owned} > capacity {total}")
    return found


def _request_violations(state: SchedulerState, queue: str, request: RequestState) -> list[str]:
    """R2, R4, R10 on one request in ``queue``."""
    found: list[str] = []
    rid = request.request_id
    params = request.request.params
    prompt_len = len(request.request.prompt_token_ids)
    computed = request.num_computed_tokens
    if prompt_len < 1:
        found.append(f"R4: {queue} request {rid!r} has an empty prompt")
    if params.max_tokens < 1:
        found.append(f"R4: {queue} request {rid!r} has max_tokens {params.max_tokens} < 1")
    elif prompt_len >= 1 and too_large(state.config, prompt_len, params.max_tokens):
        found.append(f"R4: {queue} request {rid!r} is too large but was accepted")
    placeholders = request.num_output_placeholders
    if queue == "waiting":
        if computed != 0 or placeholders != 0:
            found.append(
                f"R2: waiting request {rid!r} has computed {computed}, placeholders "
                f"{placeholders}, not 0"
            )
    elif not 1 <= computed < num_tokens_with_placeholders(request):
        found.append(
            f"R2: {queue} request {rid!r} needs 1 <= computed < num_tokens + placeholders, "
            f"got computed {computed}, num_tokens {request.num_tokens}, placeholders "
            f"{placeholders}"
        )
    elif (
        queue == "running"
        and decode_unbudgeted(state.config)
        and computed != request.num_tokens - 1
    ):
        found.append(
            f"nano-vllm/decode-unbudgeted: running request {rid!r} has "
            f"{request.num_tokens - computed} tokens to compute; without chunked prefill "
            "a running request is one decode from its end"
        )
    found.extend(_in_flight_violations(state, queue, request))
    found.extend(_draft_violations(state.config, queue, request))
    length = model_len(state.config)
    # vllm-v0/max-model-len accepts a prompt of exactly max_model_len tokens (it stops
    # at its first output); every other live request is below it.
    fresh_at_length = (
        state.config.semantics is Semantics.VLLM_V0
        and not request.output_token_ids
        and request.num_tokens == length
    )
    if length is not None and request.num_tokens >= length and not fresh_at_length:
        found.append(
            f"R10: {queue} request {rid!r} holds {request.num_tokens} tokens >= max_model_len "
            f"{length} but did not finish"
        )
    if len(request.output_token_ids) >= params.max_tokens:
        found.append(
            f"R10: {queue} request {rid!r} has {len(request.output_token_ids)} outputs "
            f">= max_tokens {params.max_tokens} but did not finish"
        )
    if eos_sampled(request):
        found.append(f"R10: {queue} request {rid!r} sampled EOS but did not finish")
    if request.num_preemptions < 0:
        found.append(f"R6: {queue} request {rid!r} has num_preemptions < 0")
    mode = state.config.preemption_mode
    if queue == "swapped" and mode is not PreemptionMode.SWAP:
        found.append(f"R6: request {rid!r} is swapped, but {mode} mode never swaps")
    if queue == "waiting" and mode is PreemptionMode.RESTART and request.output_token_ids:
        found.append(f"R6: waiting request {rid!r} kept outputs, but restart mode drops them")
    if not 0 <= request.request.arrival < state.next_arrival:
        found.append(
            f"R4: {queue} request {rid!r} has arrival {request.request.arrival} outside "
            f"0..{state.next_arrival - 1}"
        )
    return found


def _draft_violations(config: SchedulerConfig, queue: str, request: RequestState) -> list[str]:
    """vllm-v1/spec-*: drafts and blocks ahead only on a running request, under
    speculative decoding; at most ``K`` drafts, none a pad (pads live inside a step)
    and none on a request mid-prefill (vllm-v1/spec-propose)."""
    rid = request.request_id
    drafts = request.spec_token_ids
    found: list[str] = []
    if (drafts or request.num_blocks_ahead) and (queue != "running" or not speculative(config)):
        found.append(f"spec-propose: {queue} request {rid!r} holds drafts or blocks ahead")
    if request.num_blocks_ahead < 0:
        found.append(f"spec-rejected-blocks-kept: {rid!r} has {request.num_blocks_ahead} ahead")
    if len(drafts) > config.num_speculative_tokens or PAD in drafts:
        found.append(f"spec-propose: {rid!r} holds drafts {drafts}")
    if drafts and (request.num_computed_tokens != request.num_tokens - 1 or not request.decoding):
        found.append(f"spec-propose: {rid!r} holds drafts but is not decoding")
    return found


def _in_flight_violations(state: SchedulerState, queue: str, request: RequestState) -> list[str]:
    """vllm-v1/async-*: a request's in-flight counts agree with the steps in flight (none
    without async scheduling); only a waiting request has stale tokens, at most its
    in-flight ones; a running one has a placeholder per sampling chunk in flight."""
    rid = request.request_id
    mine = (rid, request.request.arrival)
    scheduled = sampling = 0  # its tokens in the steps in flight, and its sampling steps
    for batch in state.in_flight:
        for chunk, arrival in zip(batch.scheduled, batch.arrivals, strict=True):
            if (chunk.request_id, arrival) == mine:
                scheduled += chunk.num_tokens
                sampling += rid in batch.sampling_ids
    in_flight = request.num_in_flight_tokens
    stale = request.num_stale_output_tokens
    found: list[str] = []
    if in_flight != scheduled:
        found.append(
            f"async-placeholders: {queue} request {rid!r} has {in_flight} tokens in flight, "
            f"the steps in flight schedule {scheduled}"
        )
    if not 0 <= stale <= in_flight or (stale and queue != "waiting"):
        found.append(f"async-stale-output: {queue} request {rid!r} has {stale} stale tokens")
    if queue == "running" and not stale and request.num_output_placeholders != sampling:
        found.append(
            f"async-placeholders: running request {rid!r} has "
            f"{request.num_output_placeholders} placeholders for {sampling} sampling steps "
            "in flight"
        )
    return found


def _prefix_cache_violations(
    state: SchedulerState, extra_tokens: dict[str, int] | None = None
) -> list[str]:
    """PC1, PC9: the pool is there exactly when caching is on, and it is consistent."""
    config = state.config
    cache = state.prefix_cache
    if cache is None:
        found = [] if not config.enable_prefix_caching else ["PC1: caching is on but no pool"]
        if any(r.block_ids for r in (*state.waiting, *state.running, *state.swapped)):
            found.append("PC1: block ids kept with prefix caching off")
        return found
    if not config.enable_prefix_caching:
        return ["PC1: a block pool with prefix caching off"]
    found = pool_violations(config, cache, state.running, extra_tokens=extra_tokens)
    if len(cache.free_queue) != state.num_free_gpu_blocks:
        found.append(
            f"PC1: num_free_gpu_blocks {state.num_free_gpu_blocks} != free queue length "
            f"{len(cache.free_queue)}"
        )
    for r in (*state.waiting, *state.swapped):
        if r.block_ids:
            found.append(f"PC1: {r.request_id!r} holds GPU blocks but is not running")
    return found


def state_violations(state: SchedulerState) -> tuple[str, ...]:
    """Every rule a state between steps breaks, one line each; empty when valid.

    - R1: each live request is in exactly one of ``waiting``/``running``/``swapped``,
      ids unique; at most ``max_num_seqs`` running (R7, R8 never exceed it);
    - R2: on both pools ``free + owned == total`` with ``free >= 0`` (so used <=
      capacity); a waiting request has ``computed == 0``, a running or swapped one
      ``1 <= computed < num_tokens + placeholders`` (placeholders: async scheduling
      only, vllm-v1/async-placeholders); under async scheduling each request's tokens
      in flight, stale tokens and placeholders agree with the steps in flight;
    - R4: every live request has a prompt, ``max_tokens >= 1`` and could fit alone;
      arrivals are unique and below ``next_arrival``;
    - R6: only swap mode swaps (``swapped`` is empty in the other modes), and restart
      mode drops a victim's outputs (a waiting request has none). Found by CrossHair
      (``spec.contracts.head_progresses``): without these, a state that no run reaches
      (in restart mode with chunked prefill off, a swapped request, or a waiting one
      with outputs, whose re-prefill exceeds the budget) would satisfy every other
      rule and never be served;
    - R10: a live request has fewer than ``max_tokens`` outputs and no EOS among them
      (unless ``ignore_eos``): otherwise it would have finished;
    - R9: the configured policy is registered; counters are not negative;
    - PC1, PC9 (prefix caching on): free queue and blocks in use partition the pool
      (shared blocks counted once), ``num_free_gpu_blocks`` is the free queue's
      length, each running request holds ``cdiv(computed, bs)`` distinct blocks, every
      key of a held block is its holder's computed prefix at that block, a shared block
      has a key; with caching off there is no pool and no block id;
    - nano-vllm/decode-unbudgeted: a running request is one decode from its end (its
      prefills are whole; found by CrossHair: a state with two tokens left would be
      scheduled whole, unbudgeted, past the step's token limit).
    """
    found = _queue_violations(state)
    found.extend(_kv_violations(state))
    found.extend(single_prefill_violations(state.config, state.running))
    for queue, requests in (
        ("waiting", state.waiting),
        ("running", state.running),
        ("swapped", state.swapped),
    ):
        for request in requests:
            found.extend(_request_violations(state, queue, request))
    arrivals = [r.request.arrival for r in (*state.waiting, *state.running, *state.swapped)]
    for arrival in _duplicates(arrivals):
        found.append(f"R4: arrival {arrival} is shared by more than one request")
    found.extend(_prefix_cache_violations(state))
    if not is_registered(state.config.policy):
        found.append(f"R9: policy {state.config.policy!r} is not registered")
    if state.num_steps < 0 or state.next_arrival < 0:
        found.append("counters: num_steps and next_arrival must be >= 0")
    return tuple(found)


def check_state(state: SchedulerState) -> bool:
    """True when ``state`` is a valid state between steps (no ``state_violations``)."""
    return not state_violations(state)


def blocks_in_use(
    state: SchedulerState, scheduled: tuple[ScheduledChunk, ...] = ()
) -> tuple[int, int]:
    """R2: the ``(GPU, CPU)`` blocks the live requests own, with ``scheduled`` holding theirs.

    A running request owns ``cdiv(computed + n, bs)`` GPU blocks while its chunk of ``n``
    tokens is scheduled (in the middle of a step) and ``cdiv(computed, bs)`` otherwise; a
    swapped one ``cdiv(computed, bs)`` CPU blocks; a waiting one none. With prefix
    caching on, the GPU blocks are the distinct ids the running requests hold (a
    shared block counted once, PC1; a scheduled chunk's blocks are in its request's
    ``block_ids`` already).
    """
    bs = state.config.block_size
    if state.prefix_cache is None:
        chunk_of = {chunk.request_id: chunk.num_tokens for chunk in scheduled}
        gpu = sum(
            gpu_blocks_owned(
                state.config, r, max(r.num_computed_tokens + chunk_of.get(r.request_id, 0), 0)
            )
            for r in state.running
        )
    else:
        gpu = len({b for r in state.running for b in r.block_ids})
    cpu = sum(blocks_held(max(r.num_computed_tokens, 0), bs) for r in state.swapped)
    return gpu, cpu


def kv_conserved_mid_step(state_mid: SchedulerState, scheduled: tuple[ScheduledChunk, ...]) -> bool:
    """R2 in the middle of a step: blocks are conserved once the chunks hold theirs.

    During phases A-C a scheduled running request already owns the blocks of its
    chunk (``blocks_in_use``). Both pools then have ``free >= 0`` and ``free + owned ==
    total``, every chunk names a different running request, and at most
    ``max_num_seqs`` requests run (except under nano-vllm/seq-limit-per-step). With
    prefix caching on, the pool is consistent too (PC1, PC9, a scheduled request
    holding the blocks of its chunk). (Between steps, with no chunk, this is the R2
    part of ``state_violations``.)
    """
    config = state_mid.config
    chunk_ids = {chunk.request_id for chunk in scheduled}
    running_ids = {r.request_id for r in state_mid.running}
    if len(chunk_ids) != len(scheduled) or not chunk_ids <= running_ids:
        return False
    if state_mid.prefix_cache is not None and _prefix_cache_violations(
        state_mid, {chunk.request_id: chunk.num_tokens for chunk in scheduled}
    ):
        return False
    gpu_owned, cpu_owned = blocks_in_use(state_mid, scheduled)
    return (
        state_mid.num_free_gpu_blocks >= 0
        and state_mid.num_free_cpu_blocks >= 0
        and state_mid.num_free_gpu_blocks + gpu_owned == config.num_gpu_blocks
        and state_mid.num_free_cpu_blocks + cpu_owned == config.num_cpu_blocks
        and (not running_capped(config) or len(state_mid.running) <= config.max_num_seqs)
    )


def eos_sampled(request: RequestState) -> bool:
    """R10: whether the request's outputs hold its EOS token and it does not ignore EOS
    (it should then have finished)."""
    params = request.request.params
    return (
        not params.ignore_eos
        and params.eos_token_id is not None
        and params.eos_token_id in request.output_token_ids
    )


def outputs_extended(
    state_mid: SchedulerState,
    runs: Mapping[str, tuple[int, ...]],
    after: SchedulerState,
    finished: tuple[FinishedRequest, ...],
) -> bool:
    """R1, R3, R10 across phase D: every running request of ``state_mid`` is, after it,
    either still running (in the same order) or finished, not both; its outputs are
    its outputs before plus its run from ``runs`` if it sampled (outputs are only
    appended: a running request's whole run, a finished one's run up to the token
    that stopped it, at least one); and nothing else appears in ``running``.
    """
    outputs_of = {r.request_id: r.output_token_ids for r in after.running}
    outputs_of_finished = {f.request_id: f.output_token_ids for f in finished}
    if len(outputs_of) != len(after.running) or outputs_of.keys() & outputs_of_finished.keys():
        return False
    if [r.request_id for r in after.running] != [
        r.request_id for r in state_mid.running if r.request_id in outputs_of
    ]:
        return False
    for request in state_mid.running:
        rid = request.request_id
        before = request.output_token_ids
        run = runs.get(rid, ())
        whole = (*before, *run)
        if rid in outputs_of:
            if outputs_of[rid] != whole:
                return False
        elif rid in outputs_of_finished and outputs_of_finished[rid] != whole:
            got = outputs_of_finished[rid]  # a run cut after its stop (vllm-v1/spec-verify)
            new = got[len(before) :]
            if len(run) < 2 or got[: len(before)] != before or not new or new != run[: len(new)]:
                return False
    return len(outputs_of) + len(outputs_of_finished) == len(state_mid.running)


def live_ids_sorted(state: SchedulerState) -> list[str]:
    """The ids of every live request, sorted: equal before and after a step's phases A-C
    (no request lost or duplicated, R1)."""
    return sorted(r.request_id for r in (*state.waiting, *state.running, *state.swapped))


# --- a step --------------------------------------------------------------------------


def _index(state: SchedulerState) -> dict[str, tuple[str, RequestState]]:
    return {
        r.request_id: (queue, r)
        for queue, requests in (
            ("waiting", state.waiting),
            ("running", state.running),
            ("swapped", state.swapped),
        )
        for r in requests
    }


def _ids(requests: Iterable[RequestState]) -> list[str]:
    return [r.request_id for r in requests]


def _admitted(old: dict[str, tuple[str, RequestState]], plan: StepPlan) -> list[str]:
    """The scheduled requests that were waiting before the step: the admitted ones."""
    return [c.request_id for c in plan.scheduled if old.get(c.request_id, ("",))[0] == "waiting"]


def _run_reason(
    config: SchedulerConfig, request: RequestState, run: tuple[int, ...]
) -> tuple[int, FinishReason | None]:
    """R10 token by token: how many of ``run``'s tokens a request delivers, and why it
    stops after the last of them (None: it goes on)."""
    params = request.request.params
    outputs = len(request.output_token_ids)
    for k, token in enumerate(run, 1):
        if not params.ignore_eos and token == params.eos_token_id:
            return k, FinishReason.STOP
        if length_capped(config, request.num_tokens + k, outputs + k, params.max_tokens):
            return k, FinishReason.LENGTH
    return len(run), None


def plan_runs(plan: StepPlan) -> dict[str, tuple[int, ...]]:
    """The plan's sampled tokens as each request's run (vllm-v1/spec-verify: a request
    that verified drafts samples several, one after the other), in plan order. No
    contract: a projection the contracts use (CrossHair would assume a looser one).
    """
    runs: dict[str, tuple[int, ...]] = {}
    for request_id, token in zip(plan.sampled_ids, plan.sampled_token_ids, strict=True):
        runs[request_id] = (*runs.get(request_id, ()), token)
    return runs


def _chunk_violations(before: SchedulerState, plan: StepPlan) -> list[str]:
    """R5, R7, R8: budget, one chunk per request, chunks continue where computing stopped."""
    config = before.config
    found: list[str] = []
    total = sum(c.num_tokens for c in plan.scheduled)
    old = _index(before)
    if decode_unbudgeted(config) and not _admitted(old, plan):
        # nano-vllm/decode-unbudgeted: a decode step is bounded by max_num_seqs requests.
        if len(plan.scheduled) > config.max_num_seqs:
            found.append(
                f"R5: decode step schedules {len(plan.scheduled)} requests > max_num_seqs "
                f"{config.max_num_seqs}"
            )
    elif total > config.max_num_batched_tokens:
        found.append(
            f"R5: plan schedules {total} tokens > max_num_batched_tokens "
            f"{config.max_num_batched_tokens}"
        )
    for rid in _duplicates(c.request_id for c in plan.scheduled):
        found.append(f"R5: request {rid!r} is scheduled more than once")
    for chunk in plan.scheduled:
        rid = chunk.request_id
        if rid not in old:
            found.append(f"R5: scheduled request {rid!r} was not live")
            continue
        request = old[rid][1]
        if chunk.num_tokens < 1:
            found.append(f"R5: chunk of {rid!r} has {chunk.num_tokens} tokens < 1")
        hit_ok = (
            before.prefix_cache is not None
            and old[rid][0] == "waiting"
            and chunk.start % config.block_size == 0
            and 0 <= chunk.start < request.num_tokens
        )
        if chunk.start != request.num_computed_tokens and not hit_ok:  # PC3: after a hit
            found.append(
                f"R5: chunk of {rid!r} starts at {chunk.start}, not at its computed "
                f"{request.num_computed_tokens}"
            )
        limit = _chunk_end_limit(config, old[rid][0], request, chunk.start)
        if chunk.start + chunk.num_tokens > limit:
            found.append(
                f"R5: chunk of {rid!r} ends at {chunk.start + chunk.num_tokens} > {limit} "
                f"(num_tokens {request.num_tokens}, placeholders "
                f"{request.num_output_placeholders}, drafts {len(request.spec_token_ids)})"
            )
    return found


def _chunk_end_limit(config: SchedulerConfig, queue: str, request: RequestState, start: int) -> int:
    """R5: where a chunk from ``start`` may end: the request's tokens, placeholders and
    (running) drafts; a one-token admission padded to ``1 + K``
    (vllm-v1/spec-padded-new-decode); with drafts, below ``max_model_len``."""
    if queue == "waiting" and speculative(config) and request.num_tokens - start == 1:
        return start + 1 + config.num_speculative_tokens
    limit = num_tokens_with_spec(request)
    length = model_len(config)
    if request.spec_token_ids and length is not None:
        limit = min(limit, max(length - 1, request.num_tokens))
    return limit


def _queue_change_violations(before: SchedulerState, plan: StepPlan) -> list[str]:
    """R6, R7, R8: who may be preempted, swapped in and admitted in one step."""
    found: list[str] = []
    old = _index(before)
    scheduled = {c.request_id for c in plan.scheduled}
    preempted_ids = [p.request_id for p in plan.preempted]
    for rid in _duplicates(preempted_ids):
        found.append(f"R6: request {rid!r} preempted twice in one step")
    for p in plan.preempted:
        if old.get(p.request_id, ("", None))[0] != "running":
            found.append(f"R6: preempted request {p.request_id!r} was not running")
        if p.request_id in scheduled:
            found.append(f"R6: preempted request {p.request_id!r} was also scheduled")
        mode = before.config.preemption_mode
        if p.mode != mode and not (
            mode is PreemptionMode.SWAP and p.mode is PreemptionMode.RECOMPUTE
        ):
            found.append(f"R6: {p.request_id!r} preempted by {p.mode}, config says {mode}")
    swapped_before = _ids(before.swapped)
    for rid in plan.swapped_in:
        if rid not in scheduled:
            found.append(f"R7: swapped-in request {rid!r} was not scheduled")
    admitted = _admitted(old, plan)
    if offloads_starved(before.config):
        # transformers/skip-not-fit, offloaded-interleaved, offload-starved: swap-ins in
        # queue order but any of them, admissions beside them and beside victims.
        if list(plan.swapped_in) != [r for r in swapped_before if r in plan.swapped_in]:
            found.append(f"R7: swapped_in {list(plan.swapped_in)} is out of queue order")
        return found
    if list(plan.swapped_in) != swapped_before[: len(plan.swapped_in)]:
        found.append(
            f"R7: swapped_in {list(plan.swapped_in)} is not a prefix of swapped {swapped_before}"
        )
    if plan.preempted and (plan.swapped_in or admitted):
        found.append("R7/R8: requests swapped in or admitted in a step that preempted")
    if admitted and len(plan.swapped_in) < len(swapped_before):
        found.append("R8: waiting requests admitted while swapped requests remain")
    if prefill_first(before.config) and admitted and len(admitted) != len(plan.scheduled):
        found.append("nano-vllm/prefill-first: running requests ran in a step that admitted")
    return found


def _sampling_violations(before: SchedulerState, plan: StepPlan) -> list[str]:
    """R10: exactly the chunks that complete a request sample; finishing follows EOS/length.
    vllm-v1/spec-verify: a request's tokens are one run, at most its drafts plus one,
    all but the last its drafts, cut after the token that stops it."""
    found: list[str] = []
    old = _index(before)
    if before.config.async_scheduling:
        # vllm-v1/async-commit: the step applied now is an earlier one (or none).
        from spec.pipeline import applied_from, live_sampling_ids  # noqa: PLC0415

        applied = applied_from(before, plan)
        expected = [] if applied is None else list(live_sampling_ids(applied, before))
    else:
        expected = [
            c.request_id
            for c in plan.scheduled
            if c.request_id in old and c.start + c.num_tokens >= old[c.request_id][1].num_tokens
        ]
    runs = plan_runs(plan)
    got = list(runs)
    if got != expected:
        found.append(f"R10: sampled {got}, expected the completing chunks {expected}")
    if len(list(groupby(plan.sampled_ids))) != len(runs):
        found.append(f"R10: a request's sampled tokens are not one run: {plan.sampled_ids}")
    chunk_of = {c.request_id: c for c in plan.scheduled}
    for rid, run in runs.items():
        chunk = chunk_of.get(rid)
        if rid not in old or chunk is None or before.config.async_scheduling:
            continue
        drafts = old[rid][1].spec_token_ids
        num_drafts = num_drafts_run(old[rid][1], chunk.start, chunk.num_tokens)
        if len(run) > num_drafts + 1 or run[:-1] != drafts[: len(run) - 1]:
            found.append(f"R10: {rid!r} sampled {run}, its drafts {drafts[:num_drafts]}")
    reasons = {
        rid: _run_reason(before.config, old[rid][1], run) for rid, run in runs.items() if rid in old
    }
    expected_finished = [rid for rid in got if rid in reasons and reasons[rid][1] is not None]
    finished_ids = [f.request_id for f in plan.finished]
    if finished_ids != expected_finished:
        found.append(f"R10: finished {finished_ids}, expected {expected_finished}")
    for rid, (delivered, _) in reasons.items():
        if delivered != len(runs[rid]):
            found.append(f"R10: {rid!r} sampled {runs[rid]} past the token that stopped it")
    for f in plan.finished:
        if f.request_id not in reasons:
            continue
        request = old[f.request_id][1]
        run = runs[f.request_id]
        if f.output_token_ids != (*request.output_token_ids, *run):
            found.append(f"R10: finished {f.request_id!r} reports outputs {f.output_token_ids}")
        reason = reasons[f.request_id][1]
        if f.finish_reason != reason:
            found.append(f"R10: {f.request_id!r} finished with {f.finish_reason}, not {reason}")
        victim = any(p.request_id == f.request_id for p in plan.preempted)  # async: stale stop
        if f.num_preemptions != request.num_preemptions + victim:
            found.append(f"R10: {f.request_id!r} reports a wrong num_preemptions")
    return found


def _after_violations(before: SchedulerState, plan: StepPlan, after: SchedulerState) -> list[str]:
    """R1, R3, R5-R10: the queues and requests after the step are what the plan says."""
    found: list[str] = []
    old = _index(before)
    chunk_of = {c.request_id: c for c in plan.scheduled}
    mode_of = {p.request_id: p.mode for p in plan.preempted}
    run_of = plan_runs(plan)
    finished = {f.request_id for f in plan.finished}
    admitted = _admitted(old, plan)
    admitted_set = set(admitted)
    swapped_in = set(plan.swapped_in)
    # R1/R3: nothing lost, nothing duplicated, finished requests gone.
    live_before = set(old)
    live_after = _ids((*after.waiting, *after.running, *after.swapped))
    lost = sorted(live_before - finished - set(live_after))
    extra = sorted(set(live_after) - (live_before - finished))
    if lost or extra:
        found.append(f"R1: requests lost {lost} or appeared {extra} during the step")
    for rid in _duplicates(live_after):
        found.append(f"R1: request {rid!r} is in the queues more than once after the step")
    # Queue orders: R6-R8, or transformers/victims-at-tail (victims at the tails, oldest
    # first; swap-ins and admissions in walk order), tokenspeed/submission-order.
    config = before.config
    tail = offloads_starved(config)
    joined = [*plan.swapped_in, *admitted]
    if tail:
        joined = [c.request_id for c in plan.scheduled if c.request_id in {*joined}]
    running = [
        rid
        for rid in (*(rid for rid in _ids(before.running) if rid not in mode_of), *joined)
        if rid not in finished
    ]
    if reserves_generation(config):
        arrival = {rid: old[rid][1].request.arrival for rid in running}
        running.sort(key=arrival.__getitem__)
    if _ids(after.running) != running:
        found.append(f"R5-R8: running is {_ids(after.running)}, expected {running}")
    # Under async scheduling a victim may also finish in its step (a stop delivered
    # stale: vllm-v1/async-stale-output), and a waiting request too.
    to_waiting = [
        p.request_id
        for p in plan.preempted
        if p.mode is not PreemptionMode.SWAP and p.request_id not in finished
    ]
    kept_waiting = [
        rid for rid in _ids(before.waiting) if rid not in admitted_set and rid not in finished
    ]
    waiting = (
        [*kept_waiting, *reversed(to_waiting)] if tail else [*reversed(to_waiting), *kept_waiting]
    )
    if _ids(after.waiting) != waiting:
        found.append(f"R6/R8: waiting is {_ids(after.waiting)}, expected {waiting}")
    to_swapped = [p.request_id for p in plan.preempted if p.mode is PreemptionMode.SWAP]
    swapped = [
        *(rid for rid in _ids(before.swapped) if rid not in swapped_in),
        *(reversed(to_swapped) if tail else to_swapped),
    ]
    if _ids(after.swapped) != swapped:
        found.append(f"R6/R7: swapped is {_ids(after.swapped)}, expected {swapped}")
    # Each request's new progress.
    for request in (*after.waiting, *after.running, *after.swapped):
        rid = request.request_id
        if rid not in old:
            continue
        prev = old[rid][1]
        if request.request != prev.request:
            found.append(f"R1: request {rid!r} changed its identity or parameters")
        want = _expected_progress(prev, chunk_of.get(rid), mode_of.get(rid), run_of.get(rid))
        got = (request.output_token_ids, request.num_computed_tokens, request.num_preemptions)
        if got != want:
            found.append(
                f"R6/R10: {rid!r} has (outputs, computed, preemptions) {got}, expected {want}"
            )
    return found


def _expected_progress(
    prev: RequestState,
    chunk: ScheduledChunk | None,
    mode: PreemptionMode | None,
    run: tuple[int, ...] | None,
) -> tuple[tuple[int, ...], int, int]:
    outputs = prev.output_token_ids
    if run is not None:  # a victim's stale output is delivered too (async scheduling)
        outputs = (*outputs, *run)
    if mode is not None:
        if mode is PreemptionMode.SWAP:
            return outputs, prev.num_computed_tokens, prev.num_preemptions + 1
        if mode is PreemptionMode.RESTART:
            outputs = ()
        return outputs, 0, prev.num_preemptions + 1
    computed = prev.num_computed_tokens
    if chunk is not None:  # from the chunk's start: an admission may begin after a hit (PC4)
        computed = chunk.start + chunk.num_tokens
        if run is not None:  # vllm-v1/spec-verify: the rejected drafts are rolled back
            computed -= num_drafts_run(prev, chunk.start, chunk.num_tokens) - (len(run) - 1)
    return outputs, computed, prev.num_preemptions


def plan_violations(
    before: SchedulerState, plan: StepPlan, after: SchedulerState
) -> tuple[str, ...]:
    """Every rule a step ``before -> after`` with ``plan`` breaks; empty when it is valid.

    - the plan's ``step`` is ``before.num_steps``, and ``after.num_steps`` one more;
    - R5: at most ``max_num_batched_tokens`` tokens; no request scheduled twice; each
      chunk has ``>= 1`` token, starts at the request's ``computed`` and ends at or
      before its ``num_tokens``;
    - R6: victims were running and are not scheduled; the mode is the configured one
      (or recompute, the swap fallback); R7/R8: nothing swapped in or admitted in a
      step that preempted, swap-ins are a prefix of ``swapped``, no admission while a
      swapped request stays swapped;
    - R10: ``sampled`` is exactly the chunks that complete their request, in plan
      order; ``finished`` is exactly those whose token is EOS (``stop``) or the last
      allowed (``length``), in the same order, with the right outputs;
    - R1/R3: no request lost or duplicated (live before == live after + finished); the
      queues after are in the order the rules give; each request's outputs, computed
      count and preemption count changed exactly as its chunk, sample or preemption says.

    It checks the step, not the states: combine with ``state_violations(after)``.
    """
    found: list[str] = []
    if plan.step != before.num_steps:
        found.append(f"step: plan.step {plan.step} != before.num_steps {before.num_steps}")
    if after.num_steps != before.num_steps + 1:
        found.append(f"step: after.num_steps {after.num_steps} != {before.num_steps + 1}")
    if after.config != before.config or after.next_arrival != before.next_arrival:
        found.append("step: the config or next_arrival changed during a step")
    found.extend(_chunk_violations(before, plan))
    found.extend(_queue_change_violations(before, plan))
    found.extend(_sampling_violations(before, plan))
    found.extend(_after_violations(before, plan, after))
    return tuple(found)


def check_plan(before: SchedulerState, plan: StepPlan, after: SchedulerState) -> bool:
    """True when the step ``before -> after`` with ``plan`` is valid (no ``plan_violations``)."""
    return not plan_violations(before, plan, after)
