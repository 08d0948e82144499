"""What async scheduling buys the engine: the same workload, async on and off, same run.

With ``async_scheduling`` (vllm-v1/async-*, impl/pipeline.py) the engine submits step
N's forward to its worker thread (impl/worker.py) and returns; the caller's next
``step()`` applies step N-1 and schedules N+1 while N's forward runs. The host work
that overlaps the forward is scheduling, the forward's input preparation, applying
outputs and the caller's own loop. Torch releases the GIL inside its kernels, so on a
CPU the overlap is real when a second core is free; on a GPU the forward is the
device's, and the host work hides behind it.

Workload: ``--requests`` greedy requests (random prompts of 8..32 tokens, ``max_tokens``
32..64, no EOS), all queued at once, under the ``vllm-v1`` profile (block 16, budget
512, ``max_num_seqs`` 64, a pool that holds them all: no preemption), on two models:
the tiny default (the forward is short: host work dominates) and a wider one (hidden
256, 4 layers: the forward dominates). Rows alternate sync and async for ``--repeats``
rounds; each figure is the median. ``tok/s`` is output tokens over the wall time of
``generate`` and the drain of the last step in flight; ``outputs`` says whether every
request's tokens equal the synchronous run's (they must: the same forwards, in order).

Usage: ``python -m bench.async_overlap [--device cuda] [--quick] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import replace

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
from model import LlamaConfig, LlamaForCausalLM, build_tiny_model
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig, Semantics

Requests = list[tuple[str, list[int], SamplingParams]]

MODELS: list[tuple[str, LlamaConfig | None]] = [
    ("tiny (default)", None),
    (
        "hidden 256, 4 layers",
        LlamaConfig(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    ),
]


def workload(num_requests: int, seed: int = 0) -> Requests:
    rng = random.Random(seed)
    return [
        (
            f"r{i}",
            [rng.randrange(256) for _ in range(rng.randint(8, 32))],
            SamplingParams(max_tokens=rng.randint(32, 64), ignore_eos=True),
        )
        for i in range(num_requests)
    ]


def config_for(requests: Requests, *, async_scheduling: bool) -> SchedulerConfig:
    blocks = sum(-(-(len(p) + s.max_tokens) // 16) for _, p, s in requests)
    return SchedulerConfig(
        num_gpu_blocks=blocks + 1,
        block_size=16,
        max_num_batched_tokens=512,
        max_num_seqs=64,
        semantics=Semantics.VLLM_V1,
        async_scheduling=async_scheduling,
    )


def run(
    model: LlamaForCausalLM, config: SchedulerConfig, requests: Requests, device: torch.device
) -> tuple[list[FinishedRequest], float, int]:
    """The outputs, the wall seconds (generate, then the last step in flight drained)
    and the engine's steps."""
    engine = LLMEngine(config, model=model)

    def generate() -> list[FinishedRequest]:
        finished = engine.generate(requests)
        while engine.has_unfinished_requests():
            engine.step()
        return finished

    finished, seconds = timed_call(device, generate)
    return finished, seconds, engine.metrics.steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=5)
    parser.add_argument("--requests", type=int, default=64, help="requests (default 64)")
    args = parser.parse_args(argv)
    device = setup_torch(args)
    num_requests = 4 if args.quick else args.requests
    repeats = 1 if args.quick else max(1, args.repeats)
    print_header(
        "kvsched async scheduling: the forward overlapped, on vs off",
        command_line("bench.async_overlap", argv),
        device,
    )
    requests = workload(num_requests)
    if args.quick:
        requests = [(rid, p, replace(s, max_tokens=4)) for rid, p, s in requests]
    tokens = sum(s.max_tokens for _, _, s in requests)
    rows = []
    ratios = []
    for name, model_config in MODELS:
        model = build_tiny_model(seed=0, device=device, config=model_config)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        outputs: dict[bool, list[tuple[int, ...]]] = {}
        steps: dict[bool, int] = {}
        warm = requests[:2]
        for on in (False, True):  # warm-up, not timed
            run(model, config_for(warm, async_scheduling=on), warm, device)
        for _ in range(repeats):
            for on in (False, True):
                finished, wall, n = run(
                    model, config_for(requests, async_scheduling=on), requests, device
                )
                seconds[on].append(wall)
                outputs[on] = [f.output_token_ids for f in finished]
                steps[on] = n
        same = outputs[True] == outputs[False]
        for on in (False, True):
            rows.append(
                [
                    name,
                    "on" if on else "off",
                    steps[on],
                    f"{median(seconds[on]):.3f}",
                    spread(seconds[on]),
                    f"{tokens / median(seconds[on]):.0f}",
                    "equal" if same else "DIFFERENT",
                ]
            )
        ratios.append((name, median(seconds[False]) / median(seconds[True])))
    print(
        f"{len(requests)} requests, {tokens} output tokens; median of {repeats} rounds "
        "(sync and async alternate)"
    )
    print(
        markdown_table(
            ["model", "async", "steps", "wall s", "min..max", "tok/s", "outputs vs sync"], rows
        )
    )
    for name, ratio in ratios:
        print(f"{name}: async/sync throughput {ratio:.2f}x")
    return 0 if all(row[-1] == "equal" for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
