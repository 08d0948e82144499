"""``kvsched demo``: the seed tutorial's preemption demo, on the real engine.

The seed (``step11_preemption``) runs 8 random 5-token prompts (seed 42, tokens in
1..254), 8 new tokens each, through 20 KV slots: without preemption it crashes when
the cache is full; with preemption all 8 complete. Here the same workload (EOS
ignored, 20 GPU blocks of one token, at most 8 running) goes through the
no-preemption engine, which raises its typed KV-exhausted error, and through the
preemption engine in each mode, beside the seed's own figures. "= solo" says whether
every output equals the request's output when it runs alone with an unbounded cache:
preemption must change when tokens are computed, never which tokens come out.

The output is deterministic: no timings are shown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from impl import LLMEngine, NoPreemptionEngine
from kvsched.runner import run_reference, run_workload
from kvsched.workload import WorkloadRequest
from model import LlamaForCausalLM, build_tiny_model
from spec.types import KVCacheExhaustedError, PreemptionMode, SamplingParams, SchedulerConfig

NUM_REQUESTS = 8
PROMPT_LEN = 5
MAX_TOKENS = 8
KV_SLOTS = 20
CPU_BLOCKS = 20
SEED = 42


@dataclass(frozen=True, slots=True)
class SeedFigures:
    """What the seed tutorial's preemption engine does on this workload (restart, LIFO)."""

    steps: int = 58
    preemptions: int = 39
    tokens_computed: int = 132
    tokens_needed: int = NUM_REQUESTS * MAX_TOKENS


def seed_workload() -> list[WorkloadRequest]:
    """``torch.manual_seed(42); [torch.randint(1, 255, (5,)) for _ in range(8)]``."""
    g = torch.Generator().manual_seed(SEED)
    return [
        WorkloadRequest(
            request_id=f"seq{i}",
            prompt=tuple(int(t) for t in torch.randint(1, 255, (PROMPT_LEN,), generator=g)),
            params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        for i in range(NUM_REQUESTS)
    ]


def seed_config(mode: PreemptionMode) -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=KV_SLOTS,
        block_size=1,
        max_num_seqs=NUM_REQUESTS,
        preemption_mode=mode,
        num_cpu_blocks=CPU_BLOCKS if mode is PreemptionMode.SWAP else 0,
    )


@dataclass(frozen=True, slots=True)
class ModeRow:
    mode: PreemptionMode
    steps: int
    preemptions: int
    tokens_sampled: int
    recomputed_tokens: int
    swap_blocks: tuple[int, int]
    completed: int
    equals_solo: bool


def run_mode(model: LlamaForCausalLM, mode: PreemptionMode, threads: int | None = None) -> ModeRow:
    config = seed_config(mode)
    workload = seed_workload()
    result = run_workload(LLMEngine(config, model=model, threads=threads), config, workload)
    solo = run_reference(lambda c: LLMEngine(c, model=model, threads=threads), config, workload)
    m = result.metrics
    return ModeRow(
        mode=mode,
        steps=m.steps,
        preemptions=m.preemptions,
        tokens_sampled=m.tokens_sampled,
        recomputed_tokens=m.recomputed_tokens,
        swap_blocks=(m.swap_out_blocks, m.swap_in_blocks),
        completed=sum(o.finish_reason == "length" for o in result.outcomes),
        equals_solo=[o.output for o in result.outcomes] == [o.output for o in solo.outcomes],
    )


def no_preemption_line(model: LlamaForCausalLM, threads: int | None = None) -> str:
    config = seed_config(PreemptionMode.RECOMPUTE)
    engine = NoPreemptionEngine(config, model=model, threads=threads)
    try:
        engine.generate([(r.request_id, list(r.prompt), r.params) for r in seed_workload()])
    except KVCacheExhaustedError as e:
        return f"{type(e).__name__}: {e}"
    return "completed without running out of KV cache (unexpected)"


NUM_STAGES = 1 + len(PreemptionMode)  # the no-preemption engine, then each mode


def main(
    out: TextIO,
    *,
    threads: int | None = None,
    on_stage: Callable[[int], None] | None = None,
) -> None:
    """Print the demo to ``out``; ``on_stage(k)`` after each of its ``NUM_STAGES`` runs."""

    def stage_done(k: int) -> None:
        if on_stage is not None:
            on_stage(k)

    console = Console(file=out, width=WIDTH, highlight=False, emoji=False)
    model = build_tiny_model(seed=0)
    seed = SeedFigures()
    console.print("[bold]kvsched demo[/]: the seed tutorial's preemption workload, real engine")
    console.print(
        f"  {NUM_REQUESTS} random {PROMPT_LEN}-token prompts (torch seed {SEED}, tokens 1..254), "
        f"{MAX_TOKENS} new tokens each (EOS ignored),\n"
        f"  {KV_SLOTS} KV slots ({KV_SLOTS} GPU blocks of 1 token), at most {NUM_REQUESTS} "
        "running, LIFO victims"
    )
    console.print()
    console.print(f"  no preemption: {no_preemption_line(model, threads)}", soft_wrap=True)
    stage_done(1)
    rows = []
    for mode in PreemptionMode:
        rows.append(run_mode(model, mode, threads))
        stage_done(1 + len(rows))
    first = rows[0]
    console.print(
        f"  preemption:    {first.completed} of {NUM_REQUESTS} requests completed "
        f"({first.mode}: {first.preemptions} preemptions in {first.steps} steps)"
    )
    console.print()
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("engine", no_wrap=True)
    for name in ("steps", "preemptions", "sampled", "recomputed", "swap out/in", "done"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("= solo", no_wrap=True)
    for row in rows:
        table.add_row(
            f"kvsched {row.mode}",
            str(row.steps),
            str(row.preemptions),
            f"{row.tokens_sampled}/{seed.tokens_needed}",
            str(row.recomputed_tokens),
            f"{row.swap_blocks[0]}/{row.swap_blocks[1]}",
            f"{row.completed}/{NUM_REQUESTS}",
            "yes" if row.equals_solo else "NO",
        )
    table.add_row(
        "seed tutorial",
        str(seed.steps),
        str(seed.preemptions),
        f"{seed.tokens_computed}/{seed.tokens_needed}",
        "-",
        "-",
        f"{NUM_REQUESTS}/{NUM_REQUESTS}",
        "not checked",
    )
    console.print(table)
    console.print()
    for note in NOTES:
        console.print(f"  {note}", soft_wrap=True)


WIDTH = 100
NOTES = (
    f"sampled: tokens sampled / the {NUM_REQUESTS * MAX_TOKENS} outputs asked for "
    "(a restart samples a victim's outputs again)",
    "recomputed: tokens whose K/V was computed again after a recompute or restart preemption",
    f"swap: victims' K/V blocks copied to a pool of {CPU_BLOCKS} CPU blocks and back "
    "(out/in: blocks copied)",
    "= solo: every output equals the request's output when run alone with an unbounded cache",
    "seed tutorial: its own figures here (step11_preemption: restart, LIFO, evicts before "
    "each step)",
)
