"""The model and the engine the engine options name (this module imports torch).

``load_model`` builds the model (a local Hugging Face Llama checkpoint, or the
built-in tiny seeded model); ``check_kv_fits`` refuses KV pools larger than the
memory free, ``warn_large_pool`` warns about one far larger than the workload can
use; ``make_engine`` builds an ``LLMEngine`` over a shared model, and an allocation that
fails anyway (a container whose ``MemAvailable`` is the host's) is a typed
``KVAllocationError`` with the size asked for.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError

from impl import LLMEngine
from impl.ngram_proposer import NgramProposer
from kvsched.errors import CLIInputError
from kvsched.progress import warn
from kvsched.workload import WorkloadRequest
from model import (
    CheckpointError,
    LlamaForCausalLM,
    build_tiny_model,
    load_hf_checkpoint,
    resolve_device,
    resolve_dtype,
)
from spec.kv import cdiv
from spec.types import SchedulerConfig

GIB = 1024**3
#: A KV pool this large is worth a warning when the workload cannot use half of it.
LARGE_POOL_BYTES = GIB
# A cgroup "limit" this large means none (cgroup v1 writes 2**63 rounded to a page).
_NO_LIMIT = 2**60


class KVAllocationError(CLIInputError):
    """The KV pools passed the memory check but could not be allocated."""


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


def kv_block_bytes(model: LlamaForCausalLM, block_size: int) -> int:
    """Bytes of one KV block: K and V, every layer, ``block_size`` token slots."""
    c = model.config
    element = torch.finfo(model.dtype).bits // 8
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * element


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_free_bytes() -> int | None:
    """What the process's memory cgroup has left (limit less usage), if it has a limit.

    cgroup v2 (``memory.max``) or v1 (``memory.limit_in_bytes``) as mounted in the
    container; ``MemAvailable`` alone reports the host's memory there.
    """
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit = _read_int(limit_file)  # "max" (no limit) reads as None
        usage = _read_int(usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            return max(0, limit - usage)
    return None


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device``; None if unknown.

    The host's: ``MemAvailable``, or less if the memory cgroup has less left.
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cgroup = cgroup_free_bytes()
    if cgroup is None or available is None:
        return available if cgroup is None else cgroup
    return min(available, cgroup)


def kv_blocks_that_fit(model: LlamaForCausalLM, block_size: int) -> int | None:
    """How many KV blocks the model's device has memory for (None if unknown)."""
    free = free_memory_bytes(model.device)
    return None if free is None else free // kv_block_bytes(model, block_size)


def _pools(config: SchedulerConfig, model: LlamaForCausalLM) -> list[tuple[str, int, str]]:
    """``(option, blocks, device type)`` of each KV pool the config asks for."""
    pools = [("--num-gpu-blocks", config.num_gpu_blocks, model.device.type)]
    if config.num_cpu_blocks:
        pools.append(("--num-cpu-blocks", config.num_cpu_blocks, "cpu"))
    return pools


def _pool_text(
    config: SchedulerConfig, model: LlamaForCausalLM, place: str | None = None
) -> tuple[str, int]:
    """``"--num-gpu-blocks N + ..."`` of the pools on ``place`` (None: all), their bytes."""
    block = kv_block_bytes(model, config.block_size)
    here = [(o, n) for o, n, where in _pools(config, model) if place in (None, where)]
    return " + ".join(f"{option} {n}" for option, n in here), sum(n for _, n in here) * block


def workload_blocks(workload: Sequence[WorkloadRequest], block_size: int) -> int:
    """The most GPU blocks ``workload`` could ever hold: every request's whole life."""
    return sum(cdiv(len(r.prompt) + max(r.params.max_tokens, 0), block_size) for r in workload)


def check_kv_fits(config: SchedulerConfig, model: LlamaForCausalLM) -> None:
    """Refuse KV pools larger than the free memory, before allocating them.

    Allocating too much anyway fails late with an untyped error or, on the host, first
    drives the machine into swap.
    """
    for place in dict.fromkeys(where for _, _, where in _pools(config, model)):
        options, size = _pool_text(config, model, place)
        free = free_memory_bytes(torch.device(place))
        if free is not None and size > free:
            blocks = size // kv_block_bytes(model, config.block_size)
            raise CLIInputError(
                f"{options}: a KV cache of {blocks} blocks of {config.block_size} tokens "
                f"needs {size / GIB:.1f} GiB, more than the {free / GIB:.1f} GiB "
                f"free on {place}"
            )


def warn_large_pool(
    config: SchedulerConfig, model: LlamaForCausalLM, workload: Sequence[WorkloadRequest]
) -> None:
    """Warn about a GPU pool of ``LARGE_POOL_BYTES`` or more that ``workload`` cannot
    fill half of (once it is allocated: allocating it took that memory and time)."""
    gpu = config.num_gpu_blocks * kv_block_bytes(model, config.block_size)
    usable = workload_blocks(workload, config.block_size)
    if gpu >= LARGE_POOL_BYTES and 2 * usable < config.num_gpu_blocks:
        warn(
            f"--num-gpu-blocks {config.num_gpu_blocks}: the KV cache takes {gpu:,} bytes "
            f"({gpu / GIB:.1f} GiB) on {model.device.type}; this workload can use at most "
            f"{usable:,} block{'' if usable == 1 else 's'}"
        )


def _allocation_failed(e: BaseException) -> bool:
    """torch's out-of-memory errors: CUDA's type, the CPU allocator's message."""
    return isinstance(e, MemoryError | torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )


def make_engine(
    config: SchedulerConfig, args: argparse.Namespace, model: LlamaForCausalLM
) -> LLMEngine:
    """An engine over ``model``; ``KVAllocationError`` if its KV pools cannot be allocated."""
    lookup = args.speculative_config  # the n-gram drafter's settings, or None
    drafter = (
        None
        if lookup is None
        else NgramProposer(
            num_speculative_tokens=lookup.num_speculative_tokens,
            prompt_lookup_min=lookup.prompt_lookup_min,
            prompt_lookup_max=lookup.prompt_lookup_max,
            max_model_len=config.max_model_len,
        )
    )
    try:
        return LLMEngine(
            config,
            model=model,
            device=args.device,
            dtype=args.dtype,
            seed=args.seed,
            threads=args.threads,
            drafter=drafter,
        )
    except (MemoryError, RuntimeError) as e:
        if not _allocation_failed(e):
            raise
        options, size = _pool_text(config, model)
        free = free_memory_bytes(model.device)
        seen = "unknown" if free is None else f"{free:,} bytes"
        raise KVAllocationError(
            f"{options}: allocating the KV cache ({size:,} bytes) failed: "
            f"{_first_line(e)}; ask for fewer blocks (--num-gpu-blocks, --block-size). "
            f"The memory check saw {seen} free: in a container MemAvailable may be the host's"
        ) from None


def _first_line(e: BaseException) -> str:
    """The error's first line, without the ``[enforce fail at FILE:LINE] ...`` of c10."""
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return re.sub(r"^\[enforce fail at [^\]]*\] err == 0\. ", "", text)
