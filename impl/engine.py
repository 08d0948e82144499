"""The engine: scheduler + KV pools + model runner, with vLLM's verbs.

``LLMEngine.step()`` is transactional. ``Scheduler.schedule()`` mutates the queues
and block tables and returns the step's undo journal; then the swap copies and the
forward run; only if they all succeed does ``Scheduler.commit()`` apply phase D and
the metrics advance. If a swap copy, the forward or the sampler raises:

1. the GPU blocks that this step's victims gave up *and* that this step handed to
   another request (the forward may have overwritten them) are restored from a
   snapshot taken just before the forward (``CacheEngine.snapshot``); blocks a
   victim gave up but nobody reused were not written, blocks a scheduled request
   already owned are written only at positions past its ``num_computed`` (not yet
   valid K/V), and newly allocated blocks become free again;
2. ``Scheduler.rollback()`` replays the journal backwards: admitted and
   swapped-in requests go back to their queues, victims back into ``running`` at
   their index with their block tables, counters and (restart) outputs, grown
   block tables shrink, and both free lists regain their exact order;
3. the error propagates. ``observe()`` equals its value before the step, and the
   next ``step()`` makes the same decisions again (sampling depends only on seed,
   output index and logits, so a retry samples the same tokens).

Swap-out copies GPU->CPU (the GPU side is only read) and swap-in CPU->GPU into
newly allocated blocks (the CPU side is only read), so a failed copy never damages
K/V that the rolled-back state still needs. Phase B runs only in steps without
preemption, so a step never both swaps out and swaps in.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from impl.block_manager import cdiv
from impl.cache_engine import CacheEngine
from impl.model_runner import ModelRunner
from impl.ngram_proposer import NgramProposer
from impl.plan import make_plan
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from impl.speculative import Proposer, SpeculativeCounts, check_runs
from impl.worker import ForwardWorker
from model import LlamaForCausalLM, build_tiny_model, resolve_device, resolve_dtype
from spec.types import (
    ConfigError,
    DuplicateRequestError,
    FinishedRequest,
    KVSchedError,
    PreemptionMode,
    SampledTokensError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)

# Below this many parameters a CPU forward's matmuls are too small to be worth
# splitting: one thread beat two by 4-40x from the tiny default model (0.1M) up to a
# 78M-parameter one on a 2-core machine (docs/cli.md, "Threads"). Above it, a thread
# pays off only on a CPU that is otherwise idle: on that machine under load, one
# thread still beat two by 3x at 308M.
SMALL_MODEL_PARAMETERS = 100_000_000


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def idle_cpus() -> int:
    """Usable CPUs less the 1-minute load average (runnable threads), at least 1."""
    cpus = available_cpus()
    if not hasattr(os, "getloadavg"):
        return cpus
    return max(1, min(cpus, cpus - round(os.getloadavg()[0])))


def default_num_threads(model: LlamaForCausalLM) -> int:
    """torch's intra-op threads for ``model`` when none are asked for.

    One thread for a model on an accelerator (the CPU only schedules and samples) and
    for a CPU model under ``SMALL_MODEL_PARAMETERS``, where extra threads spin instead
    of working; otherwise one per idle CPU (``idle_cpus``), since threads that share
    a CPU with other work wait on each other.
    """
    on_cpu = next(model.parameters()).device.type == "cpu"
    size = sum(p.numel() for p in model.parameters())
    if not on_cpu or size < SMALL_MODEL_PARAMETERS:
        return 1
    return idle_cpus()


def set_num_threads(model: LlamaForCausalLM, threads: int | None) -> int:
    """Set torch's intra-op threads: ``threads``, or ``default_num_threads`` if ``None``.

    Returns the number set. ``OMP_NUM_THREADS`` in the environment counts as asking:
    with ``threads=None`` torch's setting is then left as it is.
    """
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        threads = default_num_threads(model)
    cpus = available_cpus()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cpus:
        # More threads than CPUs only contend; far more fail to start (libgomp segfaults).
        raise ConfigError(
            f"threads must be None or an int in 1..{cpus} (CPUs here), got {threads!r}"
        )
    torch.set_num_threads(threads)
    return threads


class EngineStalledError(KVSchedError, RuntimeError):
    """``generate()`` stepped past ``drain_step_limit`` with its requests still live."""


def drain_step_limit(state: SchedulerState) -> int:
    """A generous bound on the steps until every live request of ``state`` has finished,
    past which ``generate()`` reports a stuck engine instead of looping.

    Per request, what it takes as the head of the engine: its whole sequence prefilled
    in budget-sized chunks, then one step per output, ``cdiv(P + M, B) + M`` (the
    spec's drain bound, docs/semantics.md, "Why every accepted request finishes", never
    charges a request more); for ``n`` live requests, ``(n + 1)`` times the sum, plus
    ``n``, as if each could lose all its progress once to each other one (so it holds
    under every policy, not only those the LIFO proof covers). Under async scheduling
    two more: a request's finish is applied a step after its last chunk, a step its
    own term already has to spare (the spec's bound charges it at most
    ``cdiv(P + o, B) + M - o - 1`` steps, one fewer than its term here), and after the
    last finish the batch queue empties in two steps (one the finish still makes
    schedule, one that only applies it; docs/semantics.md, "Liveness under the
    profiles").
    """
    live = (*state.waiting, *state.running, *state.swapped)
    budget = state.config.max_num_batched_tokens
    per_request = sum(
        cdiv(len(r.request.prompt_token_ids) + r.request.params.max_tokens, budget)
        + r.request.params.max_tokens
        for r in live
    )
    bound = (len(live) + 1) * per_request + len(live)
    return bound + 2 if state.config.async_scheduling else bound


def checked_tokens(out: SchedulerOutput, tokens: list[int]) -> list[int]:
    """The model runner's ``tokens`` for ``out``: one per sampling chunk, else
    ``SampledTokensError``."""
    if len(tokens) != out.num_samples:
        raise SampledTokensError(
            f"step {out.step}: {out.num_samples} requests sample, "
            f"the model runner returned {len(tokens)} tokens"
        )
    return tokens


def checked_runs(out: SchedulerOutput, runs: list[list[int]]) -> list[list[int]]:
    """The model runner's ``runs`` for ``out`` (speculative decoding): one valid run per
    sampling chunk, else ``SampledTokensError`` (``impl.speculative.check_runs``)."""
    check_runs(out, runs)
    return runs


T = TypeVar("T")


def _zero_by_mode() -> dict[PreemptionMode, int]:
    return dict.fromkeys(PreemptionMode, 0)


@dataclass
class EngineMetrics:
    """Counters of the committed steps (a rolled-back step adds nothing).

    * ``steps``: committed steps, empty ones included.
    * ``preemptions``: victims by the mode actually used (a swap that fell back to
      recompute counts as recompute); ``num_preemptions`` is their sum.
    * ``swap_out_blocks`` / ``swap_in_blocks``: blocks copied GPU->CPU / CPU->GPU.
    * ``recomputed_tokens``: tokens run through the model at positions that the
      request had computed before a recompute/restart preemption dropped them (the
      re-prefill, and under restart also the re-decoded outputs).
    * ``scheduled_tokens``: all tokens run through the model.
    * ``generated_tokens``: tokens sampled (restart's re-sampled outputs included).
    * ``peak_gpu_blocks_used``: the most GPU blocks in use at any forward.
    * ``kv_utilization``: mean over steps of ``t / (num_gpu_blocks * block_size)``,
      where ``t`` is the number of tokens whose K/V is in the GPU cache when the
      step's forward has run (every running request's computed tokens plus the
      step's chunks; finished requests still counted in their last step; with
      prefix caching a slot of a shared block counts once). It measures how much
      of the cache holds live tokens: partly filled last blocks and free blocks
      both lower it, and it never exceeds 1.
    * ``step_time_s``: wall time spent in committed ``step()`` calls;
      ``tokens_per_s`` is ``generated_tokens / step_time_s``.
    * speculative decoding (vllm-v1/spec-*): ``draft_tokens`` the drafts verified (a
      padded admission's aside), ``accepted_tokens`` those delivered as outputs,
      ``verify_runs`` the sampling chunks that ran drafts, ``forwards`` the steps that
      ran a forward; ``speculative`` has them with their ratios (acceptance rate, mean
      accepted length, tokens per forward: ``impl.speculative.SpeculativeCounts``).
    * prefix caching (PC3-PC5): ``prefix_cache_queries`` the tokens of admitted
      requests (looked up), ``prefix_cache_hits`` the tokens of theirs found cached
      (not run through the model), ``prefix_cache_hit_rate`` their ratio, and
      ``reclaimed_cached_blocks`` the cached blocks reclaimed for other content.
      With caching off every admission is looked up too, and nothing hits.
    """

    steps: int = 0
    preemptions: dict[PreemptionMode, int] = field(default_factory=_zero_by_mode)
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    recomputed_tokens: int = 0
    scheduled_tokens: int = 0
    generated_tokens: int = 0
    peak_gpu_blocks_used: int = 0
    kv_utilization_sum: float = 0.0
    step_time_s: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    reclaimed_cached_blocks: int = 0
    forwards: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_runs: int = 0

    @property
    def speculative(self) -> SpeculativeCounts:
        return SpeculativeCounts(
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            verify_runs=self.verify_runs,
            forwards=self.forwards,
            tokens=self.generated_tokens,
        )

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    @property
    def kv_utilization(self) -> float:
        return self.kv_utilization_sum / self.steps if self.steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.step_time_s if self.step_time_s > 0 else 0.0


class LLMEngine:
    """A paged-KV LLM engine with continuous batching and preemption.

    ``model`` defaults to ``build_tiny_model(seed, dtype, device)``; with an explicit
    ``model``, ``device``/``dtype``/``seed`` are unused (the model decides). The KV
    pools take the model's dtype and device.

    ``threads`` sets torch's intra-op threads, which are process-wide: ``None`` picks
    them from the model (``default_num_threads``: one for the tiny default model)
    unless ``OMP_NUM_THREADS`` is set; ``self.num_threads`` is the number in effect.
    """

    enable_preemption = True

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        model: LlamaForCausalLM | None = None,
        device: str = "auto",
        dtype: str = "float32",
        seed: int = 0,
        threads: int | None = None,
        drafter: Proposer | None = None,
    ) -> None:
        if model is None:
            model = build_tiny_model(
                seed=seed, dtype=resolve_dtype(dtype), device=resolve_device(device)
            )
        self.num_threads = set_num_threads(model, threads)
        self.config = config
        self.model = model
        self.scheduler = Scheduler(
            config,
            vocab_size=model.config.vocab_size,
            enable_preemption=self.enable_preemption,
        )
        self.cache_engine = CacheEngine(
            model,
            num_gpu_blocks=config.num_gpu_blocks,
            num_cpu_blocks=config.num_cpu_blocks,
            block_size=config.block_size,
        )
        self.model_runner = ModelRunner(model, self.cache_engine)
        #: speculative decoding (``num_speculative_tokens`` > 0): who drafts, by default
        #: prompt lookup of 5-grams (vLLM's defaults for ``method: "ngram"``)
        self.drafter: Proposer | None = None
        if config.num_speculative_tokens:
            self.drafter = drafter or NgramProposer(
                num_speculative_tokens=config.num_speculative_tokens,
                prompt_lookup_min=5,
                prompt_lookup_max=5,
                max_model_len=config.max_model_len,
            )
        self.metrics = EngineMetrics()
        # Async scheduling: the forwards of the steps in flight (one per
        # ``scheduler.in_flight`` step), run by the worker thread.
        self.worker: ForwardWorker | None = None
        self.forwards: deque[Future[list[int]]] = deque()
        #: the forward whose failure the last ``step()`` raised: run again by the next
        self.failed_forward: Future[list[int]] | None = None
        if config.async_scheduling:
            # Looked up per forward: tests replace ``model_runner.execute`` (faults).
            self.worker = ForwardWorker(lambda out: self.model_runner.execute(out))  # noqa: PLW0108

    # --- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceABC[int],
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request (R4); a refused one raises its typed error and changes nothing."""
        self.scheduler.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> FinishedRequest:
        """Remove a live request in any state and free its blocks (R11)."""
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def observe(self) -> SchedulerState:
        """The state as the spec's ``SchedulerState`` (compare to the spec's with ``==``)."""
        return self.scheduler.observe()

    # --- steps ------------------------------------------------------------------------

    def step(self) -> StepPlan:
        """One scheduling step and one forward; all or nothing (see the module doc)."""
        if self.worker is not None:
            return self._async_step(self.worker)
        started = time.perf_counter()
        scheduler = self.scheduler
        out = scheduler.schedule()
        gpu_blocks_used = scheduler.gpu.num_used_blocks
        tokens_in_cache = self._tokens_in_cache(out, gpu_blocks_used)
        if self.drafter is None:
            tokens = self._execute(out, lambda: checked_tokens(out, self.model_runner.execute(out)))
            plan = make_plan(out, scheduler.commit(out, tokens))
        else:  # vllm-v1/spec-*: one verify forward, then the next drafts
            runs = self._execute(out, lambda: checked_runs(out, self.model_runner.verify(out)))
            plan = make_plan(out, scheduler.commit_verified(out, runs))
            scheduler.propose_drafts(out, self.drafter.propose)
        self._record(out, tokens_in_cache, gpu_blocks_used, time.perf_counter() - started, plan)
        return plan

    def _async_step(self, worker: ForwardWorker) -> StepPlan:
        """An async step (vllm-v1/async-*, impl/pipeline.py): schedule step N and submit
        its forward, then (if the batch queue says so) wait for the oldest step's forward
        and apply its tokens; step N's forward runs meanwhile, and on while the caller
        schedules N+1. All or nothing: if the awaited forward failed, step N's schedule
        is undone (its forward never runs) and the failed step stays in flight, its
        forward run again by the next call (the same tokens: sampling is a function of
        seed, output index and logits)."""
        started = time.perf_counter()
        scheduler = self.scheduler
        forwards = self.forwards
        if forwards and forwards[0] is self.failed_forward:
            # The step in flight failed in the last call: its forward again (its inputs
            # and pending tokens are kept on its output).
            forwards[0] = worker.submit(scheduler.in_flight[0].out, None)
            self.failed_forward = None
        out = scheduler.schedule()
        gpu_blocks_used = scheduler.gpu.num_used_blocks
        tokens_in_cache = self._tokens_in_cache(out, gpu_blocks_used)
        forward: Future[list[int]] | None = None
        if out.queued:
            assert not out.swap_out and not out.swap_in, "vllm-v1 preempts by recompute only"
            out.forward_input = self.model_runner.prepare(out)
            after = (scheduler.in_flight[-1], forwards[-1]) if forwards else None
            forward = worker.submit(out, after)
            forwards.append(forward)
        # The step applied: the oldest in flight, or (nothing in flight) this one.
        own_tokens: list[int] | None = None
        if scheduler.applies_oldest(out):
            applied = scheduler.in_flight[0].out if scheduler.in_flight else out
            try:
                tokens = checked_tokens(applied, forwards[0].result())
            except BaseException:
                if forward is not None:
                    forwards.pop()
                    forward.exception()  # failed, or skipped: the worker is past it
                    scheduler.rollback(out)
                self.failed_forward = forwards[0] if forwards else None
                raise
            forwards.popleft()
            if scheduler.in_flight:
                scheduler.in_flight[0].tokens = tokens
            else:
                own_tokens = tokens
        plan = scheduler.complete_async_step(out, own_tokens)
        self._record(out, tokens_in_cache, gpu_blocks_used, time.perf_counter() - started, plan)
        return plan

    def synchronize(self) -> None:
        """Wait until the forwards in flight have run (their tokens are not applied)."""
        for forward in self.forwards:
            forward.exception()

    def _tokens_in_cache(self, out: SchedulerOutput, gpu_blocks_used: int) -> int:
        """Token slots holding K/V once this step's forward has run (``kv_utilization``).

        With prefix caching a block held by ``k`` requests is counted ``k`` times by the
        per-request counts; it is full (only full blocks are hit, PC3), so each extra
        holder adds ``block_size`` slots that are not there.
        """
        scheduler = self.scheduler
        tokens = scheduler.num_cached_tokens + out.num_batched_tokens
        if not self.config.enable_prefix_caching:
            return tokens
        held = sum(len(seq.block_table) for seq in scheduler.running)
        return tokens - self.config.block_size * (held - gpu_blocks_used)

    def _execute(self, out: SchedulerOutput, forward: Callable[[], T]) -> T:
        """Swap copies and ``forward()``; on any error undo the step and re-raise."""
        cache_engine = self.cache_engine
        protected: list[int] = []
        saved = None
        try:
            if out.swap_out:
                cache_engine.swap_out(out.swap_out)
            if out.swap_in:
                cache_engine.swap_in(out.swap_in)
            protected = self._reused_victim_blocks(out)
            if protected:
                saved = cache_engine.snapshot(protected)
            return forward()
        except BaseException:
            if saved is not None:
                cache_engine.restore(protected, saved)
            self.scheduler.rollback(out)
            raise

    def _reused_victim_blocks(self, out: SchedulerOutput) -> list[int]:
        """GPU blocks freed by this step's victims and allocated again in this step.

        With prefix caching, also the cached blocks reclaimed in this step: a rollback
        gives them their keys back, so their K/V must survive the failed forward.
        """
        reclaimed = self.scheduler.gpu.reclaimed_blocks()
        if not out.preempted:
            return reclaimed
        given_up = {block for record in out.preempted for block in record.gpu_blocks}
        bs = self.config.block_size
        reused = []
        for seq in out.scheduled:
            # A scheduled request owned cdiv(num_computed, bs) blocks before this step.
            for block in seq.block_table[cdiv(seq.num_computed, bs) :]:
                if block in given_up:
                    reused.append(block)
        return list(dict.fromkeys((*reused, *reclaimed)))

    def _record(
        self,
        out: SchedulerOutput,
        tokens_in_cache: int,
        gpu_blocks_used: int,
        seconds: float,
        plan: StepPlan,
    ) -> None:
        metrics = self.metrics
        metrics.steps += 1
        for record in out.preempted:
            metrics.preemptions[record.mode] += 1
        metrics.swap_out_blocks += len(out.swap_out)
        metrics.swap_in_blocks += len(out.swap_in)
        metrics.recomputed_tokens += out.num_recomputed_tokens
        metrics.scheduled_tokens += out.num_batched_tokens
        metrics.generated_tokens += len(plan.sampled_ids)  # async: the applied step's
        metrics.forwards += bool(out.scheduled)
        metrics.draft_tokens += out.num_draft_tokens
        metrics.accepted_tokens += out.num_accepted_tokens
        metrics.verify_runs += out.num_verify_runs
        metrics.prefix_cache_queries += out.num_queried_tokens
        metrics.prefix_cache_hits += out.num_hit_tokens
        if out.queued:  # an async step that scheduled nothing began no pool step
            metrics.reclaimed_cached_blocks += self.scheduler.gpu.num_reclaimed
        metrics.peak_gpu_blocks_used = max(metrics.peak_gpu_blocks_used, gpu_blocks_used)
        capacity = self.config.num_gpu_blocks * self.config.block_size
        metrics.kv_utilization_sum += tokens_in_cache / capacity
        metrics.step_time_s += seconds

    def generate(
        self, requests: SequenceABC[tuple[str, SequenceABC[int], SamplingParams]]
    ) -> list[FinishedRequest]:
        """Add all requests, step until each has finished; results in input order.

        All requests are checked (R4) before any is added, so a bad one raises and
        adds nothing. Requests already in the engine keep running alongside; their
        results are reported in the plans this call consumes, not returned. An engine
        that has not finished them within ``drain_step_limit`` steps is stuck (a
        scheduling bug): ``EngineStalledError``, never an endless loop.
        """
        ids = [request_id for request_id, _, _ in requests]
        if len(set(ids)) != len(ids):
            raise DuplicateRequestError(f"duplicate request ids in one generate() call: {ids}")
        for request_id, prompt, params in requests:
            self.scheduler.check_request(request_id, prompt, params)
        for request_id, prompt, params in requests:
            self.add_request(request_id, prompt, params)
        results: dict[str, FinishedRequest] = {}
        pending = set(ids)
        limit = drain_step_limit(self.observe())
        steps = 0
        while pending:
            if steps == limit:
                raise EngineStalledError(
                    f"{sorted(pending)} not finished after {steps} steps: {self.observe()}"
                )
            steps += 1
            for finished in self.step().finished:
                if finished.request_id in pending:
                    pending.discard(finished.request_id)
                    results[finished.request_id] = finished
        return [results[request_id] for request_id in ids]
