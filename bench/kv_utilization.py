"""KV-cache utilization under saturation: how full the GPU pool is while requests wait.

``--requests`` mixed requests (prompts ``--prompt-len``, ``max_tokens``
``--max-tokens``, EOS ignored) are all added at once to an engine whose GPU pool
holds ``--pool-tokens`` token slots (``pool_tokens / block_size`` blocks), far less
than they need together, with ``max_num_seqs`` and the token budget large enough
that the pool is what limits admission.

Measured at every forward (a model-runner wrapper reads the scheduler after phases
A-C, when the step's chunks are allocated and about to be written), over the
**saturated** steps: those where requests are still waiting (or swapped) after
admission although neither the token budget nor ``max_num_seqs`` stopped it, i.e.
work is queued and the pool is the bottleneck (steps where the budget ran out, as
in the first prefill-heavy steps, are left out):

* **block utilization** = GPU blocks owned by running requests / ``num_gpu_blocks``.
  Every owned block holds at least one live token once the forward has run (a request
  owns ``cdiv(computed, bs)`` blocks), so this is the share of blocks holding live
  tokens. It is below 1 only by free blocks: blocks left when the head of the waiting
  queue needs more than are free (head-of-line), and steps that preempted (no
  admission then, R8).
* **slot utilization** = live tokens / (``num_gpu_blocks`` x ``block_size``): also
  counts the unused tail slots of each request's last block (internal
  fragmentation, under ``block_size - 1`` tokens per request; vLLM's "under 4 %").

``EngineMetrics.kv_utilization`` is the slot utilization averaged over *all* steps
(ramp-up and drain included), printed for reference; ``EngineMetrics`` has no
per-step or saturated-only figure, hence the wrapper. Target: >= 96 % of blocks.

Usage: ``python -m bench.kv_utilization [--device cpu|cuda] [--block-sizes 1,16,64]``.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench._common import (
    add_common_args,
    command_line,
    markdown_table,
    median,
    print_header,
    setup_torch,
)
from impl import LLMEngine
from impl.model_runner import ModelRunner
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from model import LlamaForCausalLM, build_tiny_model
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig

TARGET = 0.96


@dataclass
class Samples:
    blocks: list[float] = field(default_factory=list)
    slots: list[float] = field(default_factory=list)
    steps: int = 0


class ObservingRunner(ModelRunner):
    """The real model runner, reading the pool's occupancy before each forward."""

    def __init__(self, base: ModelRunner, scheduler: Scheduler, samples: Samples) -> None:
        super().__init__(base.model, base.cache_engine)
        self.scheduler = scheduler
        self.samples = samples

    def execute(self, out: SchedulerOutput) -> list[int]:
        scheduler = self.scheduler
        self.samples.steps += 1
        queued = len(scheduler.waiting) > 0 or len(scheduler.swapped) > 0
        budget_left = out.num_batched_tokens < scheduler.config.max_num_batched_tokens
        seats_left = len(scheduler.running) < scheduler.config.max_num_seqs
        if queued and budget_left and seats_left:
            gpu = scheduler.gpu
            live = scheduler.num_cached_tokens + out.num_batched_tokens
            self.samples.blocks.append(gpu.num_used_blocks / gpu.num_blocks)
            self.samples.slots.append(live / (gpu.num_blocks * scheduler.block_size))
        return super().execute(out)


def run(
    model: LlamaForCausalLM,
    config: SchedulerConfig,
    requests: list[tuple[str, list[int], SamplingParams]],
) -> tuple[Samples, LLMEngine]:
    engine = LLMEngine(config, model=model)
    samples = Samples()
    engine.model_runner = ObservingRunner(engine.model_runner, engine.scheduler, samples)
    engine.generate(requests)
    return samples, engine


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=1)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", default="16,256")
    parser.add_argument("--max-tokens", default="16,128")
    parser.add_argument("--pool-tokens", type=int, default=8192)
    parser.add_argument("--block-sizes", default="1,16,64")
    parser.add_argument("--modes", default="recompute,swap")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_len, args.max_tokens = 12, "4,24", "4,12"
        args.pool_tokens, args.block_sizes = 96, "4,16"
    device = setup_torch(args)
    print_header(
        "KV utilization under saturation", command_line("bench.kv_utilization", argv), device
    )
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    mlo, mhi = (int(x) for x in args.max_tokens.split(","))
    rng = random.Random(args.seed)
    requests = [
        (
            f"r{i}",
            [rng.randrange(1, 255) for _ in range(rng.randint(lo, hi))],
            SamplingParams(max_tokens=rng.randint(mlo, mhi), ignore_eos=True),
        )
        for i in range(args.requests)
    ]
    demand = sum(len(p) + s.max_tokens - 1 for _, p, s in requests)
    print(
        f"{args.requests} requests, prompts {lo}..{hi}, max_tokens {mlo}..{mhi}: "
        f"{demand} token slots over their lives; GPU pool {args.pool_tokens} slots "
        f"({args.pool_tokens / demand:.0%} of that); tiny model (batch_invariant=False), "
        f"device {device}\n"
    )
    # The schedule does not depend on the tokens (EOS ignored): the fast mode is enough.
    model = build_tiny_model(seed=0, device=device, batch_invariant=False)
    rows = []
    for bs in (int(b) for b in args.block_sizes.split(",")):
        for mode_name in args.modes.split(","):
            mode = PreemptionMode(mode_name)
            num_blocks = args.pool_tokens // bs
            config = SchedulerConfig(
                num_gpu_blocks=num_blocks,
                block_size=bs,
                max_num_batched_tokens=max(2048, hi),
                max_num_seqs=args.requests,
                preemption_mode=mode,
                num_cpu_blocks=num_blocks if mode is PreemptionMode.SWAP else 0,
            )
            samples, engine = run(model, config, requests)
            m = engine.metrics
            blocks = median(samples.blocks) if samples.blocks else float("nan")
            mean_blocks = sum(samples.blocks) / max(1, len(samples.blocks))
            mean_slots = sum(samples.slots) / max(1, len(samples.slots))
            rows.append(
                [
                    bs,
                    mode_name,
                    f"{len(samples.blocks)}/{samples.steps}",
                    f"{mean_blocks:.1%}",
                    f"{blocks:.1%}",
                    f"{min(samples.blocks, default=float('nan')):.1%}",
                    f"{mean_slots:.1%}",
                    f"{m.kv_utilization:.1%}",
                    m.num_preemptions,
                    "yes" if mean_blocks >= TARGET else "no",
                    "yes" if mean_slots >= TARGET else "no",
                ]
            )
            print(f"block size {bs}, {mode_name} done", flush=True)
    print()
    print(
        markdown_table(
            [
                "block",
                "mode",
                "saturated steps",
                "block util (mean)",
                "block util (median)",
                "block util (min)",
                "slot util (mean)",
                "metrics.kv_utilization (all steps)",
                "preemptions",
                "blocks >= 96 %",
                "slots >= 96 %",
            ],
            rows,
        )
    )
    print(
        "\nsaturated steps: requests still waiting or swapped after admission, with budget and "
        "seats left (the pool is the limit). "
        "block util: owned GPU blocks / all; slot util: live tokens / all slots."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
