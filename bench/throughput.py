"""Engine throughput against ``transformers`` on the same tiny Llama weights.

A tiny random Llama is built with ``transformers`` (vocabulary 256, hidden 64, 2
layers, GQA 4/2), saved as safetensors in a temporary directory, and loaded into our
engine with ``model.load_hf_checkpoint``. Both sides then run the same greedy
workloads: ``N`` requests with prompt lengths drawn from ``--prompt-len`` and
``max_tokens`` from ``--max-tokens`` (no EOS id anywhere, so every request produces
exactly its ``max_tokens`` outputs).

Rows:

* ``kvsched``: ``LLMEngine.generate`` (batch-invariant model, the default), and
  ``batch_invariant=False``. Settings: block 16, ``max_num_batched_tokens`` 2048,
  ``max_num_seqs`` 256, a GPU pool that holds every request at once (no preemption).
* ``HF generate_batch``: transformers' continuous batching, through the manager that
  ``generate_batch`` wraps (``continuous_batching_context_manager`` + ``add_request``
  with each request's own ``max_new_tokens``; ``generate_batch`` itself takes a single
  ``max_new_tokens``). Same page size, pool, token budget and batch cap as ours.
* ``HF generate_batch()``: the literal call, with ``max_new_tokens`` = the largest
  ``max_tokens`` for every request (outputs truncated to each request's own);
  ``--hf-literal``, default on for workloads up to 64 requests.
* ``HF generate``: plain ``generate`` on static left-padded batches of
  ``--hf-batch`` (``max_new_tokens`` = the batch's largest, outputs truncated), and
  one request at a time (``--hf-solo``, default on for workloads up to 64 requests).

Columns: ``useful tok/s`` is the workload's output tokens (sum of ``max_tokens``)
over the wall time of the whole call (engine or manager construction included, model
loading not); ``loop tok/s`` the same over the generation loop alone (ours:
``generate()``; HF CB: first ``add_request`` to last result). ``generated`` counts
tokens actually produced (static batches and the literal ``generate_batch`` call
produce extra ones that are thrown away). Every row is the median of ``--repeats``
runs; before the first, each engine runs a 4-request warm-up workload (not timed).
``mismatches`` compares each request's
token list with our batch-invariant engine's; each mismatch is examined in float64
(the gap between the two candidate tokens' logits at the first divergence), so a
near-tie can be told from a bug.

Usage: ``python -m bench.throughput [--sizes 32,256] [--dtype float32] [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench._common import (
    add_common_args,
    command_line,
    markdown_table,
    median,
    print_header,
    setup_torch,
    sync,
)
from bench._hf import save_tiny_hf_llama, transformers_module, transformers_version
from impl import LLMEngine
from impl.block_manager import cdiv
from model import LlamaForCausalLM, load_hf_checkpoint, resolve_dtype
from spec.types import SamplingParams, SchedulerConfig

BLOCK_SIZE = 16
TARGET_RATIO = 3.0


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)


def mixed_workload(
    n: int, *, seed: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int], vocab: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    return Workload(
        name=f"mixed-{n}",
        prompts=prompts,
        max_tokens=[rng.randint(*max_tokens) for _ in range(n)],
    )


@dataclass
class Result:
    name: str
    e2e_s: list[float] = field(default_factory=list)
    loop_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    generated: int = 0
    note: str = ""


def pool_blocks(workload: Workload) -> int:
    """GPU blocks that hold every request's whole life at once."""
    return sum(
        cdiv(len(p) + m - 1, BLOCK_SIZE)
        for p, m in zip(workload.prompts, workload.max_tokens, strict=True)
    )


def repeat(
    result: Result, repeats: int, once: Callable[[], tuple[float, float, list[list[int]], int]]
) -> Result:
    for _ in range(repeats):
        e2e, loop, outputs, generated = once()
        result.e2e_s.append(e2e)
        result.loop_s.append(loop)
        result.outputs, result.generated = outputs, generated
    return result


# --- our engine ----------------------------------------------------------------------


