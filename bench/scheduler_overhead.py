"""Scheduler overhead: CPU time per step per running request, decode steady state.

``N`` requests (32-token prompts, ``max_tokens`` longer than the run, EOS ignored) in
a GPU pool big enough that nobody is ever preempted; once all of them decode, every
step schedules each one for one token. Measured, per running request per step (CPU
time, ``time.process_time``; median of ``--repeats`` rounds of ``--steps`` steps, the
paths interleaved round by round so that load from other processes hits them alike;
the garbage collector on, with the set-up's objects frozen out of its scans):

* ``engine step``: ``LLMEngine.step()`` with the model runner replaced by a stub that
  samples a constant token: scheduling, block manager, commit, the ``StepPlan`` and
  the metrics; everything an engine step costs except the forward pass;
* ``Scheduler.step``: the torch-free scheduler's step (schedule, commit, StepPlan);
* ``schedule+commit``: the decisions and the block manager alone (``schedule`` and
  ``commit``, without ``make_plan``: no ``StepPlan`` is built);
* ``nano-vllm-style``: a minimal reference written here (not nano-vllm's code) in the
  way nano-vllm's scheduler does a decode step: a deque of running sequences, one
  ``can_append``/``may_append`` per sequence, then a postprocess that appends the token
  and finishes sequences. Prefix-cache hashing (nano-vllm hashes each block as it
  fills) is left out, so this is a lower bound of nano-vllm's own cost;
* ``spec``: the pure reference (``spec.schedule`` + ``spec.complete_step`` with
  explicit tokens), in steps per second.

Usage: ``python -m bench.scheduler_overhead [--sizes 64,256,1024] [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from bench._common import (
    add_common_args,
    command_line,
    markdown_table,
    median,
    print_header,
    setup_torch,
)
from impl import LLMEngine
from impl.block_manager import cdiv
from impl.model_runner import ModelRunner
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from model import LlamaConfig, build_tiny_model
from spec import add_request as spec_add_request
from spec import complete_step, init_state, sampling_request_ids, schedule
from spec.types import SamplingParams, SchedulerConfig, SchedulerState

PROMPT_LEN = 32
BLOCK_SIZE = 16
TOKEN = 7
TARGET_US = 0.5

# The smallest model the engine accepts: the KV pool of a 1024-request steady state
# stays around 100 MB. The model never runs (the runner is a stub).
MICRO_MODEL = LlamaConfig(
    vocab_size=256,
    hidden_size=8,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
)


def make_config(num_requests: int, max_tokens: int) -> SchedulerConfig:
    per_request = cdiv(PROMPT_LEN + max_tokens - 1, BLOCK_SIZE)
    return SchedulerConfig(
        num_gpu_blocks=num_requests * per_request,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=max(2048, num_requests),
        max_num_seqs=num_requests,
    )


def prompt(i: int) -> list[int]:
    return [(i * 31 + j) % 255 + 1 for j in range(PROMPT_LEN)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def constant_sample(out: SchedulerOutput) -> list[int]:
    return [TOKEN] * out.num_samples


# --- our paths ------------------------------------------------------------------------


class ConstantRunner(ModelRunner):
    """The model replaced by a stub: every sampling request draws ``TOKEN``."""

    def execute(self, out: SchedulerOutput) -> list[int]:
        return [TOKEN] * out.num_samples


def decoding(scheduler: Scheduler, num_requests: int) -> bool:
    running = scheduler.running
    return len(running) == num_requests and all(
        seq.num_computed == seq.num_tokens - 1 for seq in running
    )


def engine_path(num_requests: int, max_tokens: int, device: torch.device) -> Callable[[], None]:
    model = build_tiny_model(seed=0, device=device, config=MICRO_MODEL)
    engine = LLMEngine(make_config(num_requests, max_tokens), model=model)
    engine.model_runner = ConstantRunner(model, engine.cache_engine)
    for i in range(num_requests):
        engine.add_request(f"r{i}", prompt(i), params(max_tokens))
    while not decoding(engine.scheduler, num_requests):
        engine.step()

    def run() -> None:
        engine.step()

    return run


def scheduler_paths(num_requests: int, max_tokens: int) -> tuple[Scheduler, Scheduler]:
    made = []
    for _ in range(2):
        scheduler = Scheduler(make_config(num_requests, max_tokens))
        for i in range(num_requests):
            scheduler.add_request(f"r{i}", prompt(i), params(max_tokens))
        while not decoding(scheduler, num_requests):
            scheduler.step(constant_sample)
        made.append(scheduler)
    return made[0], made[1]


def step_path(scheduler: Scheduler) -> Callable[[], None]:
    def run() -> None:
        scheduler.step(constant_sample)

    return run


def lean_path(scheduler: Scheduler) -> Callable[[], None]:
    def run() -> None:
        out = scheduler.schedule()
        scheduler.commit(out, [TOKEN] * out.num_samples)

    return run


# --- a minimal nano-vllm-style reference (written here, not copied) ---------------------


class NanoSequence:
    __slots__ = (
        "block_table",
        "finished",
        "ignore_eos",
        "last_token",
        "max_tokens",
        "num_prompt_tokens",
        "num_tokens",
        "token_ids",
    )

    def __init__(self, token_ids: list[int], max_tokens: int) -> None:
        self.token_ids = list(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.max_tokens = max_tokens
        self.ignore_eos = True
        self.block_table: list[int] = []
        self.finished = False

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


class NanoBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _take(self) -> int:
        block = self.free_block_ids.popleft()
        self.used_block_ids.add(block)
        return block

    def can_allocate(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= cdiv(len(seq), self.block_size)

    def allocate(self, seq: NanoSequence) -> None:
        for _ in range(cdiv(len(seq), self.block_size)):
            seq.block_table.append(self._take())

    def can_append(self, seq: NanoSequence) -> bool:
        # A new block is needed when the token to write starts one.
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: NanoSequence) -> None:
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._take())

    def deallocate(self, seq: NanoSequence) -> None:
        for block in reversed(seq.block_table):
            self.used_block_ids.remove(block)
            self.free_block_ids.append(block)
        seq.block_table.clear()


class NanoScheduler:
    def __init__(self, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = NanoBlockManager(num_blocks, BLOCK_SIZE)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[NanoSequence] = deque()
        self.running: deque[NanoSequence] = deque()
        self.eos = -1

    def schedule(self) -> list[NanoSequence]:
        scheduled: list[NanoSequence] = []
        num_seqs = 0
        num_tokens = 0
        while self.waiting and num_seqs < self.max_num_seqs:  # prefill first
            seq = self.waiting[0]
            if num_tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            num_seqs += 1
            self.block_manager.allocate(seq)
            num_tokens += len(seq)
            self.running.append(self.waiting.popleft())
            scheduled.append(seq)
        if scheduled:
            return scheduled
        while self.running and num_seqs < self.max_num_seqs:  # then decode
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                num_seqs += 1
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def preempt(self, seq: NanoSequence) -> None:
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[NanoSequence], token_ids: list[int]) -> None:
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.append_token(token_id)
            if (not seq.ignore_eos and token_id == self.eos) or (
                seq.num_completion_tokens == seq.max_tokens
            ):
                seq.finished = True
                self.block_manager.deallocate(seq)
                self.running.remove(seq)


def nano_path(num_requests: int, max_tokens: int) -> Callable[[], None]:
    config = make_config(num_requests, max_tokens)
    nano = NanoScheduler(config.num_gpu_blocks, config.max_num_seqs, config.max_num_batched_tokens)
    for i in range(num_requests):
        nano.waiting.append(NanoSequence(prompt(i), max_tokens))

    def run() -> None:
        seqs = nano.schedule()
        nano.postprocess(seqs, [TOKEN] * len(seqs))

    while nano.waiting:
        run()
    return run


# --- the spec ----------------------------------------------------------------------------


class SpecRun:
    def __init__(self, num_requests: int, max_tokens: int) -> None:
        state = init_state(make_config(num_requests, max_tokens))
        for i in range(num_requests):
            state = spec_add_request(state, f"r{i}", prompt(i), params(max_tokens))
        self.state: SchedulerState = state
        while state.waiting or any(
            r.num_computed_tokens < r.num_tokens - 1 for r in self.state.running
        ):
            self.step()
            state = self.state

    def step(self) -> None:
        mid, plan = schedule(self.state)
        tokens = dict.fromkeys(sampling_request_ids(mid, plan), TOKEN)
        self.state, _ = complete_step(mid, plan, tokens)


# --- measurement --------------------------------------------------------------------------


def time_block(run: Callable[[], None], steps: int) -> float:
    """CPU seconds for ``steps`` calls of ``run``."""
    start = time.process_time()
    for _ in range(steps):
        run()
    return time.process_time() - start


def measure(
    num_requests: int, steps: int, repeats: int, spec_steps: int, device: torch.device
) -> dict[str, list[float]]:
    """Per path, the CPU microseconds per running request per step of each round."""
    max_tokens = repeats * steps + 200 + cdiv(num_requests * PROMPT_LEN, 2048)
    sched_a, sched_b = scheduler_paths(num_requests, max_tokens)
    paths: dict[str, Callable[[], None]] = {
        "engine step": engine_path(num_requests, max_tokens, device),
        "Scheduler.step": step_path(sched_a),
        "schedule+commit": lean_path(sched_b),
        "nano-vllm-style": nano_path(num_requests, max_tokens),
    }
    per_round: dict[str, list[float]] = {name: [] for name in [*paths, "spec"]}
    # The garbage collector stays on, but what the set-up built is frozen out of its
    # scans, so that one path's live objects do not slow another path's collections.
    gc.collect()
    gc.freeze()
    try:
        for _ in range(repeats):
            for name, run in paths.items():
                seconds = time_block(run, steps)
                per_round[name].append(seconds / steps / num_requests * 1e6)
        del paths, sched_a, sched_b
        gc.unfreeze()
        gc.collect()
        spec = SpecRun(num_requests, repeats * spec_steps + 50)
        gc.freeze()
        for _ in range(repeats):
            seconds = time_block(spec.step, spec_steps)
            per_round["spec"].append(seconds / spec_steps / num_requests * 1e6)
    finally:
        gc.unfreeze()
    return per_round


def parse_sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, repeats=7)
    parser.add_argument("--sizes", default="64,256,1024", help="running requests (64,256,1024)")
    parser.add_argument("--steps", type=int, default=200, help="steps per timed round (200)")
    parser.add_argument(
        "--spec-steps", type=int, default=20, help="spec steps per timed round (20)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.spec_steps, args.repeats = "8,32", 5, 2, 2
    device = setup_torch(args)
    print_header(
        "Scheduler overhead (decode steady state, CPU time)",
        command_line("bench.scheduler_overhead", argv),
        device,
    )
    rows = []
    for n in parse_sizes(args.sizes):
        result = measure(n, args.steps, args.repeats, args.spec_steps, device)
        med = {name: median(values) for name, values in result.items()}
        nano = med["nano-vllm-style"]
        rows.append(
            [
                n,
                *(
                    f"{med[name]:.3f}"
                    for name in ("engine step", "Scheduler.step", "schedule+commit")
                ),
                f"{nano:.3f}",
                f"{med['engine step'] / nano:.2f}",
                f"{med['schedule+commit'] / nano:.2f}",
                f"{med['spec']:.2f}",
                f"{1e6 / (med['spec'] * n):,.0f}",
            ]
        )
        print(
            f"N={n}: rounds (us/request-step) "
            + "; ".join(f"{name} {min(v):.3f}..{max(v):.3f}" for name, v in result.items()),
            flush=True,
        )
    print()
    print(
        markdown_table(
            [
                "running",
                "engine step us",
                "Scheduler.step us",
                "schedule+commit us",
                "nano-vllm-style us",
                "engine/nano",
                "sched+commit/nano",
                "spec us",
                "spec steps/s",
            ],
            rows,
        )
    )
    print()
    print(
        f"us = CPU microseconds per running request per step (median of {args.repeats} rounds "
        f"of {args.steps} steps; spec: {args.spec_steps} steps). Target: <= {TARGET_US} us at "
        "256 and 1024 running."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
