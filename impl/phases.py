"""The four phases of a step (R5-R10) as functions of the scheduler's state.

Phases A-C (``schedule_running``, ``swap_in``, ``admit``) decide what runs, mutate the
queues and block tables and record every change in the ``SchedulerOutput`` so that
``impl/rollback.py`` can undo it; phase D (``commit``) applies the sampled tokens and
finishes requests. ``Scheduler.schedule`` and ``Scheduler.commit`` call them in order.
They ask the GPU pool (``sched.gpu``, a ``BlockPool``) the prefix-caching questions
(PC2-PC4) whether caching is on or not; a pool without a cache answers no hit, no keys.

Over ~300 lines on purpose: the phases share the loop state of one step (budget, free
blocks, the output journal) and read best in the order they run, each next to the
rule it implements, rather than split across files that would pass that state around.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from impl.block_manager import cdiv
from impl.prefix_cache import forget_hashes
from impl.scheduler_output import PreemptionRecord, SchedulerOutput
from impl.sequence import Sequence, SequenceStatus
from impl.speculative import (
    PAD_TOKEN_ID,
    check_runs,
    chunk_with_drafts,
    may_pad,
    pads_admission,
)
from spec.types import (
    FinishedRequest,
    FinishReason,
    KVCacheExhaustedError,
    PreemptionMode,
    SampledTokensError,
)

if TYPE_CHECKING:
    from impl.scheduler import Scheduler

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED
_FINISHED = SequenceStatus.FINISHED

# --- phases A-C (R5-R8) -------------------------------------------------------------------


def schedule_running(sched: Scheduler, out: SchedulerOutput, budget: int) -> int:
    """Phase A (R5): every running request, head first, while the budget lasts."""
    running = sched.running
    bs = sched.block_size
    gpu = sched.gpu
    free = gpu.num_free_blocks
    num_scheduled = out.num_scheduled
    record = num_scheduled.append
    # vllm-v0/append-touches-last-block: a chunk wants a free block for every block it
    # writes into, its partly filled last one too (V0's worst case, copy-on-write).
    touches_last = sched.append_touches_last_block
    cap = sched.chunk_cap  # vllm-v1/long-prefill-cap
    capped = 0
    i = 0
    nrun = len(running)
    walks_past = sched.async_scheduling
    drafting = sched.num_speculative_tokens
    chunk_seqs = out.scheduled
    add_seq = chunk_seqs.append
    while i < nrun and budget > 0:
        seq = running[i]
        if walks_past and reaches_the_end(sched, seq):  # vllm-v1/async-max-tokens
            i += 1
            continue
        computed = seq.num_computed
        # vllm-v1/async-placeholders: a decode is scheduled on its placeholder (0 without
        # async scheduling).
        n = remaining = seq.num_tokens + seq.num_output_placeholders - computed
        if seq.spec_token_ids:  # vllm-v1/spec-drafts-scheduled
            n = chunk_with_drafts(sched, seq, remaining)
        if 0 < cap < n:
            n = cap
        n = min(n, budget)
        # A prefill chunk cut by the cap or the budget does not sample (a chunk cut among
        # its drafts still does).
        cut = n < remaining
        if cut:
            capped += 1
        table = seq.block_table
        end = computed + n
        held = len(table) * bs
        # Most decodes stay inside their last block: nothing to grow, nothing to key
        # (vllm-v0/append-touches-last-block: but it still wants a free block). With
        # drafts the table may hold blocks past the chunk (vllm-v1/spec-rejected-blocks-
        # kept) and the drafts accepted last step fill blocks not keyed yet: keys from K
        # positions back.
        if end >= held or touches_last or drafting:
            if end > held or touches_last:
                need = (end - 1) // bs + 1 - len(table)
                wanted = need + (touches_last and computed % bs != 0)
                if wanted > free:
                    if sched.victim_any_running:
                        preempted_itself, tokens, behind, not_sampled = make_room_any_running(
                            sched, out, i, need
                        )
                        # Undone chunks leave the plan even when the request then
                        # preempts itself (their samples must not be counted).
                        budget += tokens
                        i -= behind
                        capped -= not_sampled
                    else:
                        preempted_itself = make_room(sched, out, i, wanted)
                    if preempted_itself:
                        if cut:
                            capped -= 1  # it was not scheduled after all
                        break  # the request preempted itself: phase A ends
                    nrun = len(running)
                    free = gpu.num_free_blocks
                gpu.grow(table, len(table) + need)
                free -= need
            # PC2: blocks this chunk fills get keys, up to its known tokens. Under async
            # scheduling (vllm-v1/async-placeholders) the keys reach only the known
            # tokens before the placeholders, here and when a step is applied.
            known = seq.num_tokens
            keyed = computed - drafting if drafting < computed else 0
            gpu.cache_blocks(
                seq, keyed - seq.num_output_placeholders, end if end <= known else known
            )
        record(n)
        add_seq(seq)
        if drafting:
            out.tables_before.append(held // bs)
        budget -= n
        i += 1
    out.num_samples = len(num_scheduled) - capped
    return budget


def reaches_the_end(sched: Scheduler, seq: Sequence) -> bool:
    """vllm-v1/async-max-tokens: phase A walks past a running request whose step in
    flight already ends it by length: placeholders ``p > 0`` and ``computed + 2 - p >=
    prompt + max_tokens``, or ``computed + 1 >= max_model_len``."""
    placeholders = seq.num_output_placeholders
    if placeholders <= 0:
        return False
    computed = seq.num_computed
    if computed + 2 - placeholders >= seq.num_prompt_tokens + seq.request.params.max_tokens:
        return True
    length = sched.max_model_len
    return length is not None and computed + 1 >= length


def make_room(sched: Scheduler, out: SchedulerOutput, index: int, need: int) -> bool:
    """R5.3: preempt victims among ``running[index:]`` until ``need`` blocks are free.

    Returns True if the policy picked ``running[index]`` itself.
    """
    gpu = sched.gpu
    running = sched.running
    if not sched.enable_preemption:
        raise KVCacheExhaustedError(used=gpu.num_used_blocks, needed=need, capacity=gpu.num_blocks)
    select_victim = sched.policy.select_victim
    victim_next = sched.victim_next
    while need > gpu.num_free_blocks:
        if victim_next:  # nano-vllm/victim-next: the one after it, else itself
            victim_index = index + 1 if index + 1 < len(running) else index
        else:
            victim_index = select_victim(running, index)
        if not index <= victim_index < len(running):
            raise AssertionError(f"policy chose {victim_index} outside running[{index}:]")
        preempt(sched, out, victim_index)
        if victim_index == index:
            return True
    return False


def make_room_any_running(
    sched: Scheduler, out: SchedulerOutput, index: int, need: int
) -> tuple[bool, int, int, int]:
    """vllm-v1/priority-victim-any-running: ``make_room`` with victims among all of ``running``.

    A victim already walked over in this step (below ``index``) loses its chunk, if it
    has one (phase A walks past some requests, vllm-v1/async-max-tokens): the chunk
    leaves the step, its tokens return to the caller's budget and the keys it gave its
    blocks go (vllm-v1/undone-chunk-unkeyed).
    Returns whether the victim was at last ``running[index]`` itself, the undone
    chunks' tokens, how many victims were below ``index``, and how many undone chunks
    did not sample.
    """
    gpu = sched.gpu
    running = sched.running
    num_scheduled = out.num_scheduled
    chunk_seqs = out.scheduled
    tokens = behind = capped = 0
    while need > gpu.num_free_blocks:
        victim_index = sched.policy.select_victim(running, 0)
        if victim_index == index:
            preempt(sched, out, index)
            return True, tokens, behind, capped
        if victim_index > index:
            preempt(sched, out, victim_index)
            continue
        victim = running[victim_index]
        behind += 1
        index -= 1
        # Its chunk sits at or before its place in running (only walked-past requests
        # between have none): a backward search from there.
        chunk = min(victim_index, len(chunk_seqs) - 1)
        while chunk >= 0 and chunk_seqs[chunk] is not victim:
            chunk -= 1
        if chunk < 0:
            preempt(sched, out, victim_index)
            continue
        n = num_scheduled.pop(chunk)
        del chunk_seqs[chunk]
        table_before = out.tables_before.pop(chunk) if out.tables_before else 0
        tokens += n
        capped += victim.num_computed + n < victim.num_tokens + victim.num_output_placeholders
        # vllm-v1/undone-chunk-unkeyed (V11)
        gpu.uncache_blocks(victim.block_table, victim.num_computed, victim.num_computed + n)
        preempt(sched, out, victim_index)
        record = out.preempted[-1]
        record.undone_chunk = n
        record.undone_chunk_index = chunk
        record.undone_table_before = table_before
    return False, tokens, behind, capped


def preempt(sched: Scheduler, out: SchedulerOutput, index: int) -> None:
    """R6: free the victim's GPU blocks and requeue it by the preemption mode."""
    seq = sched.running.pop(index)
    if sched.tracks_running:
        sched.policy.on_leave(seq)
    gpu_blocks = seq.block_table.copy()
    mode = sched.config.preemption_mode
    if mode is PreemptionMode.SWAP and not sched.cpu.can_allocate(len(gpu_blocks)):
        mode = PreemptionMode.RECOMPUTE  # R6: the CPU pool lacks room
    record = PreemptionRecord(seq, mode, index, len(out.num_scheduled), gpu_blocks)
    out.preempted.append(record)
    sched.num_cached_tokens -= seq.num_computed
    sched.gpu.free(seq.block_table)
    seq.num_preemptions += 1
    if mode is PreemptionMode.SWAP:
        cpu_table = sched.cpu.allocate(len(gpu_blocks))
        out.swap_out.extend(zip(gpu_blocks, cpu_table, strict=True))
        seq.cpu_block_table = cpu_table
        seq.status = _SWAPPED
        sched.swapped.append(seq)
        return
    seq.recomputed_until = max(seq.recomputed_until, seq.num_computed)
    seq.num_computed = 0
    # vllm-v1/spec-propose: its drafts go with the blocks they held; it prefills again.
    seq.spec_token_ids = []
    seq.decoding = False
    if seq.num_in_flight_tokens:  # vllm-v1/async-stale-output: what is in flight is stale
        seq.num_output_placeholders = 0
        seq.num_stale_output_tokens = seq.num_in_flight_tokens
    if mode is PreemptionMode.RESTART:
        record.dropped_outputs = seq.token_ids[seq.num_prompt_tokens :]
        del seq.token_ids[seq.num_prompt_tokens :]
        seq.num_tokens = seq.num_prompt_tokens
        forget_hashes(seq, seq.num_tokens, sched.block_size)  # memoized with caching on
    seq.status = _WAITING
    sched.waiting.push_front(seq)


