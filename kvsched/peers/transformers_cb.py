"""transformers' continuous batching (``transformers`` 5.19.0) through the protocol.

Its own loop is driven, not a copy of it: a ``ContinuousBatchProcessor`` built as
``ContinuousBatchingManager._create_batch_processor`` builds one (a
``PagedAttentionCache``, its ``fifo`` ``FIFOScheduler``, an ``OffloadingManager``), whose
``prepare_next_batch`` / ``_generation_step`` / ``update_batch`` are called once per
step, as ``_generation_loop_body`` calls them. The model is an **oracle model runner**:
``compute_batch`` writes the driver's oracle token for every request of the batch that
samples into the processor's ``output_ids``, where ``update_batch`` reads them. Requests
and cancellations go through the processor's input and cancel queues, as the manager's
``add_request`` / ``cancel_request`` put them, and are taken in at once by the
processor's own ``_update_tp_group_state`` (a cancellation then applied as
``prepare_next_batch`` applies it first thing, ``continuous_api.py:491-494``), so that
an add or an abort takes effect when it is made, as in the spec.

Mapping (docs/peers.md, "transformers"):

- the model is a one-layer Llama config (no weights) whose KV block of ``block_size``
  tokens is 128·``block_size`` bytes, so a cache sector holds one block and the cache
  has exactly ``num_gpu_blocks`` of them (``num_blocks`` in its config); block sharing
  (prefix caching) is off, async batching, CUDA graphs and the decode fast path too;
- ``max_num_batched_tokens`` is ``max_batch_tokens``, ``max_num_seqs`` its
  ``max_requests_per_batch`` (capped by the budget, as transformers caps it);
- ``preemption_mode``: ``recompute`` is transformers' soft reset (no CPU pool);
  ``swap`` gives it a CPU offload pool of exactly ``num_cpu_blocks`` sectors, allocated
  unpinned (``torch.empty(..., pin_memory=True)`` needs an accelerator);
- the spec's ``running`` is ``active_requests`` (admission order), each request's
  ``decoding`` its DECODING status; ``waiting`` the waiting requests that are not
  CPU-offloaded (``waiting_requests_order``);
  ``swapped`` the CPU-offloaded ones; ``admission_frozen`` is ``block_new_requests``;
- a soft-reset request's prompt holds its outputs so far (``_true_initial_tokens``
  marks where they start): the adapter shows the original prompt and every output;
- transformers counts no preemptions (``Hidden.NUM_PREEMPTIONS``) and reports nothing
  for a cancelled request (``abort_request`` returns ``None``).
"""

from __future__ import annotations

import importlib
import logging
import queue
from collections.abc import Sequence
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
from spec.profiles import tracks_decoding
from spec.types import (
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    Preemption,
    PreemptionMode,
    Request,
    RequestState,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    UnknownRequestError,
)

NAME = "transformers"
VERSION = "5.19.0"
VOCAB_SIZE = 256
_HEAD_DIM = 16  # one KV head of 16 float32 values: a token's K and V take 128 bytes

_tf: dict[str, Any] = {}
_NAMES = {
    "torch": ("torch", None),
    "LlamaConfig": ("transformers", "LlamaConfig"),
    "ContinuousBatchingConfig": (
        "transformers.generation.configuration_utils",
        "ContinuousBatchingConfig",
    ),
    "GenerationConfig": ("transformers.generation.configuration_utils", "GenerationConfig"),
    "LogitsProcessorList": ("transformers.generation.logits_process", "LogitsProcessorList"),
    "continuous_api": ("transformers.generation.continuous_batching.continuous_api", None),
    "offloading_manager": ("transformers.generation.continuous_batching.offloading_manager", None),
    "PagedAttentionCache": (
        "transformers.generation.continuous_batching.cache",
        "PagedAttentionCache",
    ),
    "ContinuousBatchingLogitsProcessorList": (
        "transformers.generation.continuous_batching.cb_logits_processors",
        "ContinuousBatchingLogitsProcessorList",
    ),
    "DistributedHelper": (
        "transformers.generation.continuous_batching.distributed",
        "DistributedHelper",
    ),
    "resolve_continuous_batching_config": (
        "transformers.generation.continuous_batching.initialization",
        "resolve_continuous_batching_config",
    ),
    "RequestState": ("transformers.generation.continuous_batching.requests", "RequestState"),
    "RequestStatus": ("transformers.generation.continuous_batching.requests", "RequestStatus"),
    "SCHEDULER_MAPPING": (
        "transformers.generation.continuous_batching.scheduler",
        "SCHEDULER_MAPPING",
    ),
}


