"""``kvsched``: argument parsing and dispatch to the subcommands.

Every input is checked before any work (docs/cli.md has the table of bad inputs and
their answers): the workload file, the options, the output paths (``-o``,
``--plot``), the checkpoint, and the KV pools against the memory free. Results are
printed before ``--plot`` is drawn, so a failure there cannot lose a finished run.

Start-up: this module imports neither torch nor matplotlib. ``--version``,
``--help``, a usage error, ``workload`` and every check of ``run``'s and
``conform``'s inputs that needs no model answer without them; ``kvsched.commands``
(the commands that run a model) is imported only once those checks have passed.

Exit codes: 0 success; 2 bad input to the command line itself (options, workload
file, output path, checkpoint, device, a KV cache that cannot be allocated), reported
as one line on stderr without a traceback (bare ``kvsched`` prints the list of
commands, also with 2); 1 ``conform`` found a divergence, or the engine raised one of
the project's typed errors on good input (it failed to drain, sampled the wrong
tokens ...), also one line; 130 / 143 a SIGINT / SIGTERM stopped it
(``kvsched.interrupt``); 141 stdout was a pipe closed early (``| head``), silently.
Only the project's typed errors and ``OSError`` are caught here: anything else is a
bug and tracebacks. Everything printed from the input is escaped (``kvsched.text``).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvsched import argtypes, engine_options
from kvsched.errors import CLIInputError
from kvsched.files import check_output_path, replacing, writing_stdout
from kvsched.interrupt import Interrupted, Signals, exit_code, handled, signal_name
from kvsched.peers import PEERS, PROFILES
from kvsched.plot import PLOT_FORMATS
from kvsched.progress import PROG, CommandProgress, notice, wanted
from kvsched.text import one_line
from kvsched.workload import (
    MAX_ARRIVAL_STEP,
    GeneratorSettings,
    dump_workload,
    generate_workload,
    read_workload,
)
from spec.types import ConfigError, KVSchedError, Semantics

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
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415  (slow)

    try:
        return version("kvsched")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``: the installed version, looked up only when asked for (reading the
    installed packages' metadata takes a while on a large environment)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog} {_version()}")
        parser.exit()


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
    parser.add_argument("--version", action=_VersionAction)
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


def cmd_workload(args: argparse.Namespace, signals: Signals) -> int:
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
            with writing_stdout() as out:
                dump_workload(requests, out)
        else:
            with replacing("-o", args.output) as f:
                text = io.TextIOWrapper(f, encoding="utf-8")
                dump_workload(requests, text, on_progress=lambda k: bar.update(0, n + k))
                text.detach()  # flushed into f, which ``replacing`` completes
    if args.output is not None:
        notice(f"wrote {args.output} ({len(requests)} requests)", quiet=args.quiet)
    return 0


def cmd_run(args: argparse.Namespace, signals: Signals) -> int:
    if args.plot is not None:
        if args.reference:
            raise CLIInputError("--plot draws a shared run's timeline; not with --reference")
        check_output_path("--plot", args.plot, formats=PLOT_FORMATS)
    workload = read_workload(args.workload)
    config = engine_options.scheduler_config(args)
    from kvsched import commands  # noqa: PLC0415  (torch: only once the inputs are checked)

    return commands.run(args, signals, workload, config)


def check_semantics(engine: str, semantics: str | None) -> None:
    """Refuse a peer held to another peer's profile: its own rules would read as bugs.

    A peer may be held to its own profile (the default) or to the spec's own rules
    (``kvsched``: where it differs from them); our engine implements every profile.
    """
    own = PROFILES[engine]
    if engine == "kvsched" or semantics in (None, Semantics.KVSCHED.value, own.value):
        return
    raise CLIInputError(
        f"--engine {engine} --semantics {semantics}: {engine}'s scheduler follows the "
        f"{own} rules, so where the {semantics} profile differs from them it would report "
        f"a divergence that is no bug; use --semantics {own} (the default with --engine "
        f"{engine}) or --semantics kvsched (the spec's own rules)"
    )


def cmd_conform(args: argparse.Namespace, signals: Signals) -> int:
    check_semantics(args.engine, args.semantics)
    if args.emit_repro is not None:
        if args.engine == "kvsched":
            raise CLIInputError("--emit-repro writes a script that drives a peer; use --engine")
        check_output_path("--emit-repro", args.emit_repro, formats=("py",))
    workload = read_workload(args.workload)
    config = engine_options.scheduler_config(
        args, PROFILES[args.engine], async_by_default=args.engine == "vllm"
    )
    from kvsched import commands  # noqa: PLC0415  (torch: only once the inputs are checked)

    return commands.conform(args, signals, workload, config)


def cmd_demo(args: argparse.Namespace, signals: Signals) -> int:
    from kvsched import commands  # noqa: PLC0415  (torch: the demo runs a model)

    return commands.demo(args)


def _describe_os_error(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def _fail(message: str) -> None:
    print(f"{PROG}: {one_line(message)}", file=sys.stderr, flush=True)


def _tolerant_streams() -> None:
    """Output that no encoding can hold is escaped, not an error after the run."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


def _silence_stdout() -> None:
    """After a broken pipe: the interpreter's last flush must not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    _tolerant_streams()
    with handled() as signals:
        try:
            return _main(argv, signals)
        except Interrupted as e:
            _fail(f"interrupted by {signal_name(e.signum)} (nothing written)")
            return e.exit_code
        except KeyboardInterrupt:  # where no handler could be installed (not the main thread)
            _fail("interrupted (nothing written)")
            return exit_code(signal.SIGINT)


def _main(argv: Sequence[str] | None, signals: Signals) -> int:
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
        code: int = args.handler(args, signals)
    except (CLIInputError, ConfigError) as e:
        _fail(str(e))
        return 2
    except BrokenPipeError:  # ``kvsched ... | head``: the reader has all it wanted
        _silence_stdout()
        return exit_code(signal.SIGPIPE)
    except OSError as e:
        _fail(_describe_os_error(e))
        return 2
    except KVSchedError as e:  # the engine failed on good input: a bug, not bad input
        _fail(f"error: {type(e).__name__}: {e}")
        return 1
    return code


if __name__ == "__main__":  # ``python -m kvsched.cli`` (``python -m kvsched`` is the same)
    sys.exit(main())
