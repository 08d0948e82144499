"""Preemption cost: recompute against swap, per block size.

A workload forced to preempt: ``--requests`` requests (``--prompt-len``-token
prompts, ``--max-tokens`` outputs each, EOS ignored) all admitted at once into a
GPU pool that holds only ``--fit`` of them at full length, so decodes run out of
blocks and LIFO victims are preempted. Swap mode gets a CPU pool that holds every
request (no fallback to recompute). For each block size (1, 4, 16, 64) the same
workload runs in recompute mode, in swap mode, and in a pool big enough that nothing
is preempted (the baseline). Reported (median of ``--repeats`` runs):

* ``wall s``: the whole ``generate`` call;
* ``preemptions``, ``recomputed`` tokens (recompute) and blocks swapped out/in (swap);
* ``copy ms``: time inside the swap copies (``CacheEngine.swap_out``/``swap_in``,
  synchronised on CUDA);
* ``direct ms/preemption``: swap: copy time / preemptions; recompute: the time of one
  forward that prefills the mean number of tokens a preemption recomputes, alone
  (a lower bound: in the run the re-prefill shares its forward with other requests);
* ``extra ms/preemption``: (wall - baseline wall) / preemptions, the whole extra cost of a
  preemption: the copies or the re-prefill, plus the smaller batches while the victim
  is out. The baseline runs every request concurrently, so this also charges the mode
  for the concurrency that the smaller pool cannot give; compare the two modes with
  each other rather than reading it as an absolute cost.

The vLLM paper (section 7.3) found swap slow with small blocks (many small PCIe
transfers) and recompute flat across block sizes; here a step's swap is one batched
gather, one transfer and one scatter per tensor, whatever the number of blocks.

Usage: ``python -m bench.preemption_cost [--device cpu|cuda] [--model tiny|small]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench._common import (
    add_common_args,
    command_line,
    markdown_table,
    median,
    print_header,
    run_engine,
    setup_torch,
    timed_call,
)
from impl import LLMEngine
from impl.block_manager import cdiv
from model import ForwardBatch, LlamaConfig, LlamaForCausalLM, Span, build_tiny_model
from spec.types import FinishedRequest, PreemptionMode, SamplingParams, SchedulerConfig

MODELS = {
    "tiny": LlamaConfig(),
    # ~10M parameters: a re-prefill costs something measurable on the CPU.
    "small": LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


@dataclass
class Measure:
    wall: list[float] = field(default_factory=list)
    copy: list[float] = field(default_factory=list)
    preemptions: int = 0
    steps: int = 0
    recomputed: int = 0
    swapped: tuple[int, int] = (0, 0)
    outputs: list[tuple[int, ...]] = field(default_factory=list)

    def record(
        self, engine: LLMEngine, finished: list[FinishedRequest], wall: float, copy: float
    ) -> None:
        m = engine.metrics
        self.wall.append(wall)
        self.copy.append(copy)
        self.preemptions = m.num_preemptions
        self.steps = m.steps
        self.recomputed = m.recomputed_tokens
        self.swapped = (m.swap_out_blocks, m.swap_in_blocks)
        self.outputs = [f.output_token_ids for f in finished]


def timed(fn: Callable[..., Any], totals: list[float], device: torch.device) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        result, seconds = timed_call(device, fn, *args)
        totals[0] += seconds
        return result

    return wrapper


def timing_copies(copy_time: list[float], device: torch.device) -> Callable[[LLMEngine], None]:
    """Add the wall seconds of an engine's swap copies to ``copy_time[0]``."""

    def prepare(engine: LLMEngine) -> None:
        cache = engine.cache_engine
        setattr(cache, "swap_out", timed(cache.swap_out, copy_time, device))  # noqa: B010
        setattr(cache, "swap_in", timed(cache.swap_in, copy_time, device))  # noqa: B010

    return prepare


