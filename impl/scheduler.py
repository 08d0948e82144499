"""The engine's scheduler: R4-R11 of docs/semantics.md over mutable queues.

No torch here: the scheduler decides, the engine executes. One step is

1. ``schedule()`` -- phases A-C (R5-R8). It mutates the queues and block tables and
   returns a ``SchedulerOutput`` that doubles as the step's undo journal;
2. the caller runs the swap copies and the model on ``output.scheduled`` and samples
   ``output.num_samples`` tokens;
3. ``commit(output, tokens)`` -- phase D (R10): tokens appended, requests finished,
   ``num_steps`` advanced; or ``rollback(output)`` if anything in 2 failed, which
   undoes 1 exactly (same queues, same block tables, same free-list order).

``step(sample)`` chains the three for callers without a model (tests, benchmarks).

Per-step cost (``R`` running requests, ``S`` scheduled, ``W``/``W'`` waiting/swapped
requests brought in, ``V`` victims): O(S + W + W' + blocks allocated) for phases
A-D, plus O(R) per victim for non-LIFO policies (a scan of the candidates), O(R log R)
per admission attempt for ``reserve`` while the running requests' peaks overflow the
pool (O(1) otherwise), and a ``del`` (memmove) per finished request. Nothing walks the
waiting queue beyond the requests admitted plus one, and nothing but that ``reserve``
estimate scans every running request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

from impl.block_manager import BlockManager
from impl.policies import Policy, WaitingQueue, make_policy
from impl.sequence import Sequence, SequenceStatus
from spec.types import (
    DuplicateRequestError,
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    KVCacheExhaustedError,
    Preemption,
    PreemptionMode,
    Request,
    RequestTooLargeError,
    SampledTokensError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    TokenOutOfVocabError,
    UnknownRequestError,
)

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED
_FINISHED = SequenceStatus.FINISHED


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PreemptionRecord:
    """One victim of phase A, with what ``rollback`` needs to put it back."""

    __slots__ = (
        "dropped_outputs",
        "gpu_blocks",
        "mode",
        "num_computed",
        "num_scheduled_before",
        "recomputed_until",
        "running_index",
        "seq",
    )

    def __init__(
        self,
        seq: Sequence,
        mode: PreemptionMode,
        running_index: int,
        num_scheduled_before: int,
        gpu_blocks: list[int],
    ) -> None:
        self.seq = seq
        self.mode = mode  # the mode used: a swap that did not fit reads RECOMPUTE (R6)
        self.running_index = running_index
        self.num_scheduled_before = num_scheduled_before
        self.gpu_blocks = gpu_blocks  # the GPU blocks it held (freed by the preemption)
        self.num_computed = seq.num_computed
        self.recomputed_until = seq.recomputed_until
        self.dropped_outputs: list[int] = []


class SchedulerOutput:
    """What ``schedule()`` decided, and the journal to undo it.

    ``scheduled[k]`` runs ``num_scheduled[k]`` tokens at positions
    ``scheduled[k].num_computed ..`` (read before ``commit``). Running requests come
    first, then swapped-in, then admitted, which is also their order in ``running``:
    ``scheduled == running[:len(scheduled)]`` after ``schedule()``. A chunk samples
    iff it reaches the request's last token; ``num_samples`` of them do.
    ``swap_out``/``swap_in`` are the (src, dst) block pairs to copy GPU->CPU and
    CPU->GPU before the forward (never both in one step: phase B needs a step
    without preemption).
    """

    __slots__ = (
        "num_admitted",
        "num_batched_tokens",
        "num_cached_tokens_before",
        "num_recomputed_tokens",
        "num_samples",
        "num_scheduled",
        "num_scheduled_running",
        "preempted",
        "sampled_ids",
        "sampled_token_ids",
        "scheduled",
        "starts",
        "step",
        "swap_in",
        "swap_out",
        "swapped_in",
    )

    def __init__(self, step: int, num_cached_tokens: int) -> None:
        self.step = step
        self.scheduled: list[Sequence] = []
        self.num_scheduled: list[int] = []
        self.num_samples = 0
        self.num_batched_tokens = 0
        self.num_scheduled_running = 0  # chunks from phase A
        self.preempted: list[PreemptionRecord] = []
        self.swapped_in: list[tuple[Sequence, list[int]]] = []  # (seq, its CPU blocks)
        self.num_admitted = 0
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.num_cached_tokens_before = num_cached_tokens
        self.num_recomputed_tokens = 0  # set by commit
        # The plan's columns that commit() alone knows, filled by it: each chunk's start
        # (its request's computed count before the step) and the sampling requests' ids.
        self.starts: list[int] = []
        self.sampled_ids: list[str] = []
        self.sampled_token_ids: tuple[int, ...] = ()

    def samples(self) -> list[Sequence]:
        """The requests that sample in this step, in plan order (before ``commit``)."""
        return [
            seq
            for seq, n in zip(self.scheduled, self.num_scheduled, strict=True)
            if seq.num_computed + n == seq.num_tokens
        ]


class Scheduler:
    """Continuous batching with paged KV blocks and preemption (R4-R11).

    ``vocab_size`` enables R4's third check (the engine knows the model's
    vocabulary). ``enable_preemption=False`` is the seed's control group: where
    phase A would preempt, ``schedule()`` raises ``KVCacheExhaustedError`` instead and
    changes nothing.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        vocab_size: int | None = None,
        enable_preemption: bool = True,
    ) -> None:
        self.config = config
        self.policy: Policy = make_policy(config.policy)
        self.policy.bind(config)
        # The policy's on_run/on_leave hooks are called only if it tracks running.
        self._track = self.policy.tracks_running
        self.vocab_size = vocab_size
        self.enable_preemption = enable_preemption
        self.block_size = config.block_size
        self.gpu = BlockManager(config.num_gpu_blocks)
        self.cpu = BlockManager(config.num_cpu_blocks)
        self.waiting: WaitingQueue = self.policy.new_waiting_queue()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.requests: dict[str, Sequence] = {}  # every live request, by id
        self.next_arrival = 0
        self.num_steps = 0
        # Sum of num_computed over running requests: the tokens live in the GPU cache.
        self.num_cached_tokens = 0

    # --- R4, R11 ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceABC[int],
        params: SamplingParams | None = None,
    ) -> Sequence:
        """Accept a request (R4): checks in order; the first failure raises, nothing changes.

        It gets ``arrival = next_arrival`` and goes to the tail of ``waiting``.
        """
        if params is None:
            params = SamplingParams()
        prompt = tuple(prompt_token_ids)
        self.check_request(request_id, prompt, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            arrival=self.next_arrival,
        )
        self.next_arrival += 1
        seq = Sequence(request)
        self.requests[request_id] = seq
        self.waiting.push_back(seq)
        return seq

    def check_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceABC[int],
        params: SamplingParams | None = None,
    ) -> None:
        """R4's checks, in order, without adding anything; raises the first failure."""
        if params is None:
            params = SamplingParams()
        prompt = prompt_token_ids
        if len(prompt) == 0:
            raise EmptyPromptError(f"request {request_id!r}: empty prompt")
        max_tokens = params.max_tokens
        if max_tokens < 1:
            raise InvalidMaxTokensError(
                f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}"
            )
        vocab = self.vocab_size
        if vocab is not None:
            for token in prompt:
                if not isinstance(token, int) or not 0 <= token < vocab:
                    raise TokenOutOfVocabError(
                        f"request {request_id!r}: token id {token!r} outside [0, {vocab})"
                    )
        if request_id in self.requests:
            raise DuplicateRequestError(f"request {request_id!r} is already live")
        self._check_fits(request_id, len(prompt), max_tokens)

    def _check_fits(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        """R4.5: reject a request that could never be scheduled."""
        config = self.config
        most_cached = prompt_len + max_tokens - 1  # the last output is never written
        if cdiv(most_cached, config.block_size) > config.num_gpu_blocks:
            raise RequestTooLargeError(
                f"request {request_id!r} may hold {most_cached} tokens = "
                f"{cdiv(most_cached, config.block_size)} blocks of {config.block_size}, "
                f"more than the {config.num_gpu_blocks} GPU blocks"
            )
        if not config.enable_chunked_prefill:
            restart = config.preemption_mode is PreemptionMode.RESTART
            largest_prefill = prompt_len if restart else most_cached
            if largest_prefill > config.max_num_batched_tokens:
                raise RequestTooLargeError(
                    f"request {request_id!r} may need a {largest_prefill}-token prefill, "
                    f"more than max_num_batched_tokens={config.max_num_batched_tokens} "
                    "with chunked prefill off"
                )

    def abort_request(self, request_id: str) -> FinishedRequest:
        """R11: remove a live request from its queue, free its blocks, report it."""
        seq = self.requests.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"no live request {request_id!r}")
        status = seq.status
        if status is _RUNNING:
            self.running.remove(seq)
            if self._track:
                self.policy.on_leave(seq)
            self.num_cached_tokens -= seq.num_computed
            self.gpu.free(seq.block_table)
        elif status is _SWAPPED:
            self.swapped.remove(seq)
            self.cpu.free(seq.cpu_block_table)
        else:
            self.waiting.remove(seq)
        del self.requests[request_id]
        seq.status = _FINISHED
        return seq.to_finished(FinishReason.ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- phases A-C -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Phases A-C of one step (R5-R8); on any error the partial work is undone."""
        out = SchedulerOutput(self.num_steps, self.num_cached_tokens)
        try:
            budget = self._schedule_running(out, self.config.max_num_batched_tokens)
            if not out.preempted:
                if self.swapped:
                    budget = self._swap_in(out, budget)
                if not self.swapped:
                    budget = self._admit(out, budget)
        except BaseException:
            self.rollback(out)
            raise
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        n = len(out.num_scheduled)
        out.scheduled = self.running[:n]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Phase A (R5): every running request, head first, while the budget lasts."""
        running = self.running
        bs = self.block_size
        gpu = self.gpu
        free = gpu.num_free_blocks
        num_scheduled = out.num_scheduled
        record = num_scheduled.append
        capped = 0
        i = 0
        nrun = len(running)
        while i < nrun and budget > 0:
            seq = running[i]
            computed = seq.num_computed
            n = remaining = seq.num_tokens - computed
            if n > budget:
                n = budget  # a prefill chunk cut by the budget: it does not sample
                capped += 1
            table = seq.block_table
            need = (computed + n - 1) // bs + 1 - len(table)
            if need > 0:
                if need > free:
                    if self._make_room(out, i, need):
                        if n < remaining:
                            capped -= 1  # it was not scheduled after all
                        break  # the request preempted itself: phase A ends
                    nrun = len(running)
                    free = gpu.num_free_blocks
                gpu.grow(table, len(table) + need)
                free -= need
            record(n)
            budget -= n
            i += 1
        out.num_scheduled_running = i
        out.num_samples = i - capped
        return budget

    def _make_room(self, out: SchedulerOutput, index: int, need: int) -> bool:
        """R5.3: preempt victims among ``running[index:]`` until ``need`` blocks are free.

        Returns True if the policy picked ``running[index]`` itself.
        """
        gpu = self.gpu
        running = self.running
        if not self.enable_preemption:
            raise KVCacheExhaustedError(
                used=gpu.num_used_blocks, needed=need, capacity=gpu.num_blocks
            )
        select_victim = self.policy.select_victim
        while need > gpu.num_free_blocks:
            victim_index = select_victim(running, index)
            if not index <= victim_index < len(running):
                raise AssertionError(f"policy chose {victim_index} outside running[{index}:]")
            self._preempt(out, victim_index)
            if victim_index == index:
                return True
        return False

    def _preempt(self, out: SchedulerOutput, index: int) -> None:
        """R6: free the victim's GPU blocks and requeue it by the preemption mode."""
        seq = self.running.pop(index)
        if self._track:
            self.policy.on_leave(seq)
        gpu_blocks = seq.block_table.copy()
        mode = self.config.preemption_mode
        if mode is PreemptionMode.SWAP and not self.cpu.can_allocate(len(gpu_blocks)):
            mode = PreemptionMode.RECOMPUTE  # R6: the CPU pool lacks room
        record = PreemptionRecord(seq, mode, index, len(out.num_scheduled), gpu_blocks)
        out.preempted.append(record)
        self.num_cached_tokens -= seq.num_computed
        self.gpu.free(seq.block_table)
        seq.num_preemptions += 1
        if mode is PreemptionMode.SWAP:
            cpu_table = self.cpu.allocate(len(gpu_blocks))
            out.swap_out.extend(zip(gpu_blocks, cpu_table, strict=True))
            seq.cpu_block_table = cpu_table
            seq.status = _SWAPPED
            self.swapped.append(seq)
            return
        seq.recomputed_until = max(seq.recomputed_until, seq.num_computed)
        seq.num_computed = 0
        if mode is PreemptionMode.RESTART:
            record.dropped_outputs = seq.token_ids[seq.num_prompt_tokens :]
            del seq.token_ids[seq.num_prompt_tokens :]
            seq.num_tokens = seq.num_prompt_tokens
        seq.status = _WAITING
        self.waiting.push_front(seq)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Phase B (R7): bring swapped requests back, head first, head-of-line."""
        config = self.config
        bs = self.block_size
        swapped = self.swapped
        running = self.running
        gpu = self.gpu
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
            if num_blocks > gpu.num_free_blocks:
                break
            swapped.popleft()
            cpu_blocks = seq.cpu_block_table.copy()
            self.cpu.free(seq.cpu_block_table)
            gpu.grow(seq.block_table, num_blocks)
            out.swap_in.extend(zip(cpu_blocks, seq.block_table, strict=False))
            out.swapped_in.append((seq, cpu_blocks))
            seq.status = _RUNNING
            running.append(seq)
            if self._track:
                self.policy.on_run(seq)
            self.num_cached_tokens += computed
            out.num_scheduled.append(n)
            out.num_samples += n == remaining
            budget -= n
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Phase C (R8): admit waiting requests in the policy's order, head-of-line."""
        config = self.config
        bs = self.block_size
        waiting = self.waiting
        running = self.running
        gpu = self.gpu
        policy = self.policy
        gate = policy.has_admission_gate
        track = self._track
        while len(waiting):
            if len(running) >= config.max_num_seqs or budget == 0:
                break
            seq = waiting.peek()
            n = seq.num_tokens
            samples = True
            if n > budget:
                if not config.enable_chunked_prefill:
                    break
                n = budget
                samples = False
            num_blocks = cdiv(n, bs)
            free = gpu.num_free_blocks
            if num_blocks > free:
                break
            if gate and not policy.can_admit(seq, n, running=running, num_free_blocks=free):
                break
            waiting.pop()
            gpu.grow(seq.block_table, num_blocks)
            seq.status = _RUNNING
            running.append(seq)
            if track:
                policy.on_run(seq)
            out.num_admitted += 1
            out.num_scheduled.append(n)
            out.num_samples += samples
            budget -= n
        return budget

    # --- rollback ---------------------------------------------------------------------

    def rollback(self, out: SchedulerOutput) -> None:
        """Undo ``schedule()`` exactly, in reverse order of its operations.

        Queues, block tables, request fields and both free lists (including their
        order) return to their values before ``schedule()``. K/V *contents* are the
        engine's business: a victim's freed GPU blocks may have been overwritten by
        the failed forward, and the engine restores them from a snapshot.
        """
        running = self.running
        gpu = self.gpu
        bs = self.block_size
        num_running_chunks = len(out.num_scheduled) - len(out.swapped_in) - out.num_admitted
        for _ in range(out.num_admitted):  # phase C, last admitted first
            seq = running.pop()
            if self._track:
                self.policy.on_leave(seq)
            gpu.shrink(seq.block_table, 0)
            seq.status = _WAITING
            self.waiting.unpop(seq)
        out.num_admitted = 0
        for seq, cpu_blocks in reversed(out.swapped_in):  # phase B
            popped = running.pop()
            assert popped is seq, "rollback out of order"
            if self._track:
                self.policy.on_leave(seq)
            gpu.shrink(seq.block_table, 0)
            self.cpu.unfree(cpu_blocks)
            seq.cpu_block_table = cpu_blocks
            seq.status = _SWAPPED
            self.swapped.appendleft(seq)
        out.swapped_in.clear()
        # Phase A: chunk allocations and preemptions, interleaved as they happened.
        preempted = out.preempted
        for k in range(num_running_chunks, -1, -1):
            while preempted and preempted[-1].num_scheduled_before == k:
                self._unpreempt(preempted.pop())
            if k > 0:
                seq = running[k - 1]
                gpu.shrink(seq.block_table, cdiv(seq.num_computed, bs))
        assert not preempted, "rollback out of order"
        out.num_scheduled.clear()
        out.scheduled = []
        out.swap_out.clear()
        out.swap_in.clear()
        out.num_samples = 0
        self.num_cached_tokens = out.num_cached_tokens_before

    def _unpreempt(self, record: PreemptionRecord) -> None:
        seq = record.seq
        if seq.status is _SWAPPED:
            popped = self.swapped.pop()
            assert popped is seq, "rollback out of order"
            cpu_blocks = seq.cpu_block_table
            seq.cpu_block_table = []
            self.cpu.unallocate(cpu_blocks)
        else:
            self.waiting.unpush_front(seq)
            if record.dropped_outputs:
                seq.token_ids.extend(record.dropped_outputs)
                seq.num_tokens = len(seq.token_ids)
        self.gpu.unfree(record.gpu_blocks)
        seq.block_table = record.gpu_blocks
        seq.num_computed = record.num_computed
        seq.recomputed_until = record.recomputed_until
        seq.num_preemptions -= 1
        seq.status = _RUNNING
        self.running.insert(record.running_index, seq)
        if self._track:
            self.policy.on_run(seq)

    # --- phase D ----------------------------------------------------------------------

    def commit(
        self, out: SchedulerOutput, sampled_token_ids: SequenceABC[int]
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
        finished_at: list[int] = []
        add_start = out.starts.append
        add_sampled_id = out.sampled_ids.append
        recomputed = 0
        k = 0
        for index, (seq, n) in enumerate(zip(out.scheduled, out.num_scheduled, strict=True)):
            start = seq.num_computed
            add_start(start)
            if start < seq.recomputed_until:
                end = start + n
                until = seq.recomputed_until
                recomputed += (end if end < until else until) - start
            computed = start + n
            seq.num_computed = computed
            if computed == seq.num_tokens:
                token = sampled_token_ids[k]
                k += 1
                add_sampled_id(seq.request_id)
                seq.token_ids.append(token)
                seq.num_tokens = computed + 1
                if token == seq.eos_token_id or computed + 1 == seq.stop_len:
                    finished_at.append(index)
        out.num_recomputed_tokens = recomputed
        self.num_cached_tokens += out.num_batched_tokens
        finished = [self._finish(out.scheduled[i]) for i in finished_at]
        running = self.running
        for i in reversed(finished_at):  # scheduled[i] is running[i]
            del running[i]
        self.num_steps += 1
        return finished

    def _finish(self, seq: Sequence) -> FinishedRequest:
        last = seq.token_ids[-1]
        reason = FinishReason.STOP if last == seq.eos_token_id else FinishReason.LENGTH
        self.num_cached_tokens -= seq.num_computed
        self.gpu.free(seq.block_table)
        if self._track:
            self.policy.on_leave(seq)
        seq.status = _FINISHED
        del self.requests[seq.request_id]
        return seq.to_finished(reason)

    # --- the step as a whole ------------------------------------------------------------

    def step(self, sample: Callable[[SchedulerOutput], SequenceABC[int]]) -> StepPlan:
        """Schedule, sample with ``sample(output)`` (no model), commit; the plan.

        If ``sample`` raises, the step is rolled back and the error propagates.
        """
        out = self.schedule()
        try:
            tokens = sample(out)
            if len(tokens) != out.num_samples:
                raise SampledTokensError(
                    f"step {out.step}: {out.num_samples} requests sample, got {len(tokens)}"
                )
        except BaseException:
            self.rollback(out)
            raise
        finished = self.commit(out, tokens)
        return self.make_plan(out, finished)

    @staticmethod
    def make_plan(out: SchedulerOutput, finished: SequenceABC[FinishedRequest]) -> StepPlan:
        """The step's ``StepPlan``, after ``commit(out, ...)``."""
        return StepPlan(
            step=out.step,
            scheduled_ids=tuple([seq.request_id for seq in out.scheduled]),
            num_computed_tokens=tuple(out.starts),
            num_scheduled_tokens=tuple(out.num_scheduled),
            preempted=tuple(
                [Preemption(request_id=r.seq.request_id, mode=r.mode) for r in out.preempted]
            ),
            swapped_in=tuple([seq.request_id for seq, _ in out.swapped_in]),
            sampled_ids=tuple(out.sampled_ids),
            sampled_token_ids=out.sampled_token_ids,
            finished=tuple(finished),
        )

    # --- the spec's view ----------------------------------------------------------------

    def observe(self) -> SchedulerState:
        """The state projected onto ``spec.types.SchedulerState`` (compare with ``==``)."""
        return SchedulerState(
            config=self.config,
            num_free_gpu_blocks=self.gpu.num_free_blocks,
            num_free_cpu_blocks=self.cpu.num_free_blocks,
            waiting=tuple(seq.to_state() for seq in self.waiting.stored()),
            running=tuple(seq.to_state() for seq in self.running),
            swapped=tuple(seq.to_state() for seq in self.swapped),
            next_arrival=self.next_arrival,
            num_steps=self.num_steps,
        )

    def check_invariants(self) -> None:
        """Assert R1 and R2 on the whole state (O(everything): for tests)."""
        bs = self.block_size
        seen: set[str] = set()
        queues: list[tuple[SequenceStatus, list[Sequence]]] = [
            (_WAITING, self.waiting.stored()),
            (_RUNNING, self.running),
            (_SWAPPED, list(self.swapped)),
        ]
        gpu_owned = 0
        cpu_owned = 0
        cached = 0
        for status, queue in queues:
            for seq in queue:
                assert seq.status is status, seq
                assert seq.request_id not in seen, seq
                assert self.requests.get(seq.request_id) is seq, seq
                seen.add(seq.request_id)
                assert seq.num_tokens == len(seq.token_ids), seq
                if status is _WAITING:
                    assert seq.num_computed == 0, seq
                    assert not seq.block_table and not seq.cpu_block_table, seq
                else:
                    assert 1 <= seq.num_computed < seq.num_tokens, seq
                    owned = cdiv(seq.num_computed, bs)
                    if status is _RUNNING:
                        assert len(seq.block_table) == owned and not seq.cpu_block_table, seq
                        gpu_owned += owned
                        cached += seq.num_computed
                    else:
                        assert len(seq.cpu_block_table) == owned and not seq.block_table, seq
                        cpu_owned += owned
        assert seen == set(self.requests), "a live request is in no queue"
        assert self.gpu.num_free_blocks + gpu_owned == self.gpu.num_blocks, "GPU blocks leak"
        assert self.cpu.num_free_blocks + cpu_owned == self.cpu.num_blocks, "CPU blocks leak"
        assert cached == self.num_cached_tokens, "cached-token counter drifted"
        self.policy.check_invariants(self.running)
        self.gpu.check()
        self.cpu.check()