def _import() -> dict[str, Any]:
    """transformers' modules, imported once, on first use."""
    if _tf:
        return _tf
    try:
        for key, (module, attribute) in _NAMES.items():
            loaded = importlib.import_module(module)
            _tf[key] = loaded if attribute is None else getattr(loaded, attribute)
    except (ImportError, AttributeError) as e:
        _tf.clear()
        raise PeerNotInstalledError(NAME, str(e)) from None
    # Its INFO/WARNING lines (one per offload, "useless token") would flood a run.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return _tf


def check_config(config: SchedulerConfig) -> None:
    """Refuse, with a typed error, what transformers' continuous batching cannot be built
    as (under any ``--semantics``; the ``transformers`` profile refuses these too)."""
    if not config.enable_chunked_prefill:
        raise PeerUnsupportedError("transformers: prefills are always chunked")
    if config.preemption_mode is PreemptionMode.RESTART:
        raise PeerUnsupportedError("transformers: soft reset (recompute) or CPU offload (swap)")
    if config.policy != "lifo":
        raise PeerUnsupportedError(f"transformers: no policy {config.policy!r} (one FIFO order)")
    if config.enable_prefix_caching:
        raise PeerUnsupportedError("transformers: block sharing is not driven here")
    if config.block_size < 4:
        raise PeerUnsupportedError("transformers: page_size (block_size) must be >= 4")


class _OracleRunner:
    """The model runner: the driver's oracle answers every request that samples."""

    pad_inputs = False

    def __init__(self, inputs_and_outputs: Any) -> None:
        self.io = inputs_and_outputs
        self.next_token: TokenOracle | None = None
        self.sampled: list[tuple[str, int]] = []

    def maybe_pad_inputs(self, num_q: int, max_kv: int, fast: bool) -> tuple[int, int]:
        return num_q, max_kv

    def compute_batch(self, model: object, batch_data: object) -> None:
        # update_batch reads output_ids[0, j] for the j-th request that samples.
        assert self.next_token is not None
        self.sampled = []
        for future in self.io.requests_in_batch:
            if future.has_new_token:
                state = future.state
                token = self.next_token(tuple(state.initial_tokens + state.generated_tokens))
                self.io.output_ids[0, len(self.sampled)] = token
                self.sampled.append((state.request_id, token))


def _build(config: SchedulerConfig) -> tuple[Any, _OracleRunner]:
    t = _import()
    torch = t["torch"]
    model_config = t["LlamaConfig"](
        vocab_size=VOCAB_SIZE,
        hidden_size=_HEAD_DIM,
        intermediate_size=_HEAD_DIM,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=_HEAD_DIM,
    )
    model_config._attn_implementation = "sdpa"
    bytes_per_block = 2 * _HEAD_DIM * 4 * config.block_size  # one sector (a multiple of 128)
    swap = config.preemption_mode is PreemptionMode.SWAP and config.num_cpu_blocks > 0
    # Half a sector more than the pool, so the GiB figure cannot round below it.
    offload_gib = (config.num_cpu_blocks + 0.5) * bytes_per_block / 2**30 if swap else 0.0
    logits = t["ContinuousBatchingLogitsProcessorList"](
        logits_processor=t["LogitsProcessorList"](),
        per_request_processors=False,
        drop_unsupported_processors=True,
    )
    cb_config = t["resolve_continuous_batching_config"](
        config=model_config,
        cb_config=t["ContinuousBatchingConfig"](
            page_size=config.block_size,
            num_blocks=config.num_gpu_blocks,
            max_batch_tokens=config.max_num_batched_tokens,
            max_requests_per_batch=min(config.max_num_seqs, config.max_num_batched_tokens),
            allow_block_sharing=False,
            use_async_batching=False,
            use_cuda_graph=False,
            max_blocks_per_request=0,
            scheduler_type="fifo",
            max_memory_percent=0.9,
            cpu_offload_space=offload_gib,
            cpu_offload_space_safety_threshold=1.0,
        ),
        workload_hints=None,
        has_logit_processors=logits.do_processing,
    )
    helper = t["DistributedHelper"](None, None)
    device = torch.device("cpu")
    cache = t["PagedAttentionCache"](model_config, cb_config, device, helper, dtype=torch.float32)
    if cache.num_sectors != config.num_gpu_blocks or cache.num_blocks != config.num_gpu_blocks:
        raise PeerUnsupportedError(
            f"transformers: built {cache.num_sectors} sectors for {config.num_gpu_blocks} blocks"
        )
    scheduler = t["SCHEDULER_MAPPING"]["fifo"](
        cache=cache,
        safety_margin=cb_config.safety_margin,
        max_requests_per_batch=cb_config.max_requests_per_batch,
    )
    api = t["continuous_api"]
    offloading = t["offloading_manager"]
    pinned_torch = offloading.torch
    offloading.torch = _Unpinned(pinned_torch)  # the CPU pool, allocated unpinned
    try:
        processor = api.ContinuousBatchProcessor(
            cache=cache,
            config=model_config,
            generation_config=t["GenerationConfig"](),
            continuous_batching_config=cb_config,
            logit_processor=logits,
            input_queue=queue.Queue(),
            cancel_queue=queue.Queue(),
            output_router=api.OutputRouter(),
            background_thread_status=api.BackgroundThreadStatus(),
            model_device=device,
            model_dtype=torch.float32,
            scheduler=scheduler,
            distributed_helper=helper,
        )
    finally:
        offloading.torch = pinned_torch
    pool = processor.offloading_manager._cpu_pool
    num_cpu = 0 if pool is None else pool.num_sectors
    if num_cpu != (config.num_cpu_blocks if swap else 0):
        raise PeerUnsupportedError(
            f"transformers: a CPU pool of {num_cpu} sectors for {config.num_cpu_blocks} blocks"
        )
    runner = _OracleRunner(processor.inputs_and_outputs)
    processor.model_runner = runner
    return processor, runner


