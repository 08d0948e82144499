"""Prefix caching on and off, side by side, on a shared-prefix workload.

``--requests`` requests, each a system prompt of ``--shared-prefix`` tokens (one of
``--system-prompts`` distinct ones) followed by its own ``--suffix`` tokens, with
``--max-tokens`` outputs (EOS ignored), all arriving at once: ``kvsched workload
--shared-prefix`` makes the same shape. The same workload runs with
``enable_prefix_caching`` off and on, alternating, in one process; reported per
setting (median of ``--repeats`` runs for times):

* ``steps`` and ``forward tokens`` (tokens run through the model, hits excluded);
* ``hit rate``: hit tokens / tokens looked up at admission;
* ``wall s`` of the whole ``generate`` call and ``tokens/s`` (sampled tokens / wall);
* ``speedup``: wall off / wall on, measured in the same run.

The outputs of the two settings must be equal (float64 by default: a hit reuses K/V
another request wrote, and the model is batch-invariant to the bit); the benchmark
stops with an error otherwise.

Usage: ``python -m bench.prefix_caching [--quick] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bench._common import (
    add_common_args,
    command_line,
    markdown_table,
    median,
    print_header,
    run_engine,
    setup_torch,
)
from impl import LLMEngine
from kvsched.distributions import IntDistribution
from kvsched.workload import GeneratorSettings, generate_workload
from model import build_tiny_model
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig


@dataclass
class Measure:
    wall: list[float] = field(default_factory=list)
    steps: int = 0
    forward_tokens: int = 0
    generated: int = 0
    hit_rate: float = 0.0
    outputs: list[tuple[int, ...]] = field(default_factory=list)

    def record(self, engine: LLMEngine, finished: list[FinishedRequest], wall: float) -> None:
        m = engine.metrics
        self.wall.append(wall)
        self.steps = m.steps
        self.forward_tokens = m.scheduled_tokens
        self.generated = m.generated_tokens
        self.hit_rate = m.prefix_cache_hit_rate
        self.outputs = [f.output_token_ids for f in finished]


def workload(args: argparse.Namespace) -> list[tuple[str, list[int], SamplingParams]]:
    requests = generate_workload(
        GeneratorSettings(
            num_requests=args.requests,
            seed=args.seed,
            prompt_len=IntDistribution("uniform", args.suffix, args.suffix),
            max_tokens=IntDistribution("uniform", args.max_tokens, args.max_tokens),
            shared_prefix=args.shared_prefix,
            num_system_prompts=args.system_prompts,
        )
    )
    return [
        (r.request_id, list(r.prompt), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        for r in requests
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, repeats=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--shared-prefix", type=int, default=256)
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.shared_prefix, args.max_tokens, args.repeats = 8, 64, 4, 1
    device = setup_torch(args)
    print_header("Prefix caching on and off", command_line("bench.prefix_caching", argv), device)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    model = build_tiny_model(seed=0, dtype=dtype, device=device)
    requests = workload(args)
    print(
        f"workload: {args.requests} requests, system prompt {args.shared_prefix} tokens "
        f"(x{args.system_prompts} distinct) + {args.suffix} own, {args.max_tokens} outputs; "
        f"block_size {args.block_size}, {args.num_gpu_blocks} GPU blocks, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}, {args.dtype}"
    )
    print()
    measures = {False: Measure(), True: Measure()}
    for _ in range(args.repeats):
        for caching in (False, True):  # alternating, so drift hits both alike
            config = SchedulerConfig(
                num_gpu_blocks=args.num_gpu_blocks,
                block_size=args.block_size,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=caching,
            )
            measures[caching].record(*run_engine(model, config, requests, device))
    off, on = measures[False], measures[True]
    if off.outputs != on.outputs:
        raise SystemExit("outputs differ between prefix caching off and on")
    rows = []
    for name, m in (("off", off), ("on", on)):
        wall = median(m.wall)
        rows.append(
            [
                name,
                m.steps,
                m.forward_tokens,
                f"{m.hit_rate:.1%}",
                f"{wall:.3f}",
                f"{m.generated / wall:.0f}",
            ]
        )
    print(
        markdown_table(
            ["prefix caching", "steps", "forward tokens", "hit rate", "wall s", "tokens/s"], rows
        )
    )
    print()
    print(
        f"speedup (wall off / wall on): {median(off.wall) / median(on.wall):.2f}x; forward "
        f"tokens {on.forward_tokens / off.forward_tokens:.1%} of off; outputs equal"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
