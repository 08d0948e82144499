"""What the rules draw: configurations, requests (good and bad) and faults."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Final

from hypothesis import strategies as st

import spec
from spec.profiles import model_len
from spec.types import PreemptionMode, SchedulerConfig, Semantics, watermark_blocks

BLOCK_SIZES: Final = (1, 2, 4, 16)
POLICY_NAMES: Final = tuple(sorted(spec.POLICIES))
#: kvsched three times: the profiles share the example budget, and kvsched has the most
#: paths (every mode and policy); each peer profile gets a sixth of the examples.
SEMANTICS: Final = (
    Semantics.KVSCHED,
    Semantics.VLLM_V1,
    Semantics.KVSCHED,
    Semantics.NANO_VLLM,
    Semantics.KVSCHED,
    Semantics.VLLM_V0,
)
#: Every profile but vllm-v0: the ones that model a prefix cache (vllm-v0's configs
#: refuse caching), and the engine subject's (tests/stateful/subjects/engine.py).
WITHOUT_VLLM_V0: Final = tuple(s for s in SEMANTICS if s is not Semantics.VLLM_V0)


def printable_config(**fields: object) -> st.SearchStrategy[SchedulerConfig]:
    """``SchedulerConfig(**fields)``, built through ``st.builds`` of constants (which draw
    nothing, so the examples are unchanged): a failing run then prints the config as the
    call that makes it, an enum as ``PreemptionMode('swap')``, a program that can be
    pasted into a test."""
    args = {
        name: st.builds(type(value), st.just(value.value))
        if isinstance(value, enum.Enum)
        else st.just(value)
        for name, value in fields.items()
    }
    return st.builds(SchedulerConfig, **args)


@st.composite
def engine_configs(
    draw: st.DrawFn,
    semantics_choices: tuple[Semantics, ...] = SEMANTICS,
    *,
    prefix_caching: bool = False,
    async_scheduling: bool = False,
    speculative: bool = False,
) -> SchedulerConfig:
    """Small pools so preemption really happens; every mode, policy and block size.

    ``semantics_choices`` narrows the profiles drawn (a machine that tests kvsched's
    own policies draws kvsched alone: the peer profiles refuse them).

    The GPU pool holds 8-64 tokens (at least two blocks); swap mode (drawn half the
    time) gets a CPU pool from none (every swap falls back to recompute) through too
    small to twice the GPU pool. With ``prefix_caching`` the config turns it on (every
    profile may) and the mode is recompute or restart (caching refuses swap); the other
    draws are the same. ``async_scheduling``: vllm-v1 configs draw it on half the time
    (``profile_configs``); ``speculative``: half the synchronous vllm-v1 ones decode
    speculatively.
    """
    # One choice draws nothing (the kvsched-only machines keep their examples).
    semantics = (
        semantics_choices[0]
        if len(semantics_choices) == 1
        else draw(st.sampled_from(semantics_choices))
    )
    if semantics is not Semantics.KVSCHED:
        return draw(
            profile_configs(
                semantics,
                prefix_caching=prefix_caching,
                async_scheduling=async_scheduling and semantics is Semantics.VLLM_V1,
                speculative=speculative and semantics is Semantics.VLLM_V1,
            )
        )
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    gpu_tokens = draw(st.integers(8, 64))
    num_gpu_blocks = max(2, gpu_tokens // block_size)  # 16 x 1 block: no two requests fit
    # Swap mode drawn twice as often: it has the most paths (swap-out, fallback, swap-in).
    modes = (
        (PreemptionMode.RECOMPUTE, PreemptionMode.RESTART)
        if prefix_caching
        else (*PreemptionMode, PreemptionMode.SWAP)
    )
    mode = draw(st.sampled_from(modes))
    if mode is PreemptionMode.SWAP:
        num_cpu_blocks = draw(st.integers(0, 2 * num_gpu_blocks))
    else:
        num_cpu_blocks = draw(st.sampled_from((0, num_gpu_blocks)))  # unused: must not matter
    max_num_batched_tokens = draw(st.integers(1, 64))
    # 1 (no two requests run together: no preemption) last, as the rare case.
    max_num_seqs = draw(st.sampled_from((2, 3, 4, 6, 8, 1)))
    enable_chunked_prefill = draw(st.booleans())
    policy = draw(st.sampled_from(POLICY_NAMES))
    return draw(
        printable_config(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=mode,
            num_cpu_blocks=num_cpu_blocks,
            policy=policy,
            enable_prefix_caching=prefix_caching,
        )
    )


@st.composite
def profile_configs(
    draw: st.DrawFn,
    semantics: Semantics,
    *,
    prefix_caching: bool = False,
    async_scheduling: bool = False,
    speculative: bool = False,
    only_speculative: bool = False,
) -> SchedulerConfig:
    """A config a peer profile accepts (its constraints: ``SchedulerConfig.__post_init__``),
    with ``enable_prefix_caching`` set to ``prefix_caching``; with ``async_scheduling``
    (vllm-v1 only: the vLLM machines) async scheduling on half the time, drawn last;
    with ``speculative`` (vllm-v1, synchronous configs) half of the others decode
    speculatively, 1-4 drafts a step (at most the budget and the long-prefill threshold
    less one), drawn after; with ``only_speculative`` (vllm-v1) every config does but
    one with a budget of one token, none async (a machine of its own for drafts).

    vllm-v1, nano-vllm: recompute only, no CPU pool. vllm-v1: ``lifo`` or ``priority``,
    ``max_num_batched_tokens >= max_num_seqs``, ``max_model_len`` drawn or the default
    (the whole cache; with chunked prefill off at most the budget). nano-vllm: ``lifo``,
    chunked prefill off, block size >= 2; with ``prefix_caching`` (nano-vllm only) half
    the budgets are the whole pool, so that prompts longer than a block, which may hit,
    fit (without chunked prefill a prompt must fit the budget). vllm-v0: ``vllm_v0_configs``.
    """
    if semantics is Semantics.VLLM_V0:
        return draw(vllm_v0_configs())
    nano = semantics is Semantics.NANO_VLLM
    block_size = draw(st.sampled_from(BLOCK_SIZES[1:] if nano else BLOCK_SIZES))
    num_gpu_blocks = max(2, draw(st.integers(8, 64)) // block_size)
    max_num_seqs = draw(st.sampled_from((2, 3, 4, 6, 8, 1)))
    # nano-vllm: half the time a budget below max_num_seqs (and a few seats), where a
    # decode step can run more requests than the budget (decode-unbudgeted).
    if nano and draw(st.booleans()):
        max_num_seqs = draw(st.sampled_from((4, 6, 8)))
        budgets = st.integers(1, max_num_seqs - 1)
    else:
        budgets = st.integers(1, 64) if nano else st.integers(max_num_seqs, 64)
    max_num_batched_tokens = draw(budgets)
    if prefix_caching:
        pool = num_gpu_blocks * block_size
        max_num_batched_tokens = draw(st.sampled_from((max_num_batched_tokens, pool)))
    chunked = False if nano else draw(st.booleans())
    policy = "lifo" if nano else draw(st.sampled_from(("lifo", "priority")))
    max_model_len: int | None = None
    top = num_gpu_blocks * block_size
    if not nano:
        if not chunked:
            top = min(top, max_num_batched_tokens)
        if top < 2:
            chunked, top = True, num_gpu_blocks * block_size  # a 1-token model is no model
        if draw(st.booleans()):
            max_model_len = draw(st.integers(2, top))
    # vllm-v1/long-prefill-cap on a third of the configs, small enough to cut prompts.
    threshold = 0
    adaptive = False
    if semantics is Semantics.VLLM_V1 and draw(st.integers(0, 2)) == 2:
        threshold = draw(st.integers(1, min(16, max_model_len or top)))
        adaptive = draw(st.booleans())
    asynchronous = async_scheduling and draw(st.booleans())
    drafts = 0
    if only_speculative or (speculative and not asynchronous and draw(st.booleans())):
        drafts = draw(st.integers(1, 4))
        # A padded decode (1 + K tokens) must fit the budget (vLLM never drains if it
        # cannot) and must not be cut by the threshold: SchedulerConfig refuses both.
        drafts = min(drafts, max_num_batched_tokens - 1)
        if threshold:
            drafts = min(drafts, threshold - 1)
    return draw(
        printable_config(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
            policy=policy,
            enable_prefix_caching=prefix_caching,
            semantics=semantics,
            max_model_len=max_model_len,
            long_prefill_token_threshold=threshold,
            long_prefill_token_threshold_adaptive=adaptive,
            async_scheduling=asynchronous,
            num_speculative_tokens=drafts,
        )
    )


@st.composite
def vllm_v0_configs(draw: st.DrawFn) -> SchedulerConfig:
    """A config the vllm-v0 profile accepts: ``lifo``, chunked prefill off, no caching,
    ``max_num_batched_tokens >= max_num_seqs``; recompute or (half the time) swap with a
    CPU pool from none to twice the GPU pool; ``max_model_len`` drawn or the default.

    Half the pools have 100-120 blocks of 1-2 tokens, where vllm-v0/watermark
    keeps one block free (``int(0.01 * num_gpu_blocks)``, 0 below 100 blocks); their
    budgets are the whole pool, so that requests of the pool's size fit unchunked.
    """
    if draw(st.booleans()):
        block_size = draw(st.sampled_from((1, 2)))
        num_gpu_blocks = draw(st.integers(100, 120))
        max_num_batched_tokens = num_gpu_blocks * block_size
    else:
        block_size = draw(st.sampled_from(BLOCK_SIZES))
        num_gpu_blocks = max(2, draw(st.integers(8, 64)) // block_size)
        max_num_batched_tokens = -1
    max_num_seqs = draw(st.sampled_from((2, 3, 4, 6, 8, 1)))
    if max_num_batched_tokens < 0:
        max_num_batched_tokens = draw(st.integers(max_num_seqs, 64))
    mode = draw(st.sampled_from((PreemptionMode.RECOMPUTE, PreemptionMode.SWAP)))
    num_cpu_blocks = draw(st.integers(0, 2 * num_gpu_blocks)) if mode is PreemptionMode.SWAP else 0
    top = min(
        (num_gpu_blocks - watermark_blocks(num_gpu_blocks)) * block_size,
        max_num_batched_tokens,
    )
    max_model_len = draw(st.none() | st.integers(1, top))
    return draw(
        printable_config(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=False,
            preemption_mode=mode,
            num_cpu_blocks=num_cpu_blocks,
            semantics=Semantics.VLLM_V0,
            max_model_len=max_model_len,
        )
    )


@dataclass(frozen=True)
class NewRequest:
    """A request to add, in sizes; the machine derives its tokens from ``salt``.

    Unless ``oversize``, the sizes are clamped so the request fits the configuration
    (R4), so most requests are accepted and put the pools under pressure. ``eos``
    picks the EOS token among the request's own solo outputs, so EOS is really hit.
    """

    prompt_len: int
    max_tokens: int
    oversize: bool = False
    salt: int = 0
    eos: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    temperature: float = 0.0


#: temperature 0.8 draws with the request's seed (the engine's sampler is a function of
#: seed, output index and logits, so a solo run reproduces it; the toy ignores it).
NEW_REQUESTS: Final = st.builds(
    NewRequest,
    prompt_len=st.integers(1, 8) | st.integers(1, 48),
    max_tokens=st.integers(1, 24),
    oversize=st.sampled_from((False, False, False, True)),
    salt=st.integers(0, 2**16),
    eos=st.none() | st.integers(0, 24),
    ignore_eos=st.sampled_from((False, False, False, True)),
    priority=st.integers(0, 3),
    temperature=st.sampled_from((0.0, 0.0, 0.8)),
)


def fit_sizes(config: SchedulerConfig, req: NewRequest) -> tuple[int, int]:
    """``(prompt_len, max_tokens)`` of a drawn request, clamped so that R4 accepts it
    under ``config`` unless ``oversize``."""
    prompt_len, max_tokens = req.prompt_len, req.max_tokens
    if req.oversize:
        return prompt_len, max_tokens
    prompt_cap, cap = r4_caps(config)
    if prompt_cap is not None:
        prompt_len = min(prompt_len, prompt_cap)
    if cap is None:
        return prompt_len, max_tokens
    if prompt_len + max_tokens - 1 > cap:
        # Scale both down, keeping the output share: decodes that grow past the pool
        # are what forces preemptions (a pool-sized prompt with one output never grows).
        prompt_len = max(1, prompt_len * cap // (prompt_len + max_tokens))
        max_tokens = min(max_tokens, cap - prompt_len + 1)
    return prompt_len, max_tokens


def r4_caps(config: SchedulerConfig) -> tuple[int | None, int | None]:
    """What R4 accepts under ``config``: the longest prompt and the longest
    ``prompt + max_tokens - 1``, each None where R4 sets no bound of its own."""
    length = model_len(config)
    if length is not None:
        # vllm-v1/max-model-len: the prompt must be shorter (vllm-v0's: not longer);
        # max_tokens is not capped, so requests also stop at max_model_len.
        return length - (config.semantics is not Semantics.VLLM_V0), None
    pool = config.num_gpu_blocks * config.block_size
    if config.enable_chunked_prefill:
        return None, pool
    if config.preemption_mode is PreemptionMode.RESTART:
        return config.max_num_batched_tokens, pool
    return None, min(pool, config.max_num_batched_tokens)


#: The load a fresh engine starts with.
INITIAL_REQUESTS: Final = st.lists(NEW_REQUESTS, min_size=1, max_size=8)


@dataclass(frozen=True)
class BadRequest:
    """A request with one or more R4 defects; the first in R4's order must be raised."""

    empty: bool = False
    zero_max_tokens: bool = False
    out_of_vocab: bool = False
    duplicate: bool = False
    too_large: bool = False
    oov_high: bool = False  # the bad token is vocab_size (else -1)
    salt: int = 0


