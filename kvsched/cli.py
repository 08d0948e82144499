"""``kvsched``: argument parsing and dispatch to the subcommands.

Exit codes: 0 success; 2 bad input to the command line itself (options, workload
file, checkpoint, device), reported as one line on stderr without a traceback; 1
``conform`` found a divergence, or the engine raised one of the project's typed
errors on good input (it failed to drain, sampled the wrong tokens ...), also one
line. Only the project's typed errors and ``OSError`` are caught here: anything else
is a bug and tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from kvsched import argtypes, conform, demo, engine_options, report
from kvsched.engine_protocol import Engine
from kvsched.errors import CLIInputError
from kvsched.peers import PEERS, SchedulerUnderTest, common_eos, make_peer
from kvsched.peers.lockstep import describe_states
from kvsched.peers.ours import EngineAdapter
from kvsched.plot import plot_timeline
from kvsched.progress import RunProgress
from kvsched.runner import run_reference, run_workload
from kvsched.summary import render_summary
from kvsched.workload import (
    GeneratorSettings,
    WorkloadRequest,
    dump_workload,
    generate_workload,
    read_workload,
)
from model import LlamaForCausalLM
from spec.types import ConfigError, KVSchedError, SchedulerConfig

PROG = "kvsched"
WORKLOAD_HELP = (
    "one JSON request per line: id, prompt (token ids), max_tokens; optional "
    "eos_token_id, ignore_eos, priority, temperature, seed, arrival_step (the engine "
    "step at which it is added; default 0)"
)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: ``kvsched run: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_workload_parser(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    p = sub.add_parser(
        "workload",
        help="write a random JSONL workload (deterministic from --seed)",
        description="Write a random workload, one JSON request per line. Distributions: "
        "N (constant), MIN:MAX or uniform:MIN:MAX (uniform, inclusive), "
        "longtail:MIN:MAX[:ALPHA] (bounded Pareto: mostly short, a few long).",
    )
    p.add_argument("--num-requests", type=argtypes.non_negative_int, default=16, metavar="N")
    p.add_argument("--seed", type=argtypes.any_int, default=0, metavar="S")
    p.add_argument(
        "--prompt-len",
        type=argtypes.distribution(1),
        default="4:32",
        metavar="DIST",
        help="prompt length distribution (default 4:32)",
    )
    p.add_argument(
        "--max-tokens",
        type=argtypes.distribution(1),
        default="longtail:4:64",
        metavar="DIST",
        help="max_tokens distribution (default longtail:4:64)",
    )
    p.add_argument(
        "--arrival-spread",
        type=argtypes.non_negative_int,
        default=0,
        metavar="STEPS",
        help="arrival steps are uniform over 0..STEPS (default 0: all at once)",
    )
    p.add_argument("--vocab-size", type=argtypes.int_at_least(2), default=256, metavar="V")
    p.add_argument(
        "--priority",
        type=argtypes.distribution(-(2**31)),
        default="0",
        metavar="DIST",
        help="priority distribution (lower is more important; default 0)",
    )
    p.add_argument("--eos-token-id", type=argtypes.non_negative_int, default=None, metavar="T")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=argtypes.non_negative_float, default=0.0)
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.set_defaults(handler=cmd_workload)


def _add_run_parser(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run a workload through the engine",
        description="Run a JSONL workload through the engine and summarize it.",
    )
    p.add_argument("workload", metavar="WORKLOAD.jsonl", help=WORKLOAD_HELP)
    p.add_argument(
        "--reference",
        action="store_true",
        help="run each request alone with an unbounded KV cache (the ground-truth outputs)",
    )
    p.add_argument("--json", action="store_true", help="print the JSON document on stdout")
    p.add_argument("--plot", metavar="FILE.png", help="draw the KV-cache timeline")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    engine_options.add_engine_options(p)
    p.set_defaults(handler=cmd_run)


def _add_conform_parser(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    p = sub.add_parser(
        "conform",
        help="drive the spec and the engine in lockstep and compare every step",
        description="Drive the reference scheduler and the engine in lockstep on a "
        "workload; exit 0 if every plan and state agree, 1 at the first divergence.",
    )
    p.add_argument("workload", metavar="WORKLOAD.jsonl", help=WORKLOAD_HELP)
    p.add_argument(
        "--engine",
        choices=("kvsched", *PEERS),
        default="kvsched",
        help="the scheduler held to the spec: our engine (default), or vLLM V1's or "
        "nano-vllm's real scheduler (install them with scripts/install_peers)",
    )
    p.add_argument(
        "--oracle-vocab",
        type=argtypes.positive_int,
        default=256,
        metavar="N",
        help="a peer samples with a pure toy oracle over N tokens (default 256); "
        "a small N makes EOS frequent",
    )
    p.add_argument(
        "--show-states",
        action="store_true",
        help="at a divergence, also print both states (the spec's and the engine's)",
    )
    engine_options.add_engine_options(p)
    p.set_defaults(handler=cmd_conform)


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description="A formally specified LLM-inference scheduler with differential testing.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="the seed tutorial's demo: preemption vs running out of KV cache",
        description="The seed tutorial's workload through the no-preemption engine and "
        "through the preemption engine in every mode.",
    )
    demo.set_defaults(handler=cmd_demo)
    _add_workload_parser(sub)
    _add_run_parser(sub)
    _add_conform_parser(sub)
    return parser


# --- handlers -------------------------------------------------------------------------


def cmd_workload(args: argparse.Namespace) -> int:
    settings = GeneratorSettings(
        num_requests=args.num_requests,
        seed=args.seed,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        arrival_spread=args.arrival_spread,
        vocab_size=args.vocab_size,
        priority=args.priority,
        eos_token_id=args.eos_token_id,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
    )
    requests = generate_workload(settings)
    if args.output is None:
        dump_workload(requests, sys.stdout)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            dump_workload(requests, f)
    return 0


def _read_inputs(
    args: argparse.Namespace,
) -> tuple[list[WorkloadRequest], SchedulerConfig, LlamaForCausalLM]:
    """The workload, the config and the model, checked in that order (cheapest first)."""
    workload = read_workload(args.workload)
    config = engine_options.scheduler_config(args)
    return workload, config, engine_options.load_model(args)


def cmd_run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        if args.reference:
            raise CLIInputError("--plot draws a shared run's timeline; not with --reference")
        parent = Path(args.plot).parent
        if not parent.is_dir():
            raise CLIInputError(f"--plot {args.plot}: directory {parent} does not exist")
    workload, config, model = _read_inputs(args)

    def factory(c: SchedulerConfig) -> Engine:
        return engine_options.make_engine(c, args, model)

    enabled = RunProgress.wanted(quiet=args.quiet)
    with RunProgress(len(workload), enabled=enabled) as bar:
        if args.reference:
            result = run_reference(factory, config, workload, on_step=bar.update)
        else:
            result = run_workload(factory(config), config, workload, on_step=bar.update)
    if args.plot is not None:
        plot_timeline(result, args.plot, title=f"kvsched run {Path(args.workload).name}")
    if args.json:
        print(report.dumps(result))
    else:
        print(render_summary(result, title="reference" if args.reference else "run"))
    return 0


def cmd_conform(args: argparse.Namespace) -> int:
    peer: SchedulerUnderTest
    if args.engine == "kvsched":
        workload, config, model = _read_inputs(args)
        peer = EngineAdapter(engine_options.make_engine(config, args, model))
    else:
        workload = read_workload(args.workload)
        config = engine_options.scheduler_config(args)
        eos = common_eos(r.params for r in workload) if args.engine == "nano-vllm" else None
        peer = make_peer(args.engine, config, eos_token_id=eos)
    result = conform.conform(peer, config, workload, oracle_vocab=args.oracle_vocab)
    print(conform.render(result, config, args.engine))
    if args.show_states and result.divergence is not None:
        print(describe_states(result.divergence))
    return 0 if result.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    demo.main(sys.stdout)
    return 0


def _describe_os_error(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed as one line
        return e.code if isinstance(e.code, int) else 2
    try:
        code: int = args.handler(args)
    except (CLIInputError, ConfigError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{PROG}: {_describe_os_error(e)}", file=sys.stderr)
        return 2
    except KVSchedError as e:  # the engine failed on good input: a bug, not bad input
        print(f"{PROG}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return code