class _Unpinned:
    """``torch`` for ``OffloadingManager.__init__``, with ``empty`` ignoring ``pin_memory``."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def empty(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._torch.empty(*args, **kwargs)


def _free_blocks(pool: Any, allocators: Any) -> int:
    """A pool's free blocks: its free sectors plus the free blocks inside allocated ones."""
    if pool is None:
        return 0
    return int(pool.num_free_sectors) + sum(
        int(pool.count_free_blocks(a.index)) for a in allocators.values()
    )


class TransformersAdapter:
    name = NAME
    semantics = "transformers"

    def __init__(self, config: SchedulerConfig) -> None:
        check_config(config)
        self.config = config
        self.t = _import()
        self.processor, self.runner = _build(config)
        self.scheduler = self.processor.scheduler
        self.spec_requests: dict[str, Request] = {}
        self.next_arrival = 0
        self.num_steps = 0
        self._victims: list[Preemption] = []
        offload = self.processor.offloading_manager.offload_requests

        # Observe (never change) who each offload takes: the victims leave
        # active_requests and are requeued at the waiting tail, oldest first.
        def recording_offload() -> bool:
            before = list(self.scheduler.active_requests)
            offloaded = bool(offload())
            gone = [rid for rid in before if rid not in self.scheduler.active_requests]
            waiting = self.scheduler.waiting_requests
            for rid in sorted(gone, key=list(self.scheduler.waiting_requests_order).index)[::-1]:
                mode = (
                    PreemptionMode.SWAP
                    if waiting[rid].is_cpu_offloaded
                    else PreemptionMode.RECOMPUTE
                )
                self._victims.append(Preemption(request_id=rid, mode=mode))
            return offloaded

        self.processor.offloading_manager.offload_requests = recording_offload

    # --- requests -------------------------------------------------------------------

    def _live(self, request_id: str) -> bool:
        return request_id in self.spec_requests

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        # transformers checks nothing: an empty prompt fails in prepare_batch_tensors and
        # max_new_tokens 0 "generates a useless token"; refused as the spec refuses them.
        if not prompt_token_ids:
            raise EmptyPromptError("transformers: empty prompt")
        if params.max_tokens < 1:
            raise InvalidMaxTokensError("transformers: max_tokens below 1")
        if params.priority != 0:
            raise PeerUnsupportedError("transformers has no request priorities")
        if self._live(request_id):
            raise PeerUnsupportedError(f"transformers: {request_id} is already live")
        eos = None if params.ignore_eos else params.eos_token_id
        state = self.t["RequestState"](
            request_id=request_id,
            initial_tokens=list(prompt_token_ids),
            max_new_tokens=params.max_tokens,
            eos_token_id=eos,
        )
        self.processor.input_queue.put(state)
        self.processor._update_tp_group_state()  # the request joins the waiting tail
        self.spec_requests[request_id] = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            arrival=self.next_arrival,
        )
        self.next_arrival += 1

    def abort_request(self, request_id: str) -> None:
        if not self._live(request_id):
            raise UnknownRequestError(f"transformers: no live request {request_id!r}")
        processor = self.processor
        processor.cancel_queue.put(request_id)
        processor._update_tp_group_state()
        for state in processor.scheduler.clear_cancelled_requests():
            processor.offloading_manager.free_request_cpu_cache(state)
        del self.spec_requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.spec_requests)

    # --- a step ---------------------------------------------------------------------

    def step(self, next_token: TokenOracle) -> StepPlan:
        try:
            return self._step(next_token)
        except Exception as e:  # the peer failed: lockstep reports it as a divergence
            raise PeerFailure(f"transformers: {type(e).__name__}: {e}") from e

    def _step(self, next_token: TokenOracle) -> StepPlan:
        processor = self.processor
        offloaded_before = {
            rid for rid, s in self.scheduler.waiting_requests.items() if s.is_cpu_offloaded
        }
        self._victims = []
        self.runner.next_token = next_token
        self.runner.sampled = []
        has_batch = processor.prepare_next_batch()
        step = self.num_steps
        self.num_steps += 1
        if not has_batch:  # nothing to run (the manager's loop waits for new requests)
            return make_plan(step, scheduled=(), preempted=self._victims)
        scheduled = [
            (f.state.request_id, f.state.position_offset - f.query_length, f.query_length)
            for f in processor.inputs_and_outputs.requests_in_batch
        ]
        processor._generation_step(None)
        processor.update_batch()
        finished: list[FinishedRequest] = []
        outputs = processor.output_router.output_queue
        while not outputs.empty():
            output = outputs.get_nowait()
            request = self.spec_requests.pop(output.request_id)
            tokens = tuple(output.generated_tokens)
            params = request.params
            stop = not params.ignore_eos and tokens[-1:] == (params.eos_token_id,)
            finished.append(
                FinishedRequest(
                    request_id=output.request_id,
                    output_token_ids=tokens,
                    finish_reason=FinishReason.STOP if stop else FinishReason.LENGTH,
                    num_preemptions=0,
                )
            )
        return make_plan(
            step,
            scheduled=scheduled,
            preempted=self._victims,
            swapped_in=[rid for rid, _, _ in scheduled if rid in offloaded_before],
            sampled=self.runner.sampled,
            finished=finished,
        )

    # --- the spec's view ------------------------------------------------------------

    def _state_of(self, state: Any, *, queue: str) -> RequestState:
        request = self.spec_requests[state.request_id]
        prompt_len = len(request.prompt_token_ids)
        # A soft reset folded the outputs into initial_tokens (after the true prompt).
        tokens = (*state.initial_tokens, *state.generated_tokens)
        computed = state.position_offset if queue != "waiting" else 0
        return RequestState(
            request=request,
            output_token_ids=tuple(tokens[prompt_len:]),
            num_computed_tokens=computed,
            decoding=queue == "running"
            and tracks_decoding(self.config)
            and state.status == self.t["RequestStatus"].DECODING,
        )

    def observe(self) -> Observation:
        s = self.scheduler
        cache = self.processor.cache
        allocators = cache.cache_allocators
        live = self.spec_requests
        running = list(s.active_requests.values())
        waiting: list[Any] = []
        swapped: list[Any] = []
        for rid in s.waiting_requests_order:
            st = s.waiting_requests[rid]
            (swapped if st.is_cpu_offloaded else waiting).append(st)
        cpu_pool = self.processor.offloading_manager._cpu_pool
        state = SchedulerState(
            config=self.config,
            num_free_gpu_blocks=_free_blocks(cache.pool, allocators),
            num_free_cpu_blocks=self.config.num_cpu_blocks
            if cpu_pool is None
            else _free_blocks(cpu_pool, allocators),
            waiting=tuple(self._state_of(st, queue="waiting") for st in waiting),
            running=tuple(self._state_of(st, queue="running") for st in running),
            swapped=tuple(self._state_of(st, queue="swapped") for st in swapped),
            next_arrival=self.next_arrival,
            num_steps=self.num_steps,
            admission_frozen=bool(s.block_new_requests),
        )
        tables = next(iter(allocators.values())).block_table
        blocks = {rid: len(tables.get(rid, ())) for rid in live}
        return Observation(state=state, blocks=blocks, hidden=frozenset({Hidden.NUM_PREEMPTIONS}))
