"""``kvsched``: argument parsing and dispatch to the subcommands.

Every input is checked before any work (docs/cli.md has the table of bad inputs and
their answers): the workload file, the options, the output paths (``-o``,
``--plot``), the checkpoint, and the KV pools against the memory free. Results are
printed before ``--plot`` is drawn, so a failure there cannot lose a finished run.

Exit codes: 0 success; 2 bad input to the command line itself (options, workload
file, output path, checkpoint, device), reported as one line on stderr without a
traceback (bare ``kvsched`` prints the list of commands, also with 2); 1
``conform`` found a divergence, or the engine raised one of the project's typed
errors on good input (it failed to drain, sampled the wrong tokens ...), also one
line. Only the project's typed errors and ``OSError`` are caught here: anything else
is a bug and tracebacks.
"""

from __future__ import annotations

import argparse
import io
import shlex
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import NoReturn

from kvsched import argtypes, conform, demo, engine_options, report
from kvsched.engine_protocol import Engine
from kvsched.errors import CLIInputError
from kvsched.peers import (
    PEERS,
    PROFILES,
    SchedulerUnderTest,
    common_eos,
    make_peer,
    peer_python,
    peer_version,
    registry,
    repro,
)
from kvsched.peers.lockstep import describe_states
from kvsched.peers.ours import EngineAdapter
from kvsched.peers.registry import PeerVersion
from kvsched.peers.remote import RemotePeer
from kvsched.peers.server import run_script
from kvsched.plot import PLOT_FORMATS, plot_timeline
from kvsched.progress import PROG, CommandProgress, notice, wanted, warn
from kvsched.runner import run_reference, run_workload
from kvsched.summary import render_summary
from kvsched.workload import (
    MAX_ARRIVAL_STEP,
    GeneratorSettings,
    WorkloadRequest,
    dump_workload,
    generate_workload,
    read_workload,
)
from model import LlamaForCausalLM
from spec.types import ConfigError, KVSchedError, PreemptionMode, SchedulerConfig

# What ``kvsched workload`` may write: enough for any benchmark here, small enough to
# finish in seconds rather than fill the disk.
MAX_GENERATED_REQUESTS = 1_000_000
MAX_GENERATED_PROMPT_TOKENS = 100_000_000
WORKLOAD_HELP = (
    "one JSON request per line: id, prompt (token ids), max_tokens; optional "
    "eos_token_id, ignore_eos, priority, temperature, seed, arrival_step (the engine "
    "step at which it is added; default 0)"
)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: ``kvsched run: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _version() -> str:
    try:
        return version("kvsched")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _quiet_option() -> OneLineParser:
    parent = OneLineParser(add_help=False)
    parent.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar and no 'wrote ...' notices"
    )
    return parent


def _distribution_option(
    parser: OneLineParser, flag: str, low: int, default: str, what: str, *, note: str = ""
) -> None:
    """``flag DIST``: a distribution of integers >= ``low``; the help ends with the default."""
    parser.add_argument(
        flag,
        type=argtypes.distribution(low),
        default=default,
        metavar="DIST",
        help=f"{what} ({note}default {default})",
    )


