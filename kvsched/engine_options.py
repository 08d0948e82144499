"""The engine options shared by ``run`` and ``conform``, with vLLM's names.

``add_engine_options`` declares them; ``scheduler_config`` turns them into a
``SchedulerConfig``; ``load_model`` builds the model they name (a local Hugging Face
Llama checkpoint, or the built-in tiny seeded model); ``make_engine`` builds an
``LLMEngine`` over a shared model.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from safetensors import SafetensorError

from impl import LLMEngine
from impl.policies import POLICIES
from kvsched import argtypes
from kvsched.errors import CLIInputError
from model import (
    CheckpointError,
    LlamaForCausalLM,
    build_tiny_model,
    load_hf_checkpoint,
    resolve_device,
    resolve_dtype,
)
from spec.profiles import profile_defaults
from spec.types import PreemptionMode, SchedulerConfig, Semantics

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
        help="split long prefills across steps (default on; off under --semantics nano-vllm)",
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
        "kvsched, or for conform the --engine's own (vllm: vllm-v1, nano-vllm: nano-vllm)",
    )
    g.add_argument(
        "--max-model-len",
        type=argtypes.positive_int,
        default=None,
        metavar="N",
        help="vllm-v1 only: the longest prompt + outputs (default: the whole GPU cache, "
        "and with chunked prefill off at most --max-num-batched-tokens)",
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


def scheduler_config(
    args: argparse.Namespace, default_semantics: Semantics = Semantics.KVSCHED
) -> SchedulerConfig:
    """The config the options name; ``ConfigError`` for a combination a profile forbids."""
    semantics = default_semantics if args.semantics is None else Semantics(args.semantics)
    # What the profile implies (nano-vllm: no chunked prefill, caching on), unless given.
    implied = profile_defaults(semantics)
    if args.enable_chunked_prefill is not None:
        implied["enable_chunked_prefill"] = args.enable_chunked_prefill
    if args.enable_prefix_caching is not None:
        implied["enable_prefix_caching"] = args.enable_prefix_caching
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
        **implied,
    )


def device_of(args: argparse.Namespace) -> torch.device:
    """``--device``, resolved; asking for CUDA where there is none is bad input."""
    try:
        return resolve_device(args.device)
    except ValueError as e:  # resolve_device's only failure: an unusable device name
        raise CLIInputError(f"argument --device: {e}") from None


def load_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """The ``--model`` checkpoint, or the built-in tiny model seeded with ``--seed``."""
    device = device_of(args)
    dtype = resolve_dtype(args.dtype)
    if args.model is None:
        return build_tiny_model(seed=args.seed, device=device, dtype=dtype)
    try:
        return load_hf_checkpoint(args.model, device=device, dtype=dtype)
    except CheckpointError as e:
        raise CLIInputError(f"--model {args.model}: {e}") from None
    except SafetensorError as e:  # a weights file that is not safetensors at all
        raise CLIInputError(f"--model {args.model}: unreadable weights: {e}") from None


GIB = 1024**3


def kv_block_bytes(model: LlamaForCausalLM, block_size: int) -> int:
    """Bytes of one KV block: K and V, every layer, ``block_size`` token slots."""
    c = model.config
    element = torch.finfo(model.dtype).bits // 8
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * element


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device`` (host: MemAvailable); None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_blocks_that_fit(model: LlamaForCausalLM, block_size: int) -> int | None:
    """How many KV blocks the model's device has memory for (None if unknown)."""
    free = free_memory_bytes(model.device)
    return None if free is None else free // kv_block_bytes(model, block_size)


def check_kv_fits(config: SchedulerConfig, model: LlamaForCausalLM) -> None:
    """Refuse KV pools larger than the free memory, before allocating them.

    Allocating them anyway fails late with an untyped error or, on the host, first
    drives the machine into swap.
    """
    block = kv_block_bytes(model, config.block_size)
    pools = [("--num-gpu-blocks", config.num_gpu_blocks, model.device.type)]
    if config.num_cpu_blocks:
        pools.append(("--num-cpu-blocks", config.num_cpu_blocks, "cpu"))
    for place in {p[2] for p in pools}:
        here = [(option, n) for option, n, where in pools if where == place]
        blocks = sum(n for _, n in here)
        free = free_memory_bytes(torch.device(place))
        if free is not None and blocks * block > free:
            options = " + ".join(f"{option} {n}" for option, n in here)
            raise CLIInputError(
                f"{options}: a KV cache of {blocks} blocks of {config.block_size} tokens "
                f"needs {blocks * block / GIB:.1f} GiB, more than the {free / GIB:.1f} GiB "
                f"free on {place}"
            )


def make_engine(
    config: SchedulerConfig, args: argparse.Namespace, model: LlamaForCausalLM
) -> LLMEngine:
    return LLMEngine(
        config,
        model=model,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        threads=args.threads,
    )
