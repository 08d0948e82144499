"""The engine options shared by ``run`` and ``conform``, with vLLM's names.

``add_engine_options`` declares them; ``scheduler_config`` turns them into a
``SchedulerConfig`` (a combination the config refuses is refused naming the flags,
``flag_names``). The model and the engine they name are built by
``kvsched.model_setup``: this module imports no torch, so that ``--help`` and a bad
option answer at once.

Adding an option: declare it in ``add_engine_options`` (a ``SchedulerConfig`` field
takes the flag ``--field-name`` and, through ``_DEFAULTS``, the config's own
default) and pass it on in ``scheduler_config``; ``FLAGS`` reads the fields, so a
refusal that names the new field names its flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from kvsched import argtypes
from kvsched.errors import CLIInputError
from spec.policies import POLICIES
from spec.profiles import profile_defaults
from spec.types import ConfigError, PreemptionMode, SchedulerConfig, Semantics

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float64", "bfloat16", "float16")
DEFAULT_NUM_GPU_BLOCKS = 64  # SchedulerConfig has no default: it must be sized

# The other defaults are SchedulerConfig's own, so the CLI and the API cannot drift apart.
_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(SchedulerConfig)
    if f.init and f.default is not dataclasses.MISSING
}


def _count_option(
    group: argparse._ArgumentGroup, flag: str, what: str, default: int | None = None
) -> None:
    """A positive count of ``SchedulerConfig`` (the field named by ``flag``), defaulting
    to the config's own default unless ``default`` is given."""
    if default is None:
        default = _DEFAULTS[flag.removeprefix("--").replace("-", "_")]
    group.add_argument(
        flag,
        type=argtypes.positive_int,
        default=default,
        metavar="N",
        help=f"{what} (default {default})",
    )


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine options (vLLM's names)")
    _count_option(g, "--num-gpu-blocks", "KV-cache blocks on the device", DEFAULT_NUM_GPU_BLOCKS)
    _count_option(g, "--block-size", "tokens per KV block")
    _count_option(g, "--max-num-batched-tokens", "token budget of one step")
    _count_option(g, "--max-num-seqs", "most requests running at once")
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prefills across steps (default on; off under --semantics nano-vllm "
        "and vllm-v0)",
    )
    g.add_argument(
        "--preemption-mode",
        choices=[m.value for m in PreemptionMode],
        default=PreemptionMode(_DEFAULTS["preemption_mode"]).value,
        help="how a preempted request comes back (default recompute)",
    )
    g.add_argument(
        "--num-cpu-blocks",
        type=argtypes.non_negative_int,
        default=_DEFAULTS["num_cpu_blocks"],
        metavar="N",
        help="CPU swap pool in blocks, for --preemption-mode swap (default 0: "
        "every swap falls back to recompute)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV blocks of equal token prefixes between requests (default off, "
        "on under --semantics nano-vllm, whose engine always caches; not with "
        "--preemption-mode swap)",
    )
    g.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=_DEFAULTS["policy"],
        help=f"scheduling policy (default {_DEFAULTS['policy']})",
    )
    g.add_argument(
        "--semantics",
        choices=[s.value for s in Semantics],
        default=None,
        help="the spec's rules profile (docs/semantics.md, 'Semantics profiles'); default "
        "kvsched, or for conform the --engine's own (vllm: vllm-v1, nano-vllm: nano-vllm, "
        "vllm-v0: vllm-v0)",
    )
    g.add_argument(
        "--max-model-len",
        type=argtypes.positive_int,
        default=None,
        metavar="N",
        help="vllm-v1 and vllm-v0 only: the longest prompt + outputs (default: the whole "
        "GPU cache, vllm-v0's above its watermark, and with chunked prefill off at most "
        "--max-num-batched-tokens)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=argtypes.non_negative_int,
        default=_DEFAULTS["long_prefill_token_threshold"],
        metavar="N",
        help="vllm-v1 only: with more than one request running or waiting, cut every "
        "prefill chunk to N tokens (default 0: no cut; at most --max-model-len)",
    )
    g.add_argument(
        "--long-prefill-token-threshold-adaptive",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS["long_prefill_token_threshold_adaptive"],
        help="vllm-v1 only: raise that cut to --max-num-batched-tokens // the requests "
        "running or waiting, when larger (default off)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vllm-v1 only: schedule each step before the previous step's outputs are "
        "applied, as vLLM's AsyncScheduler (default: on for conform --engine vllm, as in "
        "vLLM 0.32; off elsewhere)",
    )
    g.add_argument(
        "--speculative-config",
        type=argtypes.speculative_config,
        default=None,
        metavar="JSON",
        help="vllm-v1 only: n-gram speculative decoding with vLLM's keys, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}\' '
        "(async scheduling then defaults off, as in vLLM)",
    )
    g.add_argument("--device", choices=DEVICES, default="auto", help="(default auto)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="(default float32)")
    g.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a local Hugging Face Llama checkpoint (default: the built-in tiny seeded model)",
    )
    g.add_argument(
        "--seed",
        type=argtypes.torch_seed,
        default=0,
        help="seed of the built-in tiny model's weights (default 0)",
    )
    add_threads_option(g)