def _add_workload_parser(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    p = sub.add_parser(
        "workload",
        parents=[_quiet_option()],
        help="write a random JSONL workload (deterministic from --seed)",
        description="Write a random workload, one JSON request per line. Distributions: "
        "N (constant), MIN:MAX or uniform:MIN:MAX (uniform, inclusive), "
        "longtail:MIN:MAX[:ALPHA] (bounded Pareto: mostly short, a few long).",
    )
    p.add_argument(
        "--num-requests",
        type=argtypes.non_negative_int,
        default=16,
        metavar="N",
        help=f"(default 16, at most {MAX_GENERATED_REQUESTS:,})",
    )
    p.add_argument("--seed", type=argtypes.any_int, default=0, metavar="S")
    _distribution_option(p, "--prompt-len", 1, "4:32", "prompt length distribution")
    _distribution_option(p, "--max-tokens", 1, "longtail:4:64", "max_tokens distribution")
    p.add_argument(
        "--arrival-spread",
        type=argtypes.non_negative_int,
        default=0,
        metavar="STEPS",
        help=f"arrival steps are uniform over 0..STEPS (default 0: all at once; "
        f"at most {MAX_ARRIVAL_STEP:,})",
    )
    p.add_argument("--vocab-size", type=argtypes.int_at_least(2), default=256, metavar="V")
    p.add_argument(
        "--shared-prefix",
        type=argtypes.non_negative_int,
        default=0,
        metavar="LEN",
        help="every prompt starts with a system prompt of LEN tokens, then its own "
        "--prompt-len tokens (default 0: no shared prefix)",
    )
    p.add_argument(
        "--num-system-prompts",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="distinct system prompts for --shared-prefix, request i gets i mod N (default 1)",
    )
    _distribution_option(
        p, "--priority", -(2**31), "0", "priority distribution", note="lower is more important; "
    )
    p.add_argument("--eos-token-id", type=argtypes.non_negative_int, default=None, metavar="T")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=argtypes.non_negative_float, default=0.0)
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.set_defaults(handler=cmd_workload)


