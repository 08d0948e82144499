"""Scheduling policies compared: preemptions, recomputation, latency and throughput.

Every registered policy runs the same workloads through the engine
(``impl.LLMEngine``, the built-in tiny model, float32, ``--threads`` torch threads)
with the same configuration (``--num-gpu-blocks`` blocks of ``--block-size``
tokens, a ``--max-num-batched-tokens`` budget, recompute preemption). Workloads
(``--num-requests`` requests each, prompts uniform over 8..64 tokens, EOS ignored so
every request runs to ``max_tokens``; drawn by ``kvsched.workload`` from the seed):

* ``uniform``: ``max_tokens`` uniform over 16..128, arrivals uniform over steps 0..100;
* ``long-tail``: ``max_tokens`` a bounded Pareto over 8..512 (``longtail:8:512:1.2``:
  most requests short, a few very long), arrivals uniform over steps 0..100;
* ``bursty``: ``max_tokens`` uniform over 16..128, arrivals in bursts of 16 requests
  every 60 steps.

Each workload is drawn with ``--seeds`` seeds; the counts add up over them.
Reported per policy and workload:

* ``steps`` (the makespan), ``preempt`` (preemptions), ``recomputed`` (tokens run
  again after a preemption dropped them) and ``scheduled`` (every token run through
  the model, the compute spent);
* ``p50``/``p99 finish``: the step at which a request finished, over all requests;
* ``tok/step``: generated tokens per step (every policy generates the same tokens, so
  this is the inverse of the makespan);
* ``tok/s``: generated tokens per CPU second spent in ``engine.step()``
  (``time.process_time``: on a shared machine, wall time would measure the
  neighbours), the median of ``--repeats`` rounds (policies interleaved in each round),
  and ``tok/s vs first``: the median over the rounds of the ratio to the first policy
  (``lifo``) in the same round, a paired comparison that cancels slow drifts of the
  machine's load. The model's forward is most of a
  step, so this rewards running fewer tokens (less recomputation) as well as
  bigger batches.

Every policy must produce the same outputs as ``lifo`` (greedy, batch-invariant
model); a difference is reported and fails the run.

``--sweep`` skips the model and compares the policies' decisions alone (steps,
preemptions, tokens scheduled) over a grid of prompt lengths (8..64, 64..256),
budgets (128, 512) and pool sizes (48, 96 blocks of 16 tokens): how far the
table's picture carries to other configurations.

Usage: ``python -m bench.policies [--quick] [--seeds 3] [--repeats 3] [--sweep]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench._common import (
    DrainLimit,
    add_common_args,
    command_line,
    markdown_table,
    median,
    print_header,
    setup_torch,
)
from impl import POLICIES, LLMEngine, Scheduler
from kvsched.distributions import parse_distribution
from kvsched.workload import GeneratorSettings, WorkloadRequest, generate_workload
from model import LlamaForCausalLM, build_tiny_model
from spec.types import SchedulerConfig

WORKLOADS = ("uniform", "long-tail", "bursty")
BURST = 16
BURST_EVERY = 60


def make_workload(
    kind: str, seed: int, num_requests: int, prompt_len: str = "8:64"
) -> list[WorkloadRequest]:
    """The ``kind`` workload drawn with ``seed`` (see the module doc)."""
    max_tokens = "longtail:8:512:1.2" if kind == "long-tail" else "16:128"
    settings = GeneratorSettings(
        num_requests=num_requests,
        seed=seed,
        prompt_len=parse_distribution(prompt_len, minimum=1),
        max_tokens=parse_distribution(max_tokens, minimum=1),
        arrival_spread=0 if kind == "bursty" else 100,
        ignore_eos=True,
    )
    requests = generate_workload(settings)
    if kind == "bursty":
        requests = [
            dataclasses.replace(r, arrival_step=(i // BURST) * BURST_EVERY)
            for i, r in enumerate(requests)
        ]
    return requests


@dataclass
class Run:
    """One workload through one engine."""

    steps: int
    preemptions: int
    recomputed: int
    scheduled: int
    generated: int
    cpu_s: float  # CPU time inside engine.step()
    finish_steps: list[int]
    outputs: dict[str, tuple[int, ...]]


def run_once(
    config: SchedulerConfig, model: LlamaForCausalLM, workload: Sequence[WorkloadRequest]
) -> Run:
    """Add each request at its arrival step and step until everything has finished."""
    engine = LLMEngine(config, model=model)
    pending = sorted(workload, key=lambda r: r.arrival_step)
    finish_steps: list[int] = []
    outputs: dict[str, tuple[int, ...]] = {}
    step = 0
    i = 0
    cpu_s = 0.0
    limit = DrainLimit()
    while i < len(pending) or engine.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival_step <= step:
            r = pending[i]
            engine.add_request(r.request_id, list(r.prompt), r.params)
            i += 1
        limit.check(step, i == len(pending), engine.observe)
        started = time.process_time()
        plan = engine.step()
        cpu_s += time.process_time() - started
        for finished in plan.finished:
            finish_steps.append(plan.step)
            outputs[finished.request_id] = finished.output_token_ids
        step += 1
    m = engine.metrics
    return Run(
        steps=m.steps,
        preemptions=m.num_preemptions,
        recomputed=m.recomputed_tokens,
        scheduled=m.scheduled_tokens,
        generated=m.generated_tokens,
        cpu_s=cpu_s,
        finish_steps=finish_steps,
        outputs=outputs,
    )


def percentile(values: Sequence[int], q: float) -> int:
    """The nearest-rank ``q``-th percentile (``0 < q <= 100``)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