def decode_unbudgeted(sched: Scheduler, out: SchedulerOutput) -> None:
    """nano-vllm/decode-unbudgeted: phase A of a step that admitted nobody.

    Every running request (head first) gets its remaining tokens, one decode token under
    the profile, whatever ``max_num_batched_tokens`` is, until ``max_num_seqs`` are
    scheduled (nano-vllm/seq-limit-per-step); victims by nano-vllm/victim-next.
    """
    running = sched.running
    bs = sched.block_size
    gpu = sched.gpu
    limit = sched.config.max_num_seqs
    num_scheduled = out.num_scheduled
    i = 0
    while i < len(running) and i < limit:
        seq = running[i]
        computed = seq.num_computed
        n = seq.num_tokens - computed
        table = seq.block_table
        need = (computed + n - 1) // bs + 1 - len(table)
        if need > 0:
            if need > gpu.num_free_blocks and make_room(sched, out, i, need):
                break  # it preempted itself: the last candidate
            gpu.grow(table, len(table) + need)
        gpu.cache_blocks(seq, computed, computed + n)  # PC2: a decode that fills its block
        num_scheduled.append(n)
        out.scheduled.append(seq)
        i += 1
    out.num_samples = i  # every chunk completes its request


def swap_in(sched: Scheduler, out: SchedulerOutput, budget: int) -> int:
    """Phase B (R7): bring swapped requests back, head first, head-of-line."""
    config = sched.config
    bs = sched.block_size
    swapped = sched.swapped
    running = sched.running
    gpu = sched.gpu
    while swapped:
        if len(running) >= config.max_num_seqs or budget == 0:
            break
        seq = swapped[0]
        computed = seq.num_computed
        n = remaining = seq.num_tokens - computed
        if n > budget:
            if not config.enable_chunked_prefill:
                break
            n = budget
        num_blocks = cdiv(computed + n, bs)
        if num_blocks > gpu.num_free_blocks - sched.watermark:  # vllm-v0/watermark
            break
        swapped.popleft()
        cpu_blocks = seq.cpu_block_table.copy()
        sched.cpu.free(seq.cpu_block_table)
        gpu.grow(seq.block_table, num_blocks)
        out.swap_in.extend(zip(cpu_blocks, seq.block_table, strict=False))
        out.swapped_in.append((seq, cpu_blocks))
        seq.status = _RUNNING
        running.append(seq)
        if sched.tracks_running:
            sched.policy.on_run(seq)
        sched.num_cached_tokens += computed
        out.num_scheduled.append(n)
        out.scheduled.append(seq)
        out.num_samples += n == remaining
        budget -= n
    return budget