def _add_run_parser(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    p = sub.add_parser(
        "run",
        parents=[_quiet_option()],
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
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help=f"draw the KV-cache timeline ({', '.join('.' + f for f in PLOT_FORMATS)})",
    )
    engine_options.add_engine_options(p)
    p.set_defaults(handler=cmd_run)


def _add_conform_parser(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    p = sub.add_parser(
        "conform",
        parents=[_quiet_option()],
        help="drive the spec and the engine in lockstep and compare every step",
        description="Drive the reference scheduler and the engine in lockstep on a "
        "workload; exit 0 if every plan and state agree, 1 at the first divergence.",
    )
    p.add_argument("workload", metavar="WORKLOAD.jsonl", help=WORKLOAD_HELP)
    p.add_argument(
        "--engine",
        choices=("kvsched", *PEERS),
        default="kvsched",
        help="the scheduler held to the spec: our engine (default), or vLLM V1's, "
        "nano-vllm's or vLLM V0's real scheduler (install them with scripts/install_peers; "
        "vLLM V0 in its own environment: scripts/install_peers --venv vllm-v0)",
    )
    p.add_argument(
        "--peer-python",
        metavar="PATH",
        default=None,
        help="run the peer in another Python environment, the one of this interpreter "
        "(docs/peers.md; default: the peer's own environment where install_peers made one, "
        "else this process)",
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
        "--emit-repro",
        metavar="FILE.py",
        default=None,
        help="at a divergence with a peer, shrink the workload and write a standalone script "
        "that drives only the peer and fails with the violated property (docs/peers.md)",
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
        epilog="Start with 'kvsched demo'; 'kvsched COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = sub.add_parser(
        "demo",
        parents=[_quiet_option()],
        help="the seed tutorial's demo: preemption vs running out of KV cache",
        description="The seed tutorial's workload through the no-preemption engine and "
        "through the preemption engine in every mode.",
    )
    engine_options.add_threads_option(demo_parser)
    demo_parser.set_defaults(handler=cmd_demo)
    _add_workload_parser(sub)
    _add_run_parser(sub)
    _add_conform_parser(sub)
    return parser


# --- handlers -------------------------------------------------------------------------


def check_output_path(option: str, path: str, *, formats: Sequence[str] | None = None) -> None:
    """Refuse an output file that cannot be written, before any work is done."""
    target = Path(path)
    if formats is not None and target.suffix.lower().lstrip(".") not in formats:
        known = ", ".join("." + f for f in formats)
        raise CLIInputError(
            f"{option} {path}: unsupported file type {target.suffix!r} (use {known})"
        )
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise CLIInputError(f"{option} {path}: directory {parent} {what}")
    if target.is_dir():
        raise CLIInputError(f"{option} {path}: is a directory")
    # Opening it is the one test that holds for root, read-only mounts and full quotas
    # alike; a file created only for the test is removed again.
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as e:
        raise CLIInputError(f"{option} {path}: cannot be written: {e.strerror}") from None
    if not existed:
        target.unlink()


def cmd_workload(args: argparse.Namespace) -> int:
    if args.num_requests > MAX_GENERATED_REQUESTS:
        raise CLIInputError(
            f"--num-requests {args.num_requests}: at most {MAX_GENERATED_REQUESTS:,} requests"
        )
    longest = args.prompt_len.high + args.shared_prefix
    if args.num_requests * longest > MAX_GENERATED_PROMPT_TOKENS:
        raise CLIInputError(
            f"--num-requests {args.num_requests} with prompts up to {longest} tokens "
            f"(--prompt-len and --shared-prefix): more than {MAX_GENERATED_PROMPT_TOKENS:,} "
            "prompt tokens"
        )
    if args.shared_prefix * args.num_system_prompts > MAX_GENERATED_PROMPT_TOKENS:
        raise CLIInputError(
            f"--shared-prefix {args.shared_prefix} x --num-system-prompts "
            f"{args.num_system_prompts}: more than {MAX_GENERATED_PROMPT_TOKENS:,} tokens"
        )
    if args.arrival_spread > MAX_ARRIVAL_STEP:
        raise CLIInputError(
            f"--arrival-spread {args.arrival_spread}: at most {MAX_ARRIVAL_STEP:,} "
            "(the largest arrival_step a workload file may hold)"
        )
    if args.output is not None:
        check_output_path("-o", args.output)
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
        shared_prefix=args.shared_prefix,
        num_system_prompts=args.num_system_prompts,
    )
    n = args.num_requests
    # Drawing, then writing: a million requests take about half a minute.
    bar = CommandProgress(
        "kvsched workload",
        2 * n,
        # Not over requests printed to a terminal.
        enabled=wanted(quiet=args.quiet) and (args.output is not None or not sys.stdout.isatty()),
        unit="(draw, then write)",
        show_steps=False,
    )
    with bar:
        requests = generate_workload(settings, on_progress=lambda k: bar.update(0, k))
        if args.output is None:
            dump_workload(requests, sys.stdout)
        else:
            with open(args.output, "w", encoding="utf-8") as f:
                dump_workload(requests, f, on_progress=lambda k: bar.update(0, n + k))
    if args.output is not None:
        notice(f"wrote {args.output} ({len(requests)} requests)", quiet=args.quiet)
    return 0


def _read_inputs(
    args: argparse.Namespace,
) -> tuple[list[WorkloadRequest], SchedulerConfig, LlamaForCausalLM]:
    """The workload, the config and the model, checked in that order (cheapest first).

    Then the KV pools against the memory free, and a swap mode that cannot swap is
    warned about (once: ``--reference`` builds an engine per request).
    """
    workload = read_workload(args.workload)
    config = engine_options.scheduler_config(args)
    model = engine_options.load_model(args)
    if not getattr(args, "reference", False):
        engine_options.check_kv_fits(config, model)
    if config.preemption_mode is PreemptionMode.SWAP and config.num_cpu_blocks == 0:
        warn(
            "--preemption-mode swap with --num-cpu-blocks 0: there is no CPU pool, so "
            "every preemption falls back to recompute"
        )
    return workload, config, model


def cmd_run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        if args.reference:
            raise CLIInputError("--plot draws a shared run's timeline; not with --reference")
        check_output_path("--plot", args.plot, formats=PLOT_FORMATS)
    workload, config, model = _read_inputs(args)

    def factory(c: SchedulerConfig) -> Engine:
        return engine_options.make_engine(c, args, model)

    enabled = wanted(quiet=args.quiet)
    label = "kvsched run --reference" if args.reference else "kvsched run"
    with CommandProgress(label, len(workload), enabled=enabled) as bar:
        if args.reference:
            max_blocks = engine_options.kv_blocks_that_fit(model, config.block_size)
            result = run_reference(
                factory, config, workload, on_step=bar.update, max_blocks=max_blocks
            )
        else:
            result = run_workload(factory(config), config, workload, on_step=bar.update)
    # The results first: a plot that fails to draw must not lose them.
    if args.json:
        print(report.dumps(result), flush=True)
    else:
        print(render_summary(result, title="reference" if args.reference else "run"), flush=True)
    if args.plot is not None:
        plot_timeline(result, args.plot, title=f"kvsched run {Path(args.workload).name}")
        notice(f"wrote {args.plot} (KV timeline, {result.metrics.steps} steps)", quiet=args.quiet)
    return 0


def cmd_conform(args: argparse.Namespace) -> int:
    peer: SchedulerUnderTest
    version: PeerVersion | None = None
    eos: int | None = None
    if args.emit_repro is not None:
        if args.engine == "kvsched":
            raise CLIInputError("--emit-repro writes a script that drives a peer; use --engine")
        check_output_path("--emit-repro", args.emit_repro, formats=("py",))
    if args.engine == "kvsched":
        workload, config, model = _read_inputs(args)
        peer = EngineAdapter(engine_options.make_engine(config, args, model))
    else:
        workload = read_workload(args.workload)
        config = engine_options.scheduler_config(args, PROFILES[args.engine])
        if args.engine == "nano-vllm":
            eos = common_eos(r.params for r in workload)
        peer = make_peer(
            args.engine,
            config,
            eos_token_id=eos,
            python=peer_python(args.engine, args.peer_python),
        )
        version = peer_version(args.engine, peer)
        if not version.tested:
            tested = ", ".join(registry.entry(args.engine).tested)
            warn(f"{args.engine}: {version} is not a version it was tested on ({tested})")
    with CommandProgress("kvsched conform", len(workload), enabled=wanted(quiet=args.quiet)) as bar:
        result = conform.conform(
            peer, config, workload, oracle_vocab=args.oracle_vocab, on_step=bar.update
        )
    print(conform.render(result, config, args.engine, version=version))
    if args.show_states and result.divergence is not None:
        print(describe_states(result.divergence))
    if args.emit_repro is not None:
        _emit_repro(
            args, peer, config=config, workload=workload, result=result, version=version, eos=eos
        )
    return 0 if result.ok else 1


def _emit_repro(
    args: argparse.Namespace,
    peer: SchedulerUnderTest,
    *,
    config: SchedulerConfig,
    workload: list[WorkloadRequest],
    result: conform.ConformReport,
    version: PeerVersion | None,
    eos: int | None,
) -> None:
    if result.divergence is None:
        notice(f"--emit-repro {args.emit_repro}: no divergence, nothing written", quiet=args.quiet)
        return
    # Shrinking runs the script where the peer ran: a peer elsewhere, in its process.
    run = peer.process.run_script if isinstance(peer, RemotePeer) else run_script
    kept, check, last = repro.emit(
        args.emit_repro,
        args.engine,
        config,
        workload,
        result.divergence,
        run=run,
        version=version,
        oracle_vocab=args.oracle_vocab,
        eos=eos,
        command="kvsched " + " ".join(shlex.quote(a) for a in args.argv),
    )
    notice(
        f"wrote {args.emit_repro} ({kept} of {len(workload)} requests; checks {check}): {last}",
        quiet=args.quiet,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    # Printed at the end: the bar and the demo's own table must not interleave.
    out = io.StringIO()
    enabled = wanted(quiet=args.quiet)
    with CommandProgress(
        "kvsched demo", demo.NUM_STAGES, enabled=enabled, unit="runs", show_steps=False
    ) as bar:
        demo.main(out, threads=args.threads, on_stage=lambda k: bar.update(0, k))
    sys.stdout.write(out.getvalue())
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
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed (--emit-repro)
    if args.command is None:  # bare ``kvsched``: what there is to run
        parser.print_help(sys.stderr)
        return 2
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


if __name__ == "__main__":  # ``python -m kvsched.cli`` (``python -m kvsched`` is the same)
    sys.exit(main())