@dataclass
class Summary:
    """One policy on one workload, over every seed."""

    steps: int = 0
    preemptions: int = 0
    recomputed: int = 0
    scheduled: int = 0
    generated: int = 0
    finish_steps: list[int] = dataclasses.field(default_factory=list)
    tokens_per_s: list[float] = dataclasses.field(default_factory=list)  # per round
    vs_first: list[float] = dataclasses.field(default_factory=list)  # per round, paired


def compare(
    kind: str,
    *,
    policies: Sequence[str],
    base: SchedulerConfig,
    model: LlamaForCausalLM,
    seeds: Sequence[int],
    num_requests: int,
    repeats: int,
) -> tuple[dict[str, Summary], list[str]]:
    workloads = [make_workload(kind, seed, num_requests) for seed in seeds]
    summaries = {policy: Summary() for policy in policies}
    run_once(dataclasses.replace(base, policy=policies[0]), model, workloads[0])  # warm-up
    mismatches: list[str] = []
    for round_ in range(repeats):
        seconds = dict.fromkeys(policies, 0.0)
        generated = dict.fromkeys(policies, 0)
        for seed, workload in zip(seeds, workloads, strict=True):
            reference: dict[str, tuple[int, ...]] | None = None
            for policy in policies:
                run = run_once(dataclasses.replace(base, policy=policy), model, workload)
                seconds[policy] += run.cpu_s
                generated[policy] += run.generated
                if reference is None:
                    reference = run.outputs
                elif run.outputs != reference:
                    different = sorted(k for k in reference if reference[k] != run.outputs.get(k))
                    mismatches.append(f"{kind} seed {seed}: {policy} differs on {different}")
                if round_ == 0:  # the counts are deterministic: take them once
                    s = summaries[policy]
                    s.steps += run.steps
                    s.preemptions += run.preemptions
                    s.recomputed += run.recomputed
                    s.scheduled += run.scheduled
                    s.generated += run.generated
                    s.finish_steps.extend(run.finish_steps)
        rates = {policy: generated[policy] / seconds[policy] for policy in policies}
        for policy in policies:
            summaries[policy].tokens_per_s.append(rates[policy])
            summaries[policy].vs_first.append(rates[policy] / rates[policies[0]])
    return summaries, mismatches


def table(summaries: dict[str, Summary]) -> str:
    rows = []
    for policy, s in summaries.items():
        tps = median(s.tokens_per_s)
        rows.append(
            [
                policy,
                s.steps,
                s.preemptions,
                s.recomputed,
                s.scheduled,
                percentile(s.finish_steps, 50),
                percentile(s.finish_steps, 99),
                f"{s.generated / s.steps:.2f}",
                f"{tps:.0f}",
                f"{median(s.vs_first):.2f}",
            ]
        )
    headers = [
        "policy", "steps", "preempt", "recomputed", "scheduled", "p50 finish",
        "p99 finish", "tok/step", "tok/s", "tok/s vs first",
    ]  # fmt: skip
    return markdown_table(headers, rows)


#: The ``--sweep`` grid: prompt lengths x budgets x pool sizes (blocks of 16 tokens).
SWEEP_PROMPTS = ("8:64", "64:256")
SWEEP_BUDGETS = (128, 512)
SWEEP_BLOCKS = (48, 96)


def schedule_only(config: SchedulerConfig, workload: Sequence[WorkloadRequest]) -> Run:
    """``run_once`` without a model: ``impl.Scheduler`` with a constant sampled token.

    EOS is ignored in every workload, so the token values do not change any decision:
    the counts equal the engine's.
    """
    scheduler = Scheduler(config)
    pending = sorted(workload, key=lambda r: r.arrival_step)
    finish_steps: list[int] = []
    preemptions = recomputed = scheduled = generated = 0
    i = 0
    limit = DrainLimit()
    while i < len(pending) or scheduler.has_unfinished_requests():
        while i < len(pending) and pending[i].arrival_step <= scheduler.num_steps:
            r = pending[i]
            scheduler.add_request(r.request_id, r.prompt, r.params)
            i += 1
        limit.check(scheduler.num_steps, i == len(pending), scheduler.observe)
        out = scheduler.schedule()
        finished = scheduler.commit(out, [1] * out.num_samples)
        preemptions += len(out.preempted)
        recomputed += out.num_recomputed_tokens
        scheduled += out.num_batched_tokens
        generated += out.num_samples
        finish_steps.extend([out.step] * len(finished))
    return Run(
        steps=scheduler.num_steps,
        preemptions=preemptions,
        recomputed=recomputed,
        scheduled=scheduled,
        generated=generated,
        cpu_s=0.0,
        finish_steps=finish_steps,
        outputs={},
    )