def admit(sched: Scheduler, out: SchedulerOutput, budget: int) -> int:
    """Phase C (R8): admit waiting requests in the policy's order, head-of-line."""
    config = sched.config
    bs = sched.block_size
    waiting = sched.waiting
    running = sched.running
    gpu = sched.gpu
    policy = sched.policy
    gate = policy.has_admission_gate
    track = sched.tracks_running
    watermark = sched.watermark
    full_sequence_gate = sched.full_sequence_gate
    whole_sequence_gate = sched.whole_sequence_gate
    cap = sched.chunk_cap
    # vllm-v1/spec-padded-new-decode reads phase A's chunks, before any admission.
    padding = sched.num_speculative_tokens and may_pad(out)
    running_scheduled = bool(out.scheduled)
    # nano-vllm/seq-limit-per-step: max_num_seqs counts this step's admissions only.
    room = config.max_num_seqs - (0 if sched.prefill_first else len(running))
    while len(waiting):
        if out.num_admitted >= room or budget == 0:
            break
        seq = waiting.peek()
        # nano-vllm/admission-tests-len-seq: all its tokens and blocks, as if nothing hit.
        if whole_sequence_gate and (
            seq.num_tokens > budget or cdiv(seq.num_tokens, bs) > gpu.num_free_blocks
        ):
            break
        hit = gpu.lookup(seq)  # PC3
        start = len(hit) * bs
        n = seq.num_tokens - start
        samples = True
        pad = padding and pads_admission(
            sched, start=start, num_tokens=n, running_scheduled=running_scheduled
        )
        if pad:  # vllm-v1/spec-padded-new-decode: padded, or not admitted at all
            n += sched.num_speculative_tokens
            if n > budget:
                break
        else:
            if 0 < cap < n:  # vllm-v1/long-prefill-cap, before chunked prefill off's test
                n = cap
                samples = False
            if n > budget:
                if not config.enable_chunked_prefill:
                    break
                n = budget
                samples = False
        num_blocks = cdiv(start + n, bs) - len(hit)
        free = gpu.num_free_blocks
        # PC4: a hit on a free block takes it from the free queue too.
        evictable = gpu.num_evictable(hit)
        if num_blocks + evictable > free - watermark:  # vllm-v0/watermark
            break
        # vllm-v1/full-sequence-admission: blocks for all its tokens must be free
        # (-hits: the hit blocks are not asked for again, its free ones are, as above).
        if full_sequence_gate and cdiv(seq.num_tokens, bs) - len(hit) + evictable > free:
            break
        if gate and not policy.can_admit(seq, n, running=running, num_free_blocks=free):
            break
        waiting.pop()
        # PC4: touch the hit before taking new blocks (PC5), then key them (PC2) up to
        # its known tokens.
        table = seq.block_table
        gpu.touch(table, hit)
        gpu.grow(table, len(hit) + num_blocks)
        seq.num_computed = start
        sched.num_cached_tokens += start
        gpu.cache_blocks(seq, start, seq.num_tokens if pad else start + n)
        if pad:
            seq.spec_token_ids = [PAD_TOKEN_ID] * sched.num_speculative_tokens
        out.num_queried_tokens += seq.num_tokens
        out.num_hit_tokens += start
        seq.status = _RUNNING
        running.append(seq)
        if track:
            policy.on_run(seq)
        out.num_admitted += 1
        out.num_scheduled.append(n)
        out.scheduled.append(seq)
        out.num_samples += samples
        budget -= n
    return budget