def run_ours(
    name: str, model: LlamaForCausalLM, workload: Workload, repeats: int, device: torch.device
) -> Result:
    config = SchedulerConfig(
        num_gpu_blocks=pool_blocks(workload),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
    )
    requests = [
        (f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True))
        for i, (p, m) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True))
    ]

    def once() -> tuple[float, float, list[list[int]], int]:
        sync(device)
        start = time.perf_counter()
        engine = LLMEngine(config, model=model)
        loop_start = time.perf_counter()
        finished = engine.generate(requests)
        sync(device)
        end = time.perf_counter()
        outputs = [list(f.output_token_ids) for f in finished]
        return end - start, end - loop_start, outputs, engine.metrics.generated_tokens

    return repeat(Result(name), repeats, once)


# --- transformers --------------------------------------------------------------------


# transformers may switch continuous batching to flash attention, fetching a kernel
# from the Hub when the package is missing; ``--hf-attn sdpa`` (the default) keeps the
# model's own SDPA attention so that no run depends on the network.
AUTO_SWITCH_TO_FLASH = False


def cb_config(workload: Workload, *, auto: bool) -> Any:
    transformers = transformers_module()
    config_cls = transformers.generation.configuration_utils.ContinuousBatchingConfig
    if auto:
        return config_cls(auto_switch_to_flash=AUTO_SWITCH_TO_FLASH)
    return config_cls(
        page_size=BLOCK_SIZE,
        num_blocks=pool_blocks(workload),
        max_batch_tokens=2048,
        max_requests_per_batch=256,
        auto_switch_to_flash=AUTO_SWITCH_TO_FLASH,
    )


def greedy_config(max_new_tokens: int) -> Any:
    transformers = transformers_module()
    return transformers.GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max_new_tokens
    )


def run_hf_cb(name: str, hf: Any, workload: Workload, repeats: int, *, auto_config: bool) -> Result:
    n = len(workload.prompts)

    def once() -> tuple[float, float, list[list[int]], int]:
        results: dict[str, Any] = {}
        start = time.perf_counter()
        with hf.continuous_batching_context_manager(
            generation_config=greedy_config(max(workload.max_tokens)),
            continuous_batching_config=cb_config(workload, auto=auto_config),
            block=True,
            timeout=30,
        ) as manager:
            loop_start = time.perf_counter()
            for i, (prompt, m) in enumerate(
                zip(workload.prompts, workload.max_tokens, strict=True)
            ):
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
            while len(results) < n:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' generation thread died")
                    continue
                if result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"{result.request_id}: {result.error}")
                    results[result.request_id] = result
            loop_end = time.perf_counter()
        end = time.perf_counter()
        outputs = [list(results[f"r{i}"].generated_tokens) for i in range(n)]
        return end - start, loop_end - loop_start, outputs, sum(map(len, outputs))

    return repeat(Result(name), repeats, once)


def run_hf_generate_batch(name: str, hf: Any, workload: Workload, repeats: int) -> Result:
    longest = max(workload.max_tokens)

    def once() -> tuple[float, float, list[list[int]], int]:
        start = time.perf_counter()
        out = hf.generate_batch(
            workload.prompts,
            generation_config=greedy_config(longest),
            continuous_batching_config=cb_config(workload, auto=False),
        )
        end = time.perf_counter()
        full = [list(r.generated_tokens) for r in out.values()]
        outputs = [o[:m] for o, m in zip(full, workload.max_tokens, strict=True)]
        return end - start, end - start, outputs, sum(map(len, full))

    result = repeat(Result(name), repeats, once)
    result.note = f"max_new_tokens={longest} for all"
    return result