def prefill_ms(
    model: LlamaForCausalLM, num_tokens: int, block_size: int, device: torch.device
) -> float:
    """Milliseconds of one forward that prefills ``num_tokens`` tokens alone (median of 5)."""
    num_blocks = cdiv(num_tokens, block_size)
    cache = model.new_kv_cache(num_blocks=num_blocks, block_size=block_size)
    tokens = tuple((j * 7) % 255 + 1 for j in range(num_tokens))
    batch = ForwardBatch(spans=(Span(tokens, 0, tuple(range(num_blocks))),))
    times = []
    with torch.inference_mode():
        model.forward(batch, cache)  # warm-up
        for _ in range(5):
            times.append(timed_call(device, model.forward, batch, cache)[1])
    return median(times) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--block-sizes", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--fit", type=int, default=6, help="requests the GPU pool holds (6)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.block_sizes, args.requests, args.repeats = "tiny", "1,16", 6, 1
        args.prompt_len, args.max_tokens, args.fit = 16, 8, 3
    device = setup_torch(args)
    print_header(
        "Preemption cost: recompute vs swap per block size",
        command_line("bench.preemption_cost", argv),
        device,
    )
    model_config = MODELS[args.model]
    model = build_tiny_model(seed=0, device=device, config=model_config)
    life = args.prompt_len + args.max_tokens - 1
    print(
        f"model {args.model} (hidden {model_config.hidden_size}, "
        f"{model_config.num_hidden_layers} layers); {args.requests} requests x "
        f"({args.prompt_len} prompt + {args.max_tokens} outputs); GPU pool for {args.fit} "
        f"of them; device {device}\n"
    )
    requests = [
        (
            f"r{i}",
            [(i * 37 + j) % 255 + 1 for j in range(args.prompt_len)],
            SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
        )
        for i in range(args.requests)
    ]
    rows = []
    for bs in (int(b) for b in args.block_sizes.split(",")):
        per_request = cdiv(life, bs)
        base = SchedulerConfig(
            num_gpu_blocks=per_request * args.fit,
            block_size=bs,
            max_num_batched_tokens=2048,
            max_num_seqs=args.requests,
        )
        configs = {
            "baseline": SchedulerConfig(
                num_gpu_blocks=per_request * args.requests,
                block_size=bs,
                max_num_batched_tokens=2048,
                max_num_seqs=args.requests,
            ),
            "recompute": base,
            "swap": SchedulerConfig(
                num_gpu_blocks=base.num_gpu_blocks,
                block_size=bs,
                max_num_batched_tokens=2048,
                max_num_seqs=args.requests,
                preemption_mode=PreemptionMode.SWAP,
                num_cpu_blocks=per_request * args.requests,
            ),
        }
        run_engine(model, configs["baseline"], requests[:2], device)  # warm-up
        results = {name: Measure() for name in configs}
        for _ in range(args.repeats):  # interleaved, so that load hits every mode alike
            for name, config in configs.items():
                copy_time = [0.0]
                run = run_engine(model, config, requests, device, timing_copies(copy_time, device))
                results[name].record(*run, copy_time[0])
        baseline = median(results["baseline"].wall)
        for name in ("recompute", "swap"):
            r = results[name]
            wall = median(r.wall)
            per = (wall - baseline) / r.preemptions * 1e3 if r.preemptions else float("nan")
            if r.recomputed:
                direct = prefill_ms(model, round(r.recomputed / r.preemptions), bs, device)
            else:
                direct = median(r.copy) / r.preemptions * 1e3 if r.preemptions else 0.0
            rows.append(
                [
                    bs,
                    name,
                    f"{wall:.3f}",
                    f"{baseline:.3f}",
                    r.preemptions,
                    r.recomputed,
                    f"{r.swapped[0]}/{r.swapped[1]}",
                    f"{median(r.copy) * 1e3:.1f}",
                    r.steps,
                    f"{r.recomputed / r.preemptions:.0f}" if r.recomputed else "-",
                    f"{direct:.2f}",
                    f"{per:.1f}",
                    "yes" if r.outputs == results["baseline"].outputs else "NO",
                ]
            )
        print(f"block size {bs} done", flush=True)
    print()
    print(
        markdown_table(
            [
                "block",
                "mode",
                "wall s",
                "baseline s",
                "preemptions",
                "recomputed",
                "swap out/in blocks",
                "copy ms",
                "steps",
                "recomputed/preemption",
                "direct ms/preemption",
                "extra ms/preemption",
                "= baseline",
            ],
            rows,
        )
    )
    print(
        f"\nmedian of {args.repeats} interleaved runs; extra ms/preemption = "
        "(wall - baseline) / preemptions (noisy: a difference of two wall times); "
        "= baseline: outputs equal to the run without preemption."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