# --- phase D (R10) ------------------------------------------------------------------------


def commit(
    sched: Scheduler, out: SchedulerOutput, sampled_token_ids: SequenceABC[int]
) -> list[FinishedRequest]:
    """Phase D (R10): apply the chunks and the sampled tokens; finish requests.

    ``sampled_token_ids`` holds one token per sampling chunk, in plan order.
    Returns the finished requests in plan order; ``num_steps`` goes up by one.
    ``out`` keeps what ``make_plan`` needs.
    """
    if len(sampled_token_ids) != out.num_samples:
        raise SampledTokensError(
            f"step {out.step}: {out.num_samples} requests sample, "
            f"got {len(sampled_token_ids)} tokens"
        )
    out.sampled_token_ids = tuple(sampled_token_ids)
    finishing: list[Sequence] = []
    add_start = out.starts.append
    # When every chunk samples (every decode-only step) the plan's sampled ids are its
    # scheduled ids: nothing to record.
    add_sampled_id = None if out.every_chunk_samples() else out.sampled_ids.append
    recomputed = 0
    k = 0
    for seq, n in zip(out.scheduled, out.num_scheduled, strict=True):
        start = seq.num_computed
        add_start(start)
        if start < seq.recomputed_until:
            recomputed += recomputed_tokens(seq, start, n)
        computed = start + n
        seq.num_computed = computed
        if computed == seq.num_tokens:
            token = sampled_token_ids[k]
            k += 1
            if add_sampled_id is not None:
                add_sampled_id(seq.request_id)
            seq.token_ids.append(token)
            seq.num_tokens = computed + 1
            if seq.stops(token):
                finishing.append(seq)
    out.num_recomputed_tokens = recomputed
    sched.num_cached_tokens += out.num_batched_tokens
    finished = finish_all(sched, out, finishing) if finishing else []
    sched.num_steps += 1
    return finished