def _has_defect(bad: BadRequest) -> bool:
    return bad.empty or bad.zero_max_tokens or bad.out_of_vocab or bad.duplicate or bad.too_large


BAD_REQUESTS: Final = st.builds(
    BadRequest,
    empty=st.booleans(),
    zero_max_tokens=st.booleans(),
    out_of_vocab=st.booleans(),
    duplicate=st.booleans(),
    too_large=st.booleans(),
    oov_high=st.booleans(),
    salt=st.integers(0, 2**16),
).filter(_has_defect)


#: Faults a rule can arm: the next forward raises before running, or after writing K/V
#: into the cache; the next swap-out / swap-in copy raises.
FAULT_KINDS: Final = ("forward", "forward after KV write", "swap-out copy", "swap-in copy")


#: The example's system prompt's length (tests/stateful/machine.py, the shared-prefix rules).
SYSTEM_PROMPT_LEN: Final = 64


def system_prompt(config: SchedulerConfig, vocab: int) -> tuple[int, ...]:
    """The example's one system prompt, from its config (so a shrunk example keeps it)."""
    rng = random.Random(config.num_gpu_blocks * 131 + config.max_num_batched_tokens)
    return tuple(rng.randrange(vocab) for _ in range(SYSTEM_PROMPT_LEN))


def shared_prompts(
    system_prompt: tuple[int, ...],
    length: int,
    block_size: int,
    *,
    prefix_len: int,
    exact_blocks: bool,
    copies: int,
    salt: int,
    vocab: int,
) -> list[tuple[int, ...]]:
    """``copies`` prompts of ``length`` tokens: ``system_prompt``'s first ``prefix_len``
    tokens, then each copy's own suffix (from ``salt``); or, ``exact_blocks``, only the
    system prompt cut at a whole number of blocks (the same prompt every copy)."""
    prompts = []
    for copy in range(copies):
        if exact_blocks and length >= block_size:
            prompt = system_prompt[: length // block_size * block_size]
        else:
            shared = min(prefix_len, length)
            own = random.Random(salt + copy).choices(range(vocab), k=length - shared)
            prompt = (*system_prompt[:shared], *own)
        prompts.append(tuple(prompt))
    return prompts
