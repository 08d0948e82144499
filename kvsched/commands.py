"""The commands that run a model: ``run``, ``conform`` and ``demo`` (imports torch).

``kvsched.cli`` has checked every input it can without a model (the workload file,
the options, the output paths) before it imports this module. What is left needs the
model: the checkpoint, the device, the KV pools against the memory free.

A run is interruptible (``kvsched.interrupt``): the first SIGINT or SIGTERM stops it
at the next step boundary; the results so far are printed (every request finished,
partial or not started) and the plot drawn up to that step, then one line on stderr
says so and the exit code is 130 or 143.
"""

from __future__ import annotations

import argparse
import io
import shlex
import signal
import sys
from collections import Counter
from pathlib import Path

from kvsched import conform as lockstep_conform
from kvsched import demo as seed_demo
from kvsched import model_setup, report
from kvsched.engine_options import flag_names
from kvsched.engine_protocol import Engine
from kvsched.errors import CLIInputError
from kvsched.files import emit, replacing
from kvsched.interrupt import Interrupted, Signals, exit_code
from kvsched.peers import (
    PeerUnsupportedError,
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
from kvsched.plot import plot_timeline
from kvsched.progress import PROG, CommandProgress, notice, wanted, warn
from kvsched.results import NOT_STARTED, PARTIAL, RunResult
from kvsched.runner import run_reference, run_workload
from kvsched.summary import render_summary
from kvsched.text import one_line
from kvsched.workload import WorkloadRequest
from model import LlamaForCausalLM
from spec.types import PreemptionMode, SchedulerConfig


def _model(args: argparse.Namespace, config: SchedulerConfig) -> LlamaForCausalLM:
    """The model, then the KV pools against the memory free; a swap mode that cannot
    swap is warned about (once: ``--reference`` builds an engine per request)."""
    model = model_setup.load_model(args)
    if not getattr(args, "reference", False):
        model_setup.check_kv_fits(config, model)
    if config.preemption_mode is PreemptionMode.SWAP and config.num_cpu_blocks == 0:
        warn(
            "--preemption-mode swap with --num-cpu-blocks 0: there is no CPU pool, so "
            "every preemption falls back to recompute"
        )
    return model


def _stopped_line(result: RunResult, plot: str | None) -> str:
    """The one line of a run a signal stopped: where, and what is kept."""
    states = Counter(o.state for o in result.outcomes)
    n = len(result.outcomes)
    finished = n - states[PARTIAL] - states[NOT_STARTED]
    kept = "the results up to it are on stdout"
    if plot is not None:
        kept += f"; wrote {plot} up to it"
    return (
        f"{PROG}: stopped by {result.interrupted} after step {result.metrics.steps}: "
        f"{finished} of {n} requests done, {states[PARTIAL]} partial, "
        f"{states[NOT_STARTED]} not started; {kept}"
    )


def run(
    args: argparse.Namespace,
    signals: Signals,
    workload: list[WorkloadRequest],
    config: SchedulerConfig,
) -> int:
    model = _model(args, config)

    def factory(c: SchedulerConfig) -> Engine:
        return model_setup.make_engine(c, args, model)

    label = "kvsched run --reference" if args.reference else "kvsched run"
    engine = None if args.reference else factory(config)
    if engine is not None:
        model_setup.warn_large_pool(config, model, workload)
    with (
        signals.deferred(),
        CommandProgress(label, len(workload), enabled=wanted(quiet=args.quiet)) as bar,
    ):
        if engine is None:
            result = run_reference(
                factory,
                config,
                workload,
                on_step=bar.update,
                max_blocks=model_setup.kv_blocks_that_fit(model, config.block_size),
                stop=signals.requested,
            )
        else:
            result = run_workload(
                engine,
                config,
                workload,
                on_step=bar.update,
                record_timeline=args.plot is not None,
                stop=signals.requested,
            )
    # The results first: a plot that fails to draw must not lose them.
    if args.json:
        emit(report.dumps(result))
    else:
        emit(render_summary(result, title="reference" if args.reference else "run"))
    if args.plot is not None:
        with replacing("--plot", args.plot) as f:
            plot_timeline(
                result,
                f,
                file_format=Path(args.plot).suffix.lower().lstrip("."),
                title=f"kvsched run {Path(args.workload).name}",
            )
    if result.interrupted is not None:
        print(one_line(_stopped_line(result, args.plot)), file=sys.stderr)
        return exit_code(signal.Signals[result.interrupted])
    if args.plot is not None:
        notice(f"wrote {args.plot} (KV timeline, {result.metrics.steps} steps)", quiet=args.quiet)
    return 0


def conform(
    args: argparse.Namespace,
    signals: Signals,
    workload: list[WorkloadRequest],
    config: SchedulerConfig,
) -> int:
    peer: SchedulerUnderTest
    version: PeerVersion | None = None
    eos: int | None = None
    try:
        if args.engine == "kvsched":
            model = _model(args, config)
            peer = EngineAdapter(model_setup.make_engine(config, args, model))
            model_setup.warn_large_pool(config, model, workload)
        else:
            eos = common_eos(r.params for r in workload) if args.engine == "nano-vllm" else None
            peer = make_peer(
                args.engine,
                config,
                eos_token_id=eos,
                python=peer_python(args.engine, args.peer_python),
                speculative=args.speculative_config,
            )
            version = peer_version(args.engine, peer)
            if not version.tested:
                tested = ", ".join(registry.entry(args.engine).tested)
                warn(f"{args.engine}: {version} is not a version it was tested on ({tested})")
    except PeerUnsupportedError as e:
        raise CLIInputError(flag_names(str(e))) from None
    progress = [0, 0]  # steps, requests done: where a signal stopped it
    with (
        signals.deferred(),
        CommandProgress("kvsched conform", len(workload), enabled=wanted(quiet=args.quiet)) as bar,
    ):

        def on_step(steps: int, done: int) -> None:
            bar.update(steps, done)
            progress[:] = [steps, done]
            if signals.received is not None:  # at a step boundary: both sides agree here
                raise Interrupted(signals.received)

        outcome: lockstep_conform.ConformReport | Interrupted
        try:
            outcome = lockstep_conform.conform(
                peer,
                config,
                workload,
                oracle_vocab=args.oracle_vocab,
                on_step=on_step,
                speculative=args.speculative_config,
            )
        except Interrupted as e:
            outcome = e
        except PeerUnsupportedError as e:
            raise CLIInputError(flag_names(str(e))) from None
    # After the bar is gone: while it is drawn, rich redirects stdout to it.
    if isinstance(outcome, Interrupted):
        steps, done = progress
        emit(
            f"conform: stopped by {outcome} after step {steps}: spec and engine agree at all "
            f"{steps} steps so far ({done} of {len(workload)} requests done; "
            f"{lockstep_conform.setup(config, args.engine)})"
        )
        return outcome.exit_code
    emit(lockstep_conform.render(outcome, config, args.engine, version=version))
    if args.show_states and outcome.divergence is not None:
        emit(describe_states(outcome.divergence))
    if args.emit_repro is not None:
        _emit_repro(
            args, peer, config=config, workload=workload, result=outcome, version=version, eos=eos
        )
    return 0 if outcome.ok else 1


def _emit_repro(
    args: argparse.Namespace,
    peer: SchedulerUnderTest,
    *,
    config: SchedulerConfig,
    workload: list[WorkloadRequest],
    result: lockstep_conform.ConformReport,
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


def demo(args: argparse.Namespace) -> int:
    # Printed at the end: the bar and the demo's own table must not interleave.
    out = io.StringIO()
    with CommandProgress(
        "kvsched demo",
        seed_demo.NUM_STAGES,
        enabled=wanted(quiet=args.quiet),
        unit="runs",
        show_steps=False,
    ) as bar:
        seed_demo.main(out, threads=args.threads, on_stage=lambda k: bar.update(0, k))
    emit(out.getvalue().removesuffix("\n"))
    return 0