def commit_verified(
    sched: Scheduler, out: SchedulerOutput, runs: SequenceABC[SequenceABC[int]]
) -> list[FinishedRequest]:
    """Phase D with drafts (vllm-v1/spec-verify): ``runs`` holds one run per sampling
    chunk, in plan order. Each chunk's ``num_computed`` moves to its end less the drafts
    rejected; a sampling request's drafts are cleared and its run appended one token
    at a time, each followed by R10's stop checks (EOS, then length): a stop drops the
    rest of the run. Every run is checked first (``check_runs``): a bad one raises
    ``SampledTokensError`` and nothing changes."""
    check_runs(out, runs)
    scheduled = out.scheduled
    finishing: list[Sequence] = []
    add_start = out.starts.append
    add_sampled_id = out.sampled_ids.append
    tokens: list[int] = []
    rejected = recomputed = 0
    k = 0
    for seq, n in zip(scheduled, out.num_scheduled, strict=True):
        start = seq.num_computed
        add_start(start)
        if start < seq.recomputed_until:
            recomputed += recomputed_tokens(seq, start, n)
        end = start + n
        if end < seq.num_tokens:
            seq.num_computed = end
            continue
        run = runs[k]
        k += 1
        drafted = end - seq.num_tokens
        back = drafted - (len(run) - 1)  # the drafts run and rejected
        rejected += back
        real = drafted > 0 and seq.spec_token_ids[0] != PAD_TOKEN_ID
        seq.num_computed = end - back
        seq.spec_token_ids = []
        seq.decoding = True
        delivered = 0
        for token in run:
            add_sampled_id(seq.request_id)
            tokens.append(token)
            seq.token_ids.append(token)
            seq.num_tokens += 1
            delivered += 1
            if seq.stops(token):
                finishing.append(seq)
                break
        if real:  # a padded admission's drafts are not proposals
            out.num_draft_tokens += drafted
            # The drafts among the tokens delivered (a stop may cut the run after one).
            out.num_accepted_tokens += min(delivered, len(run) - 1)
            out.num_verify_runs += 1
    out.sampled_token_ids = tuple(tokens)
    out.num_recomputed_tokens = recomputed
    sched.num_cached_tokens += out.num_batched_tokens - rejected
    finished = finish_all(sched, out, finishing) if finishing else []
    sched.num_steps += 1
    return finished


