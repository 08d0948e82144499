"""The seed tutorial's workload: steps, preemptions and recomputed tokens per mode.

The workload is the seed's (``step11_preemption``): 8 random 5-token prompts (torch
seed 42, tokens 1..254), 8 new tokens each, EOS ignored, 20 KV slots (20 GPU blocks
of one token), at most 8 running, LIFO victims (``kvsched.demo``'s configuration;
swap mode gets a 20-block CPU pool). It runs on the real engine (tiny random model)
in each preemption mode, and every output is checked against the request run alone.

Definitions:

* ``forward tokens``: tokens run through the model (``EngineMetrics.scheduled_tokens``).
  Without any preemption the workload needs 8 x (5 + 8 - 1) = 96 (the last output is
  sampled, never written);
* ``recomputed``: forward tokens at positions the request had computed before a
  recompute/restart preemption dropped them (``EngineMetrics.recomputed_tokens``:
  re-prefills, and under restart the re-decoded outputs too);
* ``recomputed %`` = recomputed / forward tokens: the share of the model's work that
  was thrown away and done again. Target: <= 10 %, in fewer steps than the seed's 58.

The seed's row is its own figures (58 steps, 39 preemptions, 47 prefills and 85
decodes = 132 tokens sampled for 64 needed). Its forward tokens are 47 x 5 + 85 = 320,
so it recomputed 320 - 96 = 224 of them (70 %).

A sweep then runs the torch-free scheduler (the schedule does not depend on the
tokens: EOS is ignored) over policy x ``max_num_seqs`` x token budget x chunked
prefill on the same 20 slots, and lists the configurations that meet both targets.

Usage: ``python -m bench.seed_workload [--device cpu|cuda] [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench._common import add_common_args, command_line, markdown_table, print_header, setup_torch
from impl import LLMEngine, Scheduler
from impl.engine import EngineStalledError, drain_step_limit
from kvsched.demo import SeedFigures, seed_config, seed_workload
from kvsched.workload import WorkloadRequest
from model import LlamaForCausalLM, build_tiny_model
from spec.types import InvalidRequestError, PreemptionMode, SchedulerConfig

SEED = SeedFigures()
NEEDED_FORWARD = 8 * (5 + 8 - 1)  # 96
SEED_PREFILLS, SEED_DECODES, PROMPT_LEN = 47, 85, 5
SEED_FORWARD = SEED_PREFILLS * PROMPT_LEN + SEED_DECODES  # 320
TARGET_STEPS = SEED.steps
TARGET_RECOMPUTED = 0.10


@dataclass(frozen=True)
class Row:
    name: str
    steps: int
    preemptions: int
    forward: int
    recomputed: int
    sampled: int
    swap: str
    solo: str

    @property
    def share(self) -> float:
        return self.recomputed / self.forward if self.forward else 0.0

    def cells(self) -> list[object]:
        return [
            self.name,
            self.steps,
            self.preemptions,
            f"{self.forward}/{NEEDED_FORWARD}",
            self.recomputed,
            f"{self.share:.1%}",
            f"{self.sampled}/{SEED.tokens_needed}",
            self.swap,
            self.solo,
            "yes" if self.steps < TARGET_STEPS else "no",
            "yes" if self.share <= TARGET_RECOMPUTED else "no",
        ]


HEADERS = [
    "run",
    "steps",
    "preemptions",
    "forward/needed",
    "recomputed",
    "recomputed %",
    "sampled/needed",
    "swap out/in",
    "= solo",
    f"< {TARGET_STEPS} steps",
    "<= 10 %",
]


def solo_outputs(
    model: LlamaForCausalLM, workload: Sequence[WorkloadRequest]
) -> list[tuple[int, ...]]:
    """Each request alone, in a cache that holds its whole life."""
    outputs = []
    for r in workload:
        config = SchedulerConfig(num_gpu_blocks=64, block_size=1, max_num_seqs=1)
        engine = LLMEngine(config, model=model)
        (done,) = engine.generate([(r.request_id, list(r.prompt), r.params)])
        outputs.append(done.output_token_ids)
    return outputs


def engine_row(
    name: str,
    model: LlamaForCausalLM,
    config: SchedulerConfig,
    solo: list[tuple[int, ...]],
) -> Row:
    workload = seed_workload()
    engine = LLMEngine(config, model=model)
    finished = engine.generate([(r.request_id, list(r.prompt), r.params) for r in workload])
    m = engine.metrics
    return Row(
        name=name,
        steps=m.steps,
        preemptions=m.num_preemptions,
        forward=m.scheduled_tokens,
        recomputed=m.recomputed_tokens,
        sampled=m.generated_tokens,
        swap=f"{m.swap_out_blocks}/{m.swap_in_blocks}",
        solo="yes" if [f.output_token_ids for f in finished] == solo else "NO",
    )


def seed_row() -> Row:
    return Row(
        name="seed tutorial (restart, its own figures)",
        steps=SEED.steps,
        preemptions=SEED.preemptions,
        forward=SEED_FORWARD,
        recomputed=SEED_FORWARD - NEEDED_FORWARD,
        sampled=SEED.tokens_computed,
        swap="-",
        solo="not checked",
    )


@dataclass(frozen=True)
class SweepResult:
    config: SchedulerConfig
    steps: int
    preemptions: int
    forward: int
    recomputed: int

    @property
    def share(self) -> float:
        return self.recomputed / self.forward

    @property
    def meets(self) -> bool:
        return self.steps < TARGET_STEPS and self.share <= TARGET_RECOMPUTED


def schedule_only(config: SchedulerConfig) -> SweepResult:
    scheduler = Scheduler(config)
    for r in seed_workload():
        scheduler.add_request(r.request_id, r.prompt, r.params)
    steps = preemptions = forward = recomputed = 0
    limit = drain_step_limit(scheduler.observe())
    while scheduler.has_unfinished_requests():
        if steps == limit:
            raise EngineStalledError(f"{config}: not drained within {limit} steps")
        out = scheduler.schedule()
        scheduler.commit(out, [9] * out.num_samples)
        steps += 1
        preemptions += len(out.preempted)
        forward += out.num_batched_tokens
        recomputed += out.num_recomputed_tokens
    return SweepResult(config, steps, preemptions, forward, recomputed)


def sweep(modes: Sequence[PreemptionMode], cpu_blocks: Sequence[int]) -> list[SweepResult]:
    results = []
    for mode, policy, max_seqs, budget, chunked, cpu in itertools.product(
        modes,
        ("lifo", "fewest-outputs", "priority"),
        (1, 2, 3, 4, 8),
        (2, 3, 4, 6, 8, 12, 2048),
        (True, False),
        cpu_blocks,
    ):
        if (mode is PreemptionMode.SWAP) != (cpu > 0):
            continue
        config = replace(
            seed_config(mode),
            policy=policy,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            num_cpu_blocks=cpu,
        )
        try:
            results.append(schedule_only(config))
        except InvalidRequestError:
            continue  # a request that can never fit this budget without chunking
    return results


def describe(config: SchedulerConfig) -> str:
    parts = [
        str(config.preemption_mode),
        config.policy,
        f"max_num_seqs={config.max_num_seqs}",
        f"budget={config.max_num_batched_tokens}",
        "chunked" if config.enable_chunked_prefill else "no chunking",
    ]
    if config.num_cpu_blocks:
        parts.append(f"{config.num_cpu_blocks} CPU blocks")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=1)
    parser.add_argument("--no-sweep", action="store_true", help="skip the configuration sweep")
    args = parser.parse_args(argv)
    device = setup_torch(args)
    print_header(
        "The seed's workload (8 x 5-token prompts, 8 tokens, 20 KV slots)",
        command_line("bench.seed_workload", argv),
        device,
    )
    model = build_tiny_model(seed=0, device=device)
    workload = seed_workload()
    solo = solo_outputs(model, workload)
    rows = [
        engine_row(f"kvsched {mode}", model, seed_config(mode), solo) for mode in PreemptionMode
    ]
    rows.append(seed_row())
    print(markdown_table(HEADERS, [row.cells() for row in rows]))
    print()
    print(
        "recomputed % = recomputed forward tokens / all forward tokens; needed = a run "
        "without preemption. seed: forward 47 prefills x 5 + 85 decodes = 320."
    )
    if args.quick or args.no_sweep:
        return 0

    print("\n## Configurations on the same 20 slots (sweep, torch-free scheduler)")
    modes = list(PreemptionMode)
    results = sweep(modes, (0, 10, 20, 40))
    for mode in modes:
        mine = [r for r in results if r.config.preemption_mode is mode]
        meeting = [r for r in mine if r.meets]
        best = min(mine, key=lambda r: (r.share, r.steps))
        fastest = min(mine, key=lambda r: (r.steps, r.share))
        print(
            f"{mode}: {len(meeting)} of {len(mine)} configurations meet both targets; "
            f"least recomputed: {best.share:.1%} in {best.steps} steps ({describe(best.config)}); "
            f"fewest steps: {fastest.steps} with {fastest.share:.1%} ({describe(fastest.config)})"
        )
        if meeting:
            budgets = sorted({r.config.max_num_batched_tokens for r in meeting})
            seqs = sorted({r.config.max_num_seqs for r in meeting})
            print(f"  those that meet both: budgets {budgets}, max_num_seqs {seqs}")
    picks = [
        replace(seed_config(PreemptionMode.SWAP), num_cpu_blocks=40),
        replace(seed_config(PreemptionMode.SWAP), max_num_seqs=2),
        replace(seed_config(PreemptionMode.RECOMPUTE), max_num_batched_tokens=2),
        replace(seed_config(PreemptionMode.RECOMPUTE), max_num_batched_tokens=8, max_num_seqs=2),
    ]
    print("\nSome of them on the real engine:")
    picked = [engine_row(describe(c), model, c, solo) for c in picks]
    print(markdown_table(HEADERS, [row.cells() for row in picked]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
