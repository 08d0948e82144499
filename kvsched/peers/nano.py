"""nano-vllm's real scheduler (``nano-vllm-fork`` 20260210) through the protocol.

``nanovllm/__init__.py`` imports the CUDA engine (triton, flash-attn), so the
scheduler's modules are loaded with the package's ``__init__`` bypassed: an empty
package module pointing at the installed folder. The ``Scheduler`` reads only five
config fields, given here directly (its ``Config`` wants a real model folder and a
block size that is a multiple of 256).

What nano-vllm has no counterpart for is refused with ``PeerUnsupportedError``: one
EOS for the whole engine (``eos_token_id``: every request that does not ignore EOS
must carry it), no priorities, block size >= 2 (its full-block test
``len % 1 == 1`` never holds), recompute only. It does not count preemptions per
request (``Hidden.NUM_PREEMPTIONS``) and has no abort (``abort_request`` does what one
would: leave both queues, free the blocks).

Its prefix cache is always on. With ``enable_prefix_caching`` the spec models it
(the ``nano-vllm`` profile's cache rules, N7/N8) and ``observe`` projects the pool
onto ``PrefixCacheState``: the free queue is ``free_block_ids``; ``cached`` is
``hash_to_block_id`` in its order, each hash given as the token prefix it stands for,
read from a running sequence that holds the block (the fork keeps a hash only for
blocks in use); each running request's ``block_ids`` is its block table. With caching
off the pool is not shown, and a hit shows as a chunk that starts later in the peer.

A prefill that every token of a request hit (a prompt of whole blocks that another
running request holds) has no token to compute: nano-vllm's model runner then reads
another sequence's logits, or fails in FlashAttention when nothing else is in the
batch (upstream nano-vllm issues #114, #144). ``step`` raises ``FullHitPrefill`` there
(N12 in docs/peers.md): the engine cannot run the step the scheduler decided.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvsched.peers.protocol import (
    Hidden,
    Observation,
    PeerFailure,
    PeerNotInstalledError,
    PeerUnsupportedError,
    make_plan,
)
from spec.oracle import TokenOracle
from spec.types import (
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    Preemption,
    PreemptionMode,
    PrefixCacheState,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
)

NAME = "nano-vllm"
VERSION = "20260210"

_nano: dict[str, Any] = {}


class FullHitPrefill(Exception):
    """A prefill of zero tokens: every token of the request hit the cache (N12)."""


def _import() -> dict[str, Any]:
    if _nano:
        return _nano
    spec = importlib.util.find_spec("nanovllm")
    if spec is None or not spec.submodule_search_locations:
        raise PeerNotInstalledError(NAME, "no module named 'nanovllm'")
    if "nanovllm" not in sys.modules:
        package = types.ModuleType("nanovllm")
        package.__path__ = list(spec.submodule_search_locations)
        package.__file__ = str(Path(package.__path__[0]) / "__init__.py")
        package.__spec__ = spec  # found, never executed
        sys.modules["nanovllm"] = package
    try:
        scheduler = importlib.import_module("nanovllm.engine.scheduler")
        sequence = importlib.import_module("nanovllm.engine.sequence")
        sampling = importlib.import_module("nanovllm.sampling_params")
    except ImportError as e:
        raise PeerNotInstalledError(NAME, str(e)) from None
    _nano.update(
        Scheduler=scheduler.Scheduler,
        Sequence=sequence.Sequence,
        SequenceStatus=sequence.SequenceStatus,
        SamplingParams=sampling.SamplingParams,
    )
    return _nano


def check_config(config: SchedulerConfig) -> None:
    if config.policy != "lifo":
        raise PeerUnsupportedError(f"nano-vllm: no policy {config.policy!r} (it has one order)")
    if config.preemption_mode is not PreemptionMode.RECOMPUTE or config.num_cpu_blocks:
        raise PeerUnsupportedError("nano-vllm preempts by recompute only")
    if config.block_size < 2:
        raise PeerUnsupportedError("nano-vllm needs block_size >= 2")


class NanoAdapter:
    name = NAME
    semantics = "nano-vllm"

    def __init__(self, config: SchedulerConfig, *, eos_token_id: int | None = None) -> None:
        check_config(config)
        self.config = config
        self.n = _import()
        self.eos = eos_token_id
        self._own_block_size()
        self.scheduler = self.n["Scheduler"](
            types.SimpleNamespace(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                eos=-1 if eos_token_id is None else eos_token_id,
                num_kvcache_blocks=config.num_gpu_blocks,
                kvcache_block_size=config.block_size,
            )
        )
        self.seqs: dict[str, Any] = {}
        self.ids: dict[int, str] = {}  # seq_id -> request id
        self.spec_requests: dict[str, Request] = {}
        self.next_arrival = 0
        self.num_steps = 0

    def _own_block_size(self) -> None:
        # Sequence.block_size is a process-wide class attribute the block manager relies
        # on: set it before every call, in case another adapter set another one.
        self.n["Sequence"].block_size = self.config.block_size

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        if params.priority != 0:
            raise PeerUnsupportedError("nano-vllm has no request priorities")
        # nano-vllm validates nothing: an empty prompt fails in Sequence (token_ids[-1]);
        # these are refused as the spec refuses them so that the run can go on.
        if not prompt_token_ids:
            raise EmptyPromptError("nano-vllm: empty prompt (Sequence needs a last token)")
        if params.max_tokens < 1:
            raise InvalidMaxTokensError("nano-vllm: max_tokens below 1 would never finish")
        if not params.ignore_eos and params.eos_token_id != self.eos:
            raise PeerUnsupportedError(
                f"nano-vllm has one EOS for the engine ({self.eos}); "
                f"{request_id} has {params.eos_token_id}"
            )
        scheduler = self.scheduler
        self._own_block_size()
        if request_id in self.seqs:
            raise PeerUnsupportedError(f"nano-vllm: {request_id} is already live")
        seq = self.n["Sequence"](
            list(prompt_token_ids),
            self.n["SamplingParams"](
                temperature=1.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos
            ),
        )
        scheduler.add(seq)
        self.seqs[request_id] = seq
        self.ids[seq.seq_id] = request_id
        self.spec_requests[request_id] = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            arrival=self.next_arrival,
        )
        self.next_arrival += 1

    def abort_request(self, request_id: str) -> None:
        # nano-vllm has no abort; this is what one has to do: leave the queues, free.
        seq = self.seqs.pop(request_id)
        del self.spec_requests[request_id]
        s = self.scheduler
        for queue in (s.waiting, s.running):
            while seq in queue:
                queue.remove(seq)
        if seq.block_table:
            s.block_manager.deallocate(seq)

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def step(self, next_token: TokenOracle) -> StepPlan:
        try:
            return self._step(next_token)
        except Exception as e:  # the peer failed: lockstep reports it as a divergence
            raise PeerFailure(f"nano-vllm: {type(e).__name__}: {e!r}") from e

    def _step(self, next_token: TokenOracle) -> StepPlan:
        s = self.scheduler
        self._own_block_size()
        step = self.num_steps
        if s.is_finished():
            # nano-vllm's engine loop does not call schedule() with nothing to do (it
            # would fail its `assert scheduled_seqs`): an idle step.
            self.num_steps += 1
            return make_plan(step, scheduled=())
        running_before = {id(q) for q in s.running}
        waiting_before = list(s.waiting)
        seqs, is_prefill = s.schedule()
        if is_prefill:
            for q in seqs:
                if q.num_cached_tokens >= len(q):
                    raise FullHitPrefill(
                        f"{self.ids[q.seq_id]}: all {len(q)} tokens hit the cache, none to "
                        "compute; the model runner has no logits of its own to sample from"
                    )
        # Victims were appendleft-ed to waiting one by one: the newest is at the head.
        victims = [q for q in s.waiting if id(q) in running_before and q not in waiting_before]
        scheduled: list[tuple[str, int, int]] = []
        for q in seqs:
            if is_prefill:
                scheduled.append(
                    (self.ids[q.seq_id], q.num_cached_tokens, len(q) - q.num_cached_tokens)
                )
            else:
                scheduled.append((self.ids[q.seq_id], len(q) - 1, 1))
        tokens = [next_token(tuple(q.token_ids)) for q in seqs]
        s.postprocess(seqs, tokens)
        finished: list[FinishedRequest] = []
        for q, token in zip(seqs, tokens, strict=True):
            if not q.is_finished:
                continue
            rid = self.ids[q.seq_id]
            del self.seqs[rid]
            del self.spec_requests[rid]
            stop = not q.ignore_eos and token == s.eos
            finished.append(
                FinishedRequest(
                    request_id=rid,
                    output_token_ids=tuple(q.completion_token_ids),
                    finish_reason=FinishReason.STOP if stop else FinishReason.LENGTH,
                    num_preemptions=0,
                )
            )
        self.num_steps += 1
        return make_plan(
            step,
            scheduled=scheduled,
            preempted=[
                Preemption(request_id=self.ids[q.seq_id], mode=PreemptionMode.RECOMPUTE)
                for q in reversed(victims)
            ],
            sampled=[(self.ids[q.seq_id], t) for q, t in zip(seqs, tokens, strict=True)],
            finished=finished,
        )

    def hot_step(self, token: int) -> Callable[[], None]:
        """nano-vllm's own calls for one step, every sequence sampling ``token``:
        ``schedule()`` and ``postprocess()`` (its prefix-cache hashing of full blocks
        included), nothing of the adapter's (bench/scheduler_overhead.py)."""
        scheduler = self.scheduler

        def run() -> None:
            seqs, _ = scheduler.schedule()
            scheduler.postprocess(seqs, [token] * len(seqs))

        return run

    def _state_of(self, q: Any, *, running: bool) -> RequestState:
        return RequestState(
            request=self.spec_requests[self.ids[q.seq_id]],
            output_token_ids=tuple(q.completion_token_ids),
            # A running sequence has everything but its newest token in the cache; a
            # waiting one has nothing (its blocks were freed at preemption).
            num_computed_tokens=len(q) - 1 if running else 0,
            block_ids=tuple(q.block_table) if running and self.config.enable_prefix_caching else (),
        )

    def _prefix_cache(self) -> PrefixCacheState | None:
        if not self.config.enable_prefix_caching:
            return None
        manager = self.scheduler.block_manager
        bs = self.config.block_size
        prefix_of: dict[int, tuple[int, ...]] = {}
        for q in self.scheduler.running:
            for index, block in enumerate(q.block_table):
                prefix_of.setdefault(block, tuple(q.token_ids[: (index + 1) * bs]))
        # A hash whose block no running sequence holds has no prefix to read: it is
        # shown as the block's own tokens, which no spec key equals (a divergence).
        cached = tuple(
            (prefix_of.get(block, tuple(manager.blocks[block].token_ids)), block)
            for block in manager.hash_to_block_id.values()
        )
        return PrefixCacheState(free_queue=tuple(manager.free_block_ids), cached=cached)

    def observe(self) -> Observation:
        s = self.scheduler
        state = SchedulerState(
            config=self.config,
            num_free_gpu_blocks=len(s.block_manager.free_block_ids),
            num_free_cpu_blocks=0,
            waiting=tuple(self._state_of(q, running=False) for q in s.waiting),
            running=tuple(self._state_of(q, running=True) for q in s.running),
            next_arrival=self.next_arrival,
            num_steps=self.num_steps,
            prefix_cache=self._prefix_cache(),
        )
        return Observation(
            state=state,
            blocks={rid: len(q.block_table) for rid, q in self.seqs.items()},
            hidden=frozenset({Hidden.NUM_PREEMPTIONS}),
        )