def finish_all(
    sched: Scheduler, out: SchedulerOutput, finishing: list[Sequence]
) -> list[FinishedRequest]:
    """The requests that reached their end (in plan order) leave ``running`` and the engine.

    Their positions are searched for here, in one forward pass over the chunks, so that
    ``commit``'s loop carries no index for the steps (most of them) where none finishes.
    """
    finished = [finish(sched, seq) for seq in finishing]
    if sched.offloads_starved or sched.reserves_generation:  # chunks not a run of running
        for seq in finishing:
            sched.running.remove(seq)
        return finished
    scheduled = out.scheduled
    positions: list[int] = []
    index = 0
    for seq in finishing:  # plan order: each one is found past the previous one
        index = scheduled.index(seq, index)
        positions.append(out.first_scheduled + index)  # scheduled[i] is running[first + i]
    running = sched.running
    for position in reversed(positions):
        del running[position]
    return finished


def recomputed_tokens(seq: Sequence, start: int, n: int) -> int:
    """The positions of the chunk ``start .. start + n - 1`` that ``seq`` had computed
    before a preemption dropped them (``EngineMetrics.recomputed_tokens``); the caller
    has checked ``start < seq.recomputed_until``."""
    until = seq.recomputed_until
    end = start + n
    return (end if end < until else until) - start


def finish(sched: Scheduler, seq: Sequence) -> FinishedRequest:
    """A running request (already out of ``running``) gives its blocks back and leaves."""
    sched.num_cached_tokens -= seq.num_computed
    sched.gpu.free(seq.block_table)
    if sched.tracks_running:
        sched.policy.on_leave(seq)
    return retire(sched, seq)


def retire(sched: Scheduler, seq: Sequence) -> FinishedRequest:
    """R10's report of a request out of every queue: STOP if its last token is its EOS,
    else LENGTH; it leaves the engine."""
    reason = FinishReason.STOP if seq.token_ids[-1] == seq.eos_token_id else FinishReason.LENGTH
    seq.status = _FINISHED
    del sched.requests[seq.request_id]
    return seq.to_finished(reason)