def add_threads_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--threads",
        type=argtypes.thread_count,
        default=None,
        metavar="N",
        help="torch intra-op threads (default: 1 for models under 100M parameters or on "
        "an accelerator, else one per idle CPU; OMP_NUM_THREADS, if set, is kept)",
    )


def flag(field: str) -> str:
    """The option of a ``SchedulerConfig`` field: ``block_size`` -> ``--block-size``."""
    return "--" + field.replace("_", "-")


#: The option of every ``SchedulerConfig`` field, by the field's name
#: (``num_speculative_tokens`` is a key of ``--speculative-config``'s).
FLAGS = {f.name: flag(f.name) for f in dataclasses.fields(SchedulerConfig) if f.init} | {
    "num_speculative_tokens": "--speculative-config"
}

# A field named in a refusal: any word with an underscore; ``policy`` and ``semantics``
# (plain words too) only before the value they are given (``policy lifo``, ``policy
# 'x'``). ``field=False``/``=True`` is a boolean option's negative or positive flag.
_FIELD = re.compile(
    r"\b(?P<field>"
    + "|".join(sorted((f for f in FLAGS if "_" in f), key=len, reverse=True))
    + r")\b(?P<value>=False|=True)?|\b(?P<word>policy|semantics)\b(?= ['\"]?[a-z])"
)


def flag_names(message: str) -> str:
    """``message`` with each ``SchedulerConfig`` field it names written as its flag.

    >>> flag_names("max_num_batched_tokens (8) must be >= max_num_seqs (16)")
    '--max-num-batched-tokens (8) must be >= --max-num-seqs (16)'
    >>> flag_names("no chunked prefill (use enable_chunked_prefill=False)")
    'no chunked prefill (use --no-enable-chunked-prefill)'
    """

    def option(m: re.Match[str]) -> str:
        if m["word"] is not None:
            return FLAGS[m["word"]]
        name = FLAGS[m["field"]]
        return name.replace("--", "--no-", 1) if m["value"] == "=False" else name

    return _FIELD.sub(option, message)


def scheduler_config(
    args: argparse.Namespace,
    default_semantics: Semantics = Semantics.KVSCHED,
    *,
    async_by_default: bool = False,
) -> SchedulerConfig:
    """The config the options name; a combination the config (or a profile) refuses is
    a ``CLIInputError`` that names the flags (``flag_names``). ``async_by_default``:
    async scheduling is on under vllm-v1 unless ``--no-async-scheduling`` (vLLM's own
    default, for ``conform --engine vllm``; off with ``--speculative-config``, which
    gives ``num_speculative_tokens``)."""
    semantics = default_semantics if args.semantics is None else Semantics(args.semantics)
    speculative = args.speculative_config
    async_scheduling = args.async_scheduling
    if async_scheduling is None:  # vLLM turns it off for the n-gram drafter
        async_scheduling = (
            async_by_default and semantics is Semantics.VLLM_V1 and speculative is None
        )
    # What the profile implies (nano-vllm: no chunked prefill, caching on;
    # vllm-v0: no chunked prefill), unless given.
    implied = profile_defaults(semantics)
    if args.enable_chunked_prefill is not None:
        implied["enable_chunked_prefill"] = args.enable_chunked_prefill
    if args.enable_prefix_caching is not None:
        implied["enable_prefix_caching"] = args.enable_prefix_caching
    try:
        return SchedulerConfig(
            num_gpu_blocks=args.num_gpu_blocks,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            preemption_mode=PreemptionMode(args.preemption_mode),
            num_cpu_blocks=args.num_cpu_blocks,
            policy=args.policy,
            semantics=semantics,
            max_model_len=args.max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
            async_scheduling=async_scheduling,
            num_speculative_tokens=0 if speculative is None else speculative.num_speculative_tokens,
            **implied,
        )
    except ConfigError as e:
        raise CLIInputError(flag_names(str(e))) from None