def sweep(policies: Sequence[str], seeds: Sequence[int], num_requests: int) -> str:
    """Each policy against the first over a grid of configurations (no model)."""
    first = policies[0]
    rows = []
    for prompt_len in SWEEP_PROMPTS:
        for budget in SWEEP_BUDGETS:
            for blocks in SWEEP_BLOCKS:
                base = SchedulerConfig(
                    num_gpu_blocks=blocks, block_size=16, max_num_batched_tokens=budget
                )
                for kind in WORKLOADS:
                    totals = {p: [0, 0, 0] for p in policies}  # steps, preempt, scheduled
                    for seed in seeds:
                        workload = make_workload(kind, seed, num_requests, prompt_len)
                        for policy in policies:
                            run = schedule_only(dataclasses.replace(base, policy=policy), workload)
                            t = totals[policy]
                            t[0] += run.steps
                            t[1] += run.preemptions
                            t[2] += run.scheduled
                    row: list[object] = [prompt_len, budget, blocks, kind, totals[first][1]]
                    for policy in policies[1:]:
                        steps, preempt, scheduled = totals[policy]
                        row += [
                            preempt,
                            f"{totals[first][0] / steps:.3f}",
                            f"{scheduled / totals[first][2]:.2f}",
                        ]
                    rows.append(row)
    headers = ["prompt", "budget", "blocks", "workload", f"{first} preempt"]
    for policy in policies[1:]:
        headers += [f"{policy} preempt", "tok/step ratio", "scheduled ratio"]
    return markdown_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_common_args(parser, repeats=3)
    parser.add_argument("--seeds", type=int, default=3, help="workload seeds (default 3)")
    parser.add_argument("--num-requests", type=int, default=128, help="per workload (128)")
    parser.add_argument("--num-gpu-blocks", type=int, default=48, help="(default 48)")
    parser.add_argument("--block-size", type=int, default=16, help="(default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="(default 512)")
    parser.add_argument(
        "--policies",
        default=",".join(sorted(POLICIES, key=lambda p: (p != "lifo", p))),
        help="comma-separated, lifo first (default: every registered policy)",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"(default {','.join(WORKLOADS)})"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="no model: every policy against the first over a grid of prompt lengths, "
        "budgets and pool sizes (steps and preemptions only)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.num_requests = 1, 24
    device = setup_torch(args)
    print_header("Scheduling policies", command_line("bench.policies", argv), device)
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}; registered: {sorted(POLICIES)}")
    if args.sweep:
        print(
            f"sweep: blocks of 16 tokens, recompute mode, {args.num_requests} requests x "
            f"{args.seeds} seeds per cell; ratios against {policies[0]} (tok/step > 1: "
            f"fewer steps; scheduled < 1: fewer tokens run through the model)\n"
        )
        print(sweep(policies, range(args.seeds), args.num_requests))
        return 0
    base = SchedulerConfig(
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    model = build_tiny_model(seed=0, dtype=torch.float32, device=device)
    print(
        f"config: {base.num_gpu_blocks} GPU blocks of {base.block_size} tokens "
        f"({base.num_gpu_blocks * base.block_size} tokens), budget "
        f"{base.max_num_batched_tokens} tokens/step, recompute mode; "
        f"{args.num_requests} requests x {args.seeds} seeds per workload; "
        f"tok/s: median of {args.repeats} rounds"
    )
    failures: list[str] = []
    for kind in [w for w in args.workloads.split(",") if w]:
        if kind not in WORKLOADS:
            parser.error(f"unknown workload {kind!r}; known: {', '.join(WORKLOADS)}")
        summaries, mismatches = compare(
            kind,
            policies=policies,
            base=base,
            model=model,
            seeds=range(args.seeds),
            num_requests=args.num_requests,
            repeats=args.repeats,
        )
        print(f"\n## {kind}\n")
        print(table(summaries))
        spread = {p: statistics.pstdev(s.tokens_per_s) for p, s in summaries.items()}
        print(
            "\ntok/s spread (stdev over rounds): "
            + ", ".join(f"{p} {v:.0f}" for p, v in spread.items())
        )
        failures.extend(mismatches)
    if failures:
        print("\nOUTPUT MISMATCHES:\n" + "\n".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
