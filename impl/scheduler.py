"""The engine's scheduler: R4-R11 of docs/semantics.md over mutable queues.

No torch here: the scheduler decides, the engine executes. One step is

1. ``schedule()`` -- phases A-C (R5-R8). It mutates the queues and block tables and
   returns a ``SchedulerOutput`` that doubles as the step's undo journal;
2. the caller runs the swap copies and the model on ``output.scheduled`` and samples
   ``output.num_samples`` tokens;
3. ``commit(output, tokens)`` -- phase D (R10): tokens appended, requests finished,
   ``num_steps`` advanced; or ``rollback(output)`` if anything in 2 failed, which
   undoes 1 exactly (same queues, same block tables, same free-list order);
4. ``make_plan(output, finished)`` -- the step's ``StepPlan``.

``step(sample)`` chains them for callers without a model (tests, benchmarks). This
module holds the state, R4 and R11 (requests in and out) and the step's outline; the
phases are in ``impl/phases.py``, the undo in ``impl/rollback.py``, the plan in
``impl/plan.py``, the waiting queues in ``impl/queues.py``.

Per-step cost (``R`` running requests, ``S`` scheduled, ``W``/``W'`` waiting/swapped
requests brought in, ``V`` victims): O(S + W + W' + blocks allocated) for phases
A-D, plus O(R) per victim for non-LIFO policies (a scan of the candidates), O(R log R)
per admission attempt for ``reserve`` while the running requests' peaks overflow the
pool (O(1) otherwise), and in a step where requests finish, one forward search of its
chunks (``list.index``, O(S) in all) and a ``del`` (memmove) per finished request. Nothing walks the
waiting queue beyond the requests admitted plus one, and nothing but that ``reserve``
estimate scans every running request.

Over ~300 lines because the class holds the step's outline, ``add_request``'s R4
checks (with the profiles' variants) and ``abort_request`` in every state; the phases,
rollback, plan, queues and prefix cache live in their own modules.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace

from impl import offload_step, phases, pipeline, reserve_step, speculative
from impl.block_manager import BlockManager, BlockPool, cdiv
from impl.invariants import check_invariants
from impl.pipeline import InFlightStep
from impl.plan import make_async_plan, make_plan
from impl.policies import Policy, make_policy
from impl.prefix_cache import PrefixCachingBlockManager
from impl.queues import WaitingQueue
from impl.rollback import rollback
from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence, SequenceStatus
from impl.snapshot import Snapshot
from spec.types import (
    DuplicateRequestError,
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    InvalidSamplingParamsError,
    PreemptionMode,
    Request,
    RequestTooLargeError,
    SampledTokensError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    StepPlan,
    TokenOutOfVocabError,
    UnknownRequestError,
)

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED
_FINISHED = SequenceStatus.FINISHED


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
        semantics = config.semantics
        # The profile rules (docs/semantics.md, "Semantics profiles"), as switches read
        # by the phases; each names its rule.
        #: nano-vllm/prefill-first and nano-vllm/decode-unbudgeted (+ seq-limit-per-step)
        self.prefill_first = semantics is Semantics.NANO_VLLM
        #: vllm-v0/prefill-first: admit first while nothing is swapped, else no admission
        self.prefill_first_unless_swapped = semantics is Semantics.VLLM_V0
        #: vllm-v0/watermark: blocks an admission or a swap-in leaves free (V0's 1%)
        self.watermark = int(0.01 * config.num_gpu_blocks) if semantics is Semantics.VLLM_V0 else 0
        #: vllm-v0/append-touches-last-block
        self.append_touches_last_block = semantics is Semantics.VLLM_V0
        #: nano-vllm/victim-next
        self.victim_next = semantics is Semantics.NANO_VLLM
        #: vllm-v1/max-model-len, vllm-v0/max-model-len (None: no such limit)
        self.max_model_len = (
            config.max_model_len if semantics in (Semantics.VLLM_V1, Semantics.VLLM_V0) else None
        )
        #: vllm-v0/max-model-len: a prompt of exactly max_model_len tokens is accepted
        self.prompt_may_fill_model_len = semantics is Semantics.VLLM_V0
        #: vllm-v1/full-sequence-admission
        self.full_sequence_gate = semantics is Semantics.VLLM_V1
        #: vllm-v1/long-prefill-cap: the most tokens a chunk takes in the step being
        #: scheduled (0: none), set by ``schedule`` from the state the step starts from
        self.chunk_cap = 0
        #: vllm-v1/async-*: steps in flight (impl/pipeline.py), oldest first, and whether
        #: a request finished or was aborted since the last ``schedule`` (vLLM's
        #: ``finished_req_ids``)
        self.async_scheduling = config.async_scheduling
        self.in_flight: deque[InFlightStep] = deque()
        self.has_finished_requests = False
        #: vllm-v1/spec-*: the drafts a request verifies per step (impl/speculative.py;
        #: the config allows them under vllm-v1 only, synchronous)
        self.num_speculative_tokens = config.num_speculative_tokens
        #: vllm-v1/priority-victim-any-running
        self.victim_any_running = semantics is Semantics.VLLM_V1 and config.policy == "priority"
        #: nano-vllm/admission-tests-len-seq
        self.whole_sequence_gate = semantics is Semantics.NANO_VLLM
        #: transformers/offload-starved and the rest of the transformers rules: the step
        #: is impl/offload_step.py's
        self.offloads_starved = semantics is Semantics.TRANSFORMERS
        #: transformers/admission-frozen: no waiting request is a candidate
        self.admission_frozen = False
        #: tokenspeed's plan (impl/reserve_step.py): tokenspeed/reserve-generation,
        #: prefill-first, head-of-line-chunk, skip-not-fit, submission-order
        self.reserves_generation = semantics is Semantics.TOKENSPEED
        #: tokenspeed/finished-id-held: ids finished in the last step or aborted since,
        #: taken until the next plan
        self.ids_held: tuple[str, ...] = ()
        self.policy: Policy = make_policy(config.policy)
        self.policy.bind(config)
        # The policy's on_run/on_leave hooks are called only if it tracks running.
        self.tracks_running = self.policy.tracks_running
        self.vocab_size = vocab_size
        self.enable_preemption = enable_preemption
        self.block_size = config.block_size
        # One GPU pool, asked the caching questions (PC1-PC9) whether caching is on or
        # not: with it, blocks are shared by reference count; without, the plain pool
        # answers with no-ops (nothing hits, nothing is keyed).
        self.gpu: BlockPool
        if config.enable_prefix_caching:
            nano = semantics is Semantics.NANO_VLLM  # nano-vllm's cache (N7)
            self.gpu = PrefixCachingBlockManager(
                config.num_gpu_blocks,
                config.block_size,
                last_key_wins=nano,
                drop_key_on_free=nano,
            )
        else:
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
        if self.max_model_len is not None and self.max_model_len < seq.stop_len:
            # vllm-v1/max-model-len: length at that size; vllm-v0/max-model-len's prompt of
            # max_model_len tokens stops at its first output.
            seq.stop_len = max(self.max_model_len, seq.num_prompt_tokens + 1)
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
        temperature = params.temperature
        # A bad temperature would only fail in the sampler, mid-step, and fail every
        # retry of that step: refused here, the other requests keep being served.
        if not (
            isinstance(temperature, int | float) and math.isfinite(temperature) and temperature >= 0
        ):
            raise InvalidSamplingParamsError(
                f"request {request_id!r}: temperature must be a finite number >= 0, "
                f"got {temperature!r}"
            )
        if request_id in self.requests:
            raise DuplicateRequestError(f"request {request_id!r} is already live")
        if request_id in self.ids_held:  # tokenspeed/finished-id-held
            raise DuplicateRequestError(
                f"request {request_id!r} has just finished: its id is held until the next plan"
            )
        self._check_fits(request_id, len(prompt), max_tokens)

    def _check_fits(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        """R4.5: reject a request that could never be scheduled.

        vllm-v1/max-model-len replaces it: a prompt of ``max_model_len`` tokens or more is
        refused (vLLM's front end); the profile's config makes the rest fit.
        vllm-v0/max-model-len: a prompt longer than ``max_model_len``.
        tokenspeed/submit-refusal: prompt plus ``max_tokens`` over the whole cache.
        """
        config = self.config
        if self.reserves_generation:
            # tokenspeed/submit-refusal: its reserve, prompt + max_tokens, exceeds the cache.
            if prompt_len + max_tokens > config.num_gpu_blocks * config.block_size:
                raise RequestTooLargeError(
                    f"request {request_id!r}: {prompt_len} + {max_tokens} tokens exceed the "
                    f"{config.num_gpu_blocks} blocks of {config.block_size}"
                )
            return
        length = self.max_model_len
        if length is not None:
            if prompt_len > length or (prompt_len == length and not self.prompt_may_fill_model_len):
                relation = ">" if self.prompt_may_fill_model_len else ">="
                raise RequestTooLargeError(
                    f"request {request_id!r}: prompt of {prompt_len} tokens {relation} "
                    f"max_model_len {length}"
                )
            return
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
            if self.tracks_running:
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
        if self.async_scheduling:  # vllm-v1/async-batch-queue: finished_req_ids
            self.has_finished_requests = True
        if self.reserves_generation:  # tokenspeed/finished-id-held, until the next plan
            self.ids_held = (*self.ids_held, request_id)
        return seq.to_finished(FinishReason.ABORTED)

    def has_unfinished_requests(self) -> bool:
        """A request is live, or (async scheduling) a step is still in flight."""
        return bool(self.requests) or bool(self.in_flight)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- phases A-C -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Phases A-C of one step (R5-R8); on any error the partial work is undone."""
        out = SchedulerOutput(self.num_steps, self.num_cached_tokens)
        if self.async_scheduling and not pipeline.has_requests(self):
            out.queued = False  # vllm-v1/async-batch-queue
            return out
        if self.offloads_starved or self.reserves_generation:
            out.snapshot = Snapshot(self)
            try:
                if self.offloads_starved:
                    offload_step.schedule_offloading(self, out)
                else:
                    reserve_step.schedule_reserving(self, out)
            except BaseException:
                self.rollback(out)
                raise
            out.num_batched_tokens = sum(out.num_scheduled)
            return out
        self.gpu.begin()
        config = self.config
        budget = config.max_num_batched_tokens
        self.chunk_cap = self._long_prefill_cap()
        admit_first = self.prefill_first or (self.prefill_first_unless_swapped and not self.swapped)
        try:
            # Phases B and C only when someone is swapped or waiting: most steps are not.
            if admit_first:
                if self.waiting:
                    budget = phases.admit(self, out, budget)
                if out.num_admitted:
                    pass
                elif self.prefill_first:
                    phases.decode_unbudgeted(self, out)
                else:  # vllm-v0: nothing is swapped, so phase B has nobody to bring back
                    budget = phases.schedule_running(self, out, budget)
            else:
                budget = phases.schedule_running(self, out, budget)
                if not out.preempted:
                    if self.swapped:
                        budget = phases.swap_in(self, out, budget)
                    # vllm-v0/prefill-first: no admission in a step that began with swaps.
                    admits = not self.prefill_first_unless_swapped
                    if not self.swapped and self.waiting and admits:
                        budget = phases.admit(self, out, budget)
        except BaseException:
            rollback(self, out)
            raise
        n = len(out.num_scheduled)
        out.num_batched_tokens = sum(out.num_scheduled)
        # Synchronous chunks are a contiguous run of ``running``: its head, or under
        # nano-vllm/prefill-first (vllm-v0's) the requests a prefill step admitted, at its
        # tail (async: phase A may walk past some, vllm-v1/async-max-tokens).
        out.first_scheduled = len(self.running) - n if admit_first and out.num_admitted else 0
        return out

    def _long_prefill_cap(self) -> int:
        """vllm-v1/long-prefill-cap: the threshold, off while at most one request is
        running or waiting, floored at the budget's fair share when adaptive."""
        config = self.config
        threshold = config.long_prefill_token_threshold
        if not threshold:
            return 0
        count = len(self.running) + len(self.waiting)
        if count <= 1:
            return 0
        if config.long_prefill_token_threshold_adaptive:
            return max(threshold, config.max_num_batched_tokens // count)
        return threshold

    def commit(
        self, out: SchedulerOutput, sampled_token_ids: SequenceABC[int]
    ) -> list[FinishedRequest]:
        """Phase D (R10): apply the chunks and the sampled tokens; finish requests.

        ``sampled_token_ids`` holds one token per sampling chunk, in plan order.
        Returns the finished requests in plan order; ``num_steps`` goes up by one.
        """
        finished = phases.commit(self, out, sampled_token_ids)
        self.gpu.end()
        if finished:  # transformers/admission-frozen: a finished request unfreezes it
            self.admission_frozen = False
        if self.reserves_generation:  # tokenspeed/finished-id-held, until the next plan
            self.ids_held = tuple(f.request_id for f in finished)
        return finished

    def commit_verified(
        self, out: SchedulerOutput, runs: SequenceABC[SequenceABC[int]]
    ) -> list[FinishedRequest]:
        """Phase D under speculative decoding (vllm-v1/spec-verify): ``runs`` holds each
        sampling chunk's run (its accepted drafts, then one more token), in plan order.
        The caller then proposes the next drafts (``propose_drafts``)."""
        finished = phases.commit_verified(self, out, runs)
        self.gpu.end()
        return finished

    def propose_drafts(
        self, out: SchedulerOutput, propose: Callable[[list[int]], SequenceABC[int]]
    ) -> None:
        """vllm-v1/spec-propose after ``commit_verified(out, ...)``: the drafts of the
        requests ``out`` scheduled, from ``propose(prompt + outputs)``."""
        speculative.propose_drafts(self, out, propose)

    def rollback(self, out: SchedulerOutput) -> None:
        """Undo ``schedule()`` exactly (``impl/rollback.py``); only before ``commit``."""
        if out.snapshot is not None:  # transformers, tokenspeed: the whole state back
            out.snapshot.restore(self)
            out.clear()
            return
        rollback(self, out)

    # --- the step as a whole ------------------------------------------------------------

    def step(self, sample: Callable[[SchedulerOutput], SequenceABC[int]]) -> StepPlan:
        """Schedule, sample with ``sample(output)`` (no model), commit; the plan.

        If ``sample`` raises, the step is rolled back and the error propagates. Under
        async scheduling ``sample`` runs at once (the step's tokens wait with it until it
        is applied; ``output.pending`` holds the tokens of the step in flight).
        """
        out = self.schedule()
        if not self.async_scheduling:
            tokens = self._sampled(out, sample)
            return make_plan(out, self.commit(out, tokens))
        if not out.queued:
            return self.complete_async_step(out, None)
        if self.in_flight:
            oldest = self.in_flight[-1]
            assert oldest.tokens is not None
            out.pending = oldest.pending(oldest.tokens)
        return self.complete_async_step(out, self._sampled(out, sample))

    def step_verified(
        self,
        verify: Callable[[SchedulerOutput], SequenceABC[SequenceABC[int]]],
        propose: Callable[[list[int]], SequenceABC[int]],
    ) -> StepPlan:
        """``step`` under speculative decoding: schedule, ``verify(output)`` (each
        sampling chunk's run), commit, then ``propose`` the next drafts; the plan. If
        ``verify`` raises, the step is rolled back and the error propagates."""
        out = self.schedule()
        try:
            runs = list(verify(out))
        except BaseException:
            self.rollback(out)
            raise
        plan = make_plan(out, self.commit_verified(out, runs))
        self.propose_drafts(out, propose)
        return plan

    def _sampled(
        self, out: SchedulerOutput, sample: Callable[[SchedulerOutput], SequenceABC[int]]
    ) -> list[int]:
        """``sample(out)``, one token per sampling chunk; on any error ``out`` is undone."""
        try:
            tokens = list(sample(out))
            if len(tokens) != out.num_samples:
                raise SampledTokensError(
                    f"step {out.step}: {out.num_samples} requests sample, got {len(tokens)}"
                )
        except BaseException:
            self.rollback(out)
            raise
        return tokens

    def applies_oldest(self, out: SchedulerOutput) -> bool:
        """Whether the async step of ``out`` (just scheduled) will apply the oldest step
        in flight (vllm-v1/async-batch-queue): the caller needs its tokens by then."""
        return pipeline.pops_oldest(self, out, len(self.in_flight) + out.queued)

    def complete_async_step(self, out: SchedulerOutput, tokens: list[int] | None) -> StepPlan:
        """The rest of an async step after ``schedule()`` (impl/pipeline.py): ``advance``
        the step just scheduled (``tokens``: its forward's, if it has run; else the
        caller sets them on ``in_flight[-1]`` before it is applied), then apply the
        oldest step in flight if ``applies_oldest``. The plan: this step's decisions,
        the applied step's tokens and finished requests."""
        applies = self.applies_oldest(out)
        if out.queued:
            pipeline.advance(self, out).tokens = tokens
            self.gpu.end()
        self.num_steps += 1
        if not applies:
            return make_async_plan(out, [], [], [])
        got, got_tokens, finished = pipeline.apply(self)
        return make_async_plan(out, got, got_tokens, finished)

    # --- the spec's view ----------------------------------------------------------------

    def observe(self) -> SchedulerState:
        """The state projected onto ``spec.types.SchedulerState`` (compare with ``==``)."""
        pool = self.gpu.observe()
        running = tuple(seq.to_state() for seq in self.running)
        if self.num_speculative_tokens:  # vllm-v1/spec-rejected-blocks-kept
            bs = self.block_size
            running = tuple(
                replace(state, num_blocks_ahead=ahead)
                if (ahead := len(seq.block_table) - cdiv(seq.num_computed, bs))
                else state
                for state, seq in zip(running, self.running, strict=True)
            )
        if pool is not None:  # PC1: the spec sees each running request's block ids
            running = tuple(
                replace(state, block_ids=tuple(seq.block_table))
                for state, seq in zip(running, self.running, strict=True)
            )
        return SchedulerState(
            config=self.config,
            num_free_gpu_blocks=self.gpu.num_free_blocks,
            num_free_cpu_blocks=self.cpu.num_free_blocks,
            waiting=tuple(seq.to_state() for seq in self.waiting.stored()),
            running=running,
            swapped=tuple(seq.to_state() for seq in self.swapped),
            next_arrival=self.next_arrival,
            num_steps=self.num_steps,
            prefix_cache=pool,
            admission_frozen=self.admission_frozen,
            ids_held=self.ids_held,
            in_flight=tuple(step.observe() for step in self.in_flight),
            has_finished_requests=self.has_finished_requests,
        )

    def check_invariants(self) -> None:
        """Assert R1 and R2 on the whole state (O(everything): for tests)."""
        check_invariants(self)