def run_hf_generate(
    name: str, hf: Any, workload: Workload, repeats: int, *, batch: int, device: torch.device
) -> Result:
    def once() -> tuple[float, float, list[list[int]], int]:
        outputs: list[list[int]] = []
        generated = 0
        sync(device)
        start = time.perf_counter()
        for first in range(0, len(workload.prompts), batch):
            prompts = workload.prompts[first : first + batch]
            wanted = workload.max_tokens[first : first + batch]
            width = max(map(len, prompts))
            ids = torch.zeros((len(prompts), width), dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for row, p in enumerate(prompts):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = hf.generate(
                    ids.to(device),
                    attention_mask=mask.to(device),
                    generation_config=greedy_config(max(wanted)),
                )
            new = out[:, width:].tolist()
            generated += sum(map(len, new))
            outputs.extend(o[:m] for o, m in zip(new, wanted, strict=True))
        sync(device)
        elapsed = time.perf_counter() - start
        return elapsed, elapsed, outputs, generated

    result = repeat(Result(name), repeats, once)
    result.note = "left-padded static batches" if batch > 1 else "one request at a time"
    return result


# --- checking ------------------------------------------------------------------------


def mismatch_lines(
    result: Result, reference: Result, workload: Workload, hf64: Any, limit: int = 5
) -> tuple[int, list[str]]:
    """How many requests differ from ``reference``, and a float64 look at a few."""
    lines: list[str] = []
    count = 0
    for i, (ours, theirs) in enumerate(zip(reference.outputs, result.outputs, strict=True)):
        if ours == theirs:
            continue
        count += 1
        if len(lines) >= limit:
            continue
        k = next(
            (j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        if k >= min(len(ours), len(theirs)):
            lines.append(f"  r{i}: lengths differ ({len(ours)} vs {len(theirs)})")
            continue
        prefix = torch.tensor([workload.prompts[i] + ours[:k]])
        with torch.no_grad():
            logits = hf64(prefix).logits[0, -1]
        gap = float(logits[ours[k]] - logits[theirs[k]])
        top2 = logits.topk(2).values
        lines.append(
            f"  r{i} output {k}: {reference.name} {ours[k]}, {result.name} {theirs[k]}; "
            f"float64 logit gap {gap:+.3g} (top-2 gap {float(top2[0] - top2[1]):.3g})"
        )
    return count, lines


def enabled(choice: str, size: int) -> bool:
    return choice == "on" or (choice == "auto" and size <= 64)


def run_all(
    args: argparse.Namespace,
    workload: Workload,
    *,
    ours_bi: LlamaForCausalLM,
    ours_fast: LlamaForCausalLM,
    hf: Any,
    device: torch.device,
) -> list[Result]:
    """Every row of the table on ``workload``; the first is the reference."""
    size, repeats = len(workload.prompts), int(args.repeats)
    results = [
        run_ours("kvsched (batch-invariant)", ours_bi, workload, repeats, device),
        run_ours("kvsched (batch_invariant=False)", ours_fast, workload, repeats, device),
        run_hf_cb("HF generate_batch (CB manager)", hf, workload, repeats, auto_config=False),
    ]
    if enabled(args.hf_literal, size):
        results.append(run_hf_generate_batch("HF generate_batch()", hf, workload, repeats))
    results.append(
        run_hf_generate(
            f"HF generate (batch {args.hf_batch})",
            hf,
            workload,
            repeats,
            batch=args.hf_batch,
            device=device,
        )
    )
    if args.hf_auto_config:
        cb = run_hf_cb("HF CB (auto config)", hf, workload, repeats, auto_config=True)
        cb.note = "cache and budget sized by transformers"
        results.append(cb)
    if enabled(args.hf_solo, size):
        results.append(
            run_hf_generate("HF generate (solo)", hf, workload, 1, batch=1, device=device)
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=3)
    parser.add_argument("--sizes", default="32,256", help="requests per workload (32,256)")
    parser.add_argument("--dtype", default="float32", help="float32 (default) or float64")
    parser.add_argument("--prompt-len", default="16,256", help="prompt length range (16,256)")
    parser.add_argument("--max-tokens", default="16,128", help="max_tokens range (16,128)")
    parser.add_argument("--hf-batch", type=int, default=32, help="static batch of HF generate")
    parser.add_argument(
        "--hf-solo",
        choices=("auto", "on", "off"),
        default="auto",
        help="also run HF generate one request at a time (auto: up to 64 requests)",
    )
    parser.add_argument(
        "--hf-literal",
        choices=("auto", "on", "off"),
        default="auto",
        help="also time the literal generate_batch() call (auto: up to 64 requests)",
    )
    parser.add_argument(
        "--hf-auto-config",
        action="store_true",
        help="also run HF continuous batching with its own auto-sized cache and budget",
    )
    parser.add_argument(
        "--hf-attn",
        choices=("sdpa", "auto"),
        default="sdpa",
        help="HF continuous batching attention: the model's SDPA (default) or let "
        "transformers switch to flash attention when it can",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    global AUTO_SWITCH_TO_FLASH  # noqa: PLW0603 (a run-wide choice)
    AUTO_SWITCH_TO_FLASH = args.hf_attn == "auto"
    prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
    max_tokens = tuple(int(x) for x in args.max_tokens.split(","))
    if args.quick:
        args.sizes, args.repeats, args.hf_solo, args.hf_literal = "4", 1, "on", "on"
        prompt_len, max_tokens = (4, 12), (2, 6)
    device = setup_torch(args)
    dtype = resolve_dtype(args.dtype)
    print_header(
        "Engine throughput vs transformers", command_line("bench.throughput", argv), device
    )
    print(
        f"transformers {transformers_version()}, dtype {dtype}, device {device}, "
        f"HF continuous-batching attention: {args.hf_attn}"
    )

    warm = mixed_workload(4, seed=args.seed, prompt_len=(4, 12), max_tokens=(2, 6), vocab=256)
    with tempfile.TemporaryDirectory() as tmp:
        hf_cpu = save_tiny_hf_llama(Path(tmp), seed=args.seed)
        ours_bi = load_hf_checkpoint(tmp, dtype=dtype, device=device, batch_invariant=True)
        ours_fast = load_hf_checkpoint(tmp, dtype=dtype, device=device, batch_invariant=False)
    hf64 = copy.deepcopy(hf_cpu).to(torch.float64)
    hf = hf_cpu.to(device=device, dtype=dtype)
    vocab = int(hf.config.vocab_size)
    wanted = argparse.Namespace(**{**vars(args), "repeats": 1, "hf_auto_config": False})
    if not args.quick:
        run_all(
            wanted, warm, ours_bi=ours_bi, ours_fast=ours_fast, hf=hf, device=device
        )  # warm-up, not timed

    for size in (int(s) for s in args.sizes.split(",")):
        workload = mixed_workload(
            size,
            seed=args.seed + size,
            prompt_len=(prompt_len[0], prompt_len[1]),
            max_tokens=(max_tokens[0], max_tokens[1]),
            vocab=vocab,
        )
        lens = [len(p) for p in workload.prompts]
        print(
            f"\n## {workload.name}: prompts {min(lens)}..{max(lens)} tokens "
            f"(total {sum(lens)}), max_tokens {min(workload.max_tokens)}.."
            f"{max(workload.max_tokens)} (total {workload.useful_tokens})",
            flush=True,
        )
        results = run_all(
            args, workload, ours_bi=ours_bi, ours_fast=ours_fast, hf=hf, device=device
        )
        reference = results[0]
        cb_e2e = median(results[2].e2e_s)
        cb_loop = median(results[2].loop_s)
        rows = []
        details: list[str] = []
        for result in results:
            e2e, loop = median(result.e2e_s), median(result.loop_s)
            count, lines = mismatch_lines(result, reference, workload, hf64)
            details.extend(
                [f"{result.name}: {count} mismatching requests", *lines] if count else []
            )
            rows.append(
                [
                    result.name,
                    f"{workload.useful_tokens / e2e:,.0f}",
                    f"{workload.useful_tokens / loop:,.0f}",
                    f"{e2e:.3f}",
                    f"{cb_e2e / e2e:.2f}x",
                    f"{cb_loop / loop:.2f}x",
                    result.generated,
                    f"{count}/{size}",
                    result.note,
                ]
            )
        print(
            markdown_table(
                [
                    "engine",
                    "useful tok/s",
                    "loop tok/s",
                    "wall s",
                    "vs CB (wall)",
                    "vs CB (loop)",
                    "generated",
                    "mismatches",
                    "note",
                ],
                rows,
            )
        )
        for line in details:
            print(line)
    print(
        f"\nmedian of {args.repeats} runs (solo: 1) after a warm-up; target: kvsched >= "
        f"{TARGET_RATIO:g}x HF generate_batch. mismatches: requests whose tokens differ from "
        "kvsched (batch-invariant)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
