"""Speculative decoding (n-gram prompt lookup) on and off, side by side, on two workloads.

``--requests`` requests of ``--prompt-len`` prompt tokens and ``--max-tokens`` outputs
(greedy, EOS ignored), all arriving at once, in two workloads:

* ``repetitive``: each prompt is a random pattern of 2..``--pattern-max`` tokens
  repeated (its own seeded draw), so a suffix of the prompt occurs earlier in it; the
  tiny random model's greedy outputs also repeat their own short n-grams, which prompt
  lookup then finds in the outputs themselves (in either workload);
* ``random``: uniform random prompts (``kvsched.workload.generate_workload``, what
  ``kvsched workload`` draws).

Each workload runs under vLLM V1's semantics (``--block-size``, ``--num-gpu-blocks``,
``--max-num-batched-tokens``, ``--max-num-seqs``, ``--max-model-len``; by default 64
requests with at most 8 running at once, so the batch stays full and the steps follow
the mean acceptance rather than the slowest request's) with speculative decoding off
(``num_speculative_tokens`` 0) and on (``--k`` drafts from an ``NgramProposer`` of
``--lookup-min``..``--lookup-max``-grams), alternating, in one process; reported per
workload and setting (median of ``--repeats`` runs for times):

* ``steps`` and ``forwards`` (steps that ran the model);
* ``forward tokens``: tokens run through the model, drafts included (they cost compute);
* ``drafts`` verified and ``accepted`` (delivered as outputs), the ``acceptance`` rate
  (accepted / drafts), the ``mean accepted length`` (tokens a run with drafts delivers,
  1 + accepted / runs: vLLM's mean acceptance length) and ``tokens/forward``;
* ``wall s`` of the whole ``generate`` call (min..max of the repeats) and ``tokens/s``
  (sampled tokens / wall);
* ``speedup``: wall off / wall on, measured in the same run.

The outputs of the two settings must be equal (float64 by default: greedy acceptance
delivers a draft only where it is the argmax a one-token decode would take, and the
model is batch-invariant to the bit); the benchmark stops with an error otherwise.

On a CPU with the tiny model a forward's cost grows with the tokens it runs, so fewer
steps need not mean less wall time; where a decode forward is memory-bound (a GPU) the
extra draft positions are nearly free, and that figure comes from ``bench/gpu.sh``.

Usage: ``python -m bench.speculative [--quick] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bench._common import (
    add_common_args,
    command_line,
    markdown_table,
    median,
    print_header,
    setup_torch,
    spread,
    timed_call,
)
from impl import LLMEngine
from impl.ngram_proposer import NgramProposer
from impl.speculative import SpeculativeCounts
from kvsched.distributions import IntDistribution
from kvsched.workload import GeneratorSettings, generate_workload
from model import LlamaForCausalLM, build_tiny_model
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig, Semantics

Requests = list[tuple[str, list[int], SamplingParams]]
WORKLOADS = ("repetitive", "random")


@dataclass
class Measure:
    wall: list[float] = field(default_factory=list)
    steps: int = 0
    forward_tokens: int = 0
    generated: int = 0
    figures: SpeculativeCounts = field(default_factory=SpeculativeCounts)
    outputs: list[tuple[int, ...]] = field(default_factory=list)

    def record(self, engine: LLMEngine, finished: list[FinishedRequest], wall: float) -> None:
        m = engine.metrics
        self.wall.append(wall)
        self.steps = m.steps
        self.forward_tokens = m.scheduled_tokens
        self.generated = m.generated_tokens
        self.figures = m.speculative
        self.outputs = [f.output_token_ids for f in finished]


def params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)


def repetitive_workload(args: argparse.Namespace) -> Requests:
    """Prompts that repeat a pattern of their own: 2..pattern_max random tokens, tiled."""
    rng = random.Random(f"speculative-repetitive-{args.seed}")
    requests: Requests = []
    for i in range(args.requests):
        pattern = [rng.randint(1, 255) for _ in range(rng.randint(2, args.pattern_max))]
        prompt = (pattern * (args.prompt_len // len(pattern) + 1))[: args.prompt_len]
        requests.append((f"rep{i}", prompt, params(args)))
    return requests


def random_workload(args: argparse.Namespace) -> Requests:
    drawn = generate_workload(
        GeneratorSettings(
            num_requests=args.requests,
            seed=args.seed,
            prompt_len=IntDistribution("uniform", args.prompt_len, args.prompt_len),
            max_tokens=IntDistribution("uniform", args.max_tokens, args.max_tokens),
        )
    )
    return [(r.request_id, list(r.prompt), params(args)) for r in drawn]


def config_for(args: argparse.Namespace, k: int) -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        semantics=Semantics.VLLM_V1,
        max_model_len=args.max_model_len,
        num_speculative_tokens=k,
    )


def run_setting(
    model: LlamaForCausalLM,
    args: argparse.Namespace,
    requests: Requests,
    device: torch.device,
    speculative: bool,
) -> tuple[LLMEngine, list[FinishedRequest], float]:
    """A fresh engine, drafts off or on, generates ``requests``: the engine (its
    metrics), what finished and the wall seconds of ``generate``."""
    config = config_for(args, args.k if speculative else 0)
    drafter = None
    if speculative:
        drafter = NgramProposer(
            num_speculative_tokens=args.k,
            prompt_lookup_min=args.lookup_min,
            prompt_lookup_max=args.lookup_max,
            max_model_len=config.max_model_len,
        )
    engine = LLMEngine(config, model=model, drafter=drafter)
    finished, wall = timed_call(device, engine.generate, requests)
    return engine, finished, wall


def row(workload: str, setting: str, m: Measure) -> list[object]:
    wall = median(m.wall)
    f = m.figures
    return [
        workload,
        setting,
        m.steps,
        f.forwards,
        m.forward_tokens,
        f.draft_tokens,
        f.accepted_tokens,
        f"{f.acceptance_rate:.1%}" if f.draft_tokens else "-",
        f"{f.mean_accepted_length:.2f}" if f.draft_tokens else "-",
        f"{f.tokens_per_forward:.2f}",
        f"{wall:.3f}",
        spread(m.wall),
        f"{m.generated / wall:.0f}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, repeats=5)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--pattern-max", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens when on (3)")
    parser.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min (1)")
    parser.add_argument("--lookup-max", type=int, default=3, help="prompt_lookup_max (3)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_len, args.max_tokens, args.repeats = 4, 16, 8, 1
    device = setup_torch(args)
    print_header(
        "Speculative decoding (n-gram) on and off", command_line("bench.speculative", argv), device
    )
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    model = build_tiny_model(seed=0, dtype=dtype, device=device)
    workloads = {"repetitive": repetitive_workload(args), "random": random_workload(args)}
    print(
        f"workloads: {args.requests} requests of {args.prompt_len} prompt tokens "
        f"(repetitive: a pattern of 2..{args.pattern_max} tokens repeated; random: uniform), "
        f"{args.max_tokens} outputs, greedy, EOS ignored; vllm-v1, block_size "
        f"{args.block_size}, {args.num_gpu_blocks} GPU blocks, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}, max_num_seqs {args.max_num_seqs}, max_model_len "
        f"{args.max_model_len}, {args.dtype}; on: K={args.k}, prompt lookup "
        f"{args.lookup_min}..{args.lookup_max}-grams"
    )
    print()
    measures = {(w, on): Measure() for w in WORKLOADS for on in (False, True)}
    for _ in range(args.repeats):
        for name in WORKLOADS:
            for on in (False, True):  # alternating, so drift hits both alike
                result = run_setting(model, args, workloads[name], device, on)
                measures[name, on].record(*result)
    for name in WORKLOADS:
        if measures[name, False].outputs != measures[name, True].outputs:
            raise SystemExit(f"outputs differ between speculative decoding off and on ({name})")
    rows = []
    for name in WORKLOADS:
        rows.append(row(name, "off", measures[name, False]))
        rows.append(row(name, f"on (K={args.k})", measures[name, True]))
    headers = [
        "workload",
        "speculative",
        "steps",
        "forwards",
        "forward tokens",
        "drafts",
        "accepted",
        "acceptance",
        "mean accepted length",
        "tokens/forward",
        "wall s",
        "min..max",
        "tokens/s",
    ]
    print(markdown_table(headers, rows))
    print()
    for name in WORKLOADS:
        off, spec = measures[name, False], measures[name, True]
        print(
            f"{name}: speedup (wall off / wall on) "
            f"{median(off.wall) / median(spec.wall):.2f}x; steps {spec.steps / off.steps:.1%} "
            f"of off; forward tokens {spec.forward_tokens / off.forward_tokens:.1%} of off; "
            f"outputs equal"
        )
    print()
    if device.type == "cuda":
        print(
            "What the GPU figure means: a decode forward of the tiny model is memory- and "
            "launch-bound here, so the draft positions a verify forward adds cost little and "
            "the wall time follows the steps more closely than on a CPU."
        )
    else:
        print(
            "What the CPU figure means: on a CPU with a tiny model a forward's cost grows "
            "with the tokens it runs, drafts included, so fewer steps need not mean less "
            "wall time; the GPU figure (a decode forward memory-bound, the extra draft "
            "positions nearly free) comes from bench/gpu.sh when a device is lent."
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
