#!/usr/bin/env python
"""Does the stateful differential suite have teeth? Plant known bugs and count the kills.

Each mutant is a text patch (the bugs real engines shipped: a wrong victim, block
arithmetic off by one, leaks and double frees, a swap-in into the wrong blocks,
admission in a preempting step, lost outputs, EOS ignored, a finished request left
running, ...). For each one the script copies the repository to a temporary
directory, applies the patch there (the checkout is never touched), and runs the
stateful suite under the quick, deterministic ``mutation`` Hypothesis profile
(tests/conftest.py: no shrinking). A mutant is *caught* when the run fails; the
report names the invariant that failed (``InvariantViolation: [name]``).

The fast ``SchedulerDifferential`` machine runs first; if it misses a mutant, the
``EngineDifferential`` machine (real model, real KV tensors) gets a try
(``--all-machines`` runs both on every mutant). An unmutated copy runs first and
must pass, or the kills would mean nothing. With ``--regressions`` each mutant is
also run against tests/regressions (informational).

    python scripts/mutation_check.py                 # every mutant; exit 1 if one survives
    python scripts/mutation_check.py -k eos -k fifo  # mutants whose name contains eos/fifo
    python scripts/mutation_check.py --machines scheduler --jobs 2 --json out.json
    python scripts/mutation_check.py --seed 3          # another stream of examples
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What a copy needs to run the stateful suite (kvsched/, bench/, docs/ are not needed).
COPIED = (
    "pyproject.toml",
    "spec",
    "impl",
    "model",
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/stateful",
    "tests/regressions",
)

MACHINE_TESTS = {
    "scheduler": "tests/stateful/test_scheduler_differential.py::test_scheduler_differential",
    "prefix-scheduler": (
        "tests/stateful/test_prefix_differential.py::test_prefix_scheduler_differential"
    ),
    "prefix-engine": "tests/stateful/test_prefix_differential.py::test_prefix_engine_differential",
    "engine": "tests/stateful/test_engine_differential.py::test_engine_differential",
}


@dataclass(frozen=True)
class Patch:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    patches: tuple[Patch, ...]
    #: The machines that run the mutated code (a bug in impl/engine.py is invisible
    #: to SchedulerDifferential, which drives impl.Scheduler with a toy model).
    machines: tuple[str, ...] = ("scheduler", "engine")


def mutant(
    name: str,
    description: str,
    *patches: tuple[str, str, str],
    machines: tuple[str, ...] = ("scheduler", "engine"),
) -> Mutant:
    return Mutant(name, description, tuple(Patch(*p) for p in patches), machines)


SCHED = "impl/scheduler.py"
PHASES = "impl/phases.py"
POLICIES = "impl/policies.py"
PREFIX = "impl/prefix_cache.py"
PREFIX_MACHINES = ("prefix-scheduler", "prefix-engine")

MUTANTS: tuple[Mutant, ...] = (
    # --- the eight of the issue --------------------------------------------------------
    mutant(
        "fifo-victim",
        "LIFO policy preempts the oldest candidate (running[start]) instead of the newest",
        (POLICIES, "    return len(running) - 1\n", "    return start\n"),
    ),
    mutant(
        "blocks-needed-off-by-one",
        "phase A counts one block too many when a chunk ends on a block boundary",
        (
            PHASES,
            "need = (computed + n - 1) // bs + 1 - len(table)",
            "need = (computed + n) // bs + 1 - len(table)",
        ),
    ),
    mutant(
        "swapped-abort-leaks-a-block",
        "aborting a swapped request frees all but its first CPU block",
        (
            SCHED,
            "            self.swapped.remove(seq)\n"
            "            self.cpu.free(seq.cpu_block_table)\n",
            "            self.swapped.remove(seq)\n"
            "            self.cpu.free(seq.cpu_block_table[1:])\n",
        ),
    ),
    mutant(
        "swap-in-wrong-slots",
        "swap-in copies the CPU blocks into the request's GPU blocks in reverse order",
        (
            PHASES,
            "zip(cpu_blocks, seq.block_table, strict=False)",
            "zip(cpu_blocks, seq.block_table[::-1], strict=False)",
        ),
    ),
    mutant(
        "admit-after-preemption",
        "waiting requests are admitted in a step that preempted (no anti-thrash rule)",
        (
            SCHED,
            "                if not self.swapped:\n"
            "                    budget = phases.admit(self, out, budget)\n",
            "            if not self.swapped:\n"
            "                budget = phases.admit(self, out, budget)\n",
        ),
    ),
    mutant(
        "recompute-drops-outputs",
        "a recompute preemption discards the outputs like restart (lost tokens)",
        (PHASES, "    if mode is PreemptionMode.RESTART:\n", "    if True:\n"),
    ),
    mutant(
        "eos-ignored",
        "the engine never stops on the EOS token",
        (
            PHASES,
            "if token == seq.eos_token_id or computed + 1 == seq.stop_len:",
            "if computed + 1 == seq.stop_len:",
        ),
    ),
    mutant(
        "finished-left-running",
        "a finished request stays in running until the next schedule() (one step too long)",
        (
            PHASES,
            "    for i in reversed(finished_at):  # scheduled[i] is running[i]\n"
            "        del running[i]\n",
            "    del running  # mutant: finished requests are purged by the next schedule()\n",
        ),
        (
            SCHED,
            "        out = SchedulerOutput(self.num_steps, self.num_cached_tokens)\n",
            "        self.running[:] = [s for s in self.running if s.status is not _FINISHED]\n"
            "        out = SchedulerOutput(self.num_steps, self.num_cached_tokens)\n",
        ),
    ),
    # --- more bugs engines shipped (engines.md section 6) --------------------------------
    mutant(
        "length-off-by-one",
        "a request finishes one output after max_tokens",
        (PHASES, "computed + 1 == seq.stop_len:", "computed == seq.stop_len:"),
    ),
    mutant(
        "running-abort-leaks-blocks",
        "aborting a running request does not free its GPU blocks",
        (
            SCHED,
            "            self.num_cached_tokens -= seq.num_computed\n"
            "            self.gpu.free(seq.block_table)\n"
            "        elif status is _SWAPPED:\n",
            "            self.num_cached_tokens -= seq.num_computed\n"
            "        elif status is _SWAPPED:\n",
        ),
    ),
    mutant(
        "free-keeps-table",
        "BlockManager.free does not empty the table: a later free is a double free",
        ("impl/block_manager.py", "        table.clear()\n", "        pass\n"),
    ),
    mutant(
        "never-fit-accepted",
        "R4.5 lets through a request one block larger than the GPU pool (it hangs)",
        (
            SCHED,
            "if cdiv(most_cached, config.block_size) > config.num_gpu_blocks:",
            "if cdiv(most_cached, config.block_size) > config.num_gpu_blocks + 1:",
        ),
    ),
    mutant(
        "swap-fallback-missing",
        "swap mode swaps even when the CPU pool is too small",
        (
            PHASES,
            "if mode is PreemptionMode.SWAP and not sched.cpu.can_allocate(len(gpu_blocks)):",
            "if False:",
        ),
    ),
    mutant(
        "victim-to-waiting-tail",
        "a recomputed victim goes to the tail of waiting instead of the front",
        (PHASES, "    sched.waiting.push_front(seq)\n", "    sched.waiting.push_back(seq)\n"),
    ),
    mutant(
        "fewest-outputs-tie-break",
        "fewest-outputs breaks ties towards the earliest candidate, not the latest",
        (POLICIES, "            if key < best_key:\n", "            if key <= best_key:\n"),
    ),
    mutant(
        "rollback-skips-kv-restore",
        "a failed forward is rolled back without restoring the victims' reused GPU blocks",
        ("impl/engine.py", "cache_engine.restore(protected, saved)", "pass"),
        machines=("engine",),
    ),
    # --- prefix caching (PC1-PC9), on the machines with caching on --------------------------
    mutant(
        "prefix-stale-key",
        "a reclaimed cached block keeps its key: a later hit reads other content",
        (
            PREFIX,
            "            self._drop_key(block)\n            self._add_ref(block, 1)\n"
            "            table.append(block)",
            "            self._add_ref(block, 1)\n            table.append(block)",
        ),
        machines=PREFIX_MACHINES,
    ),
    mutant(
        "prefix-full-hit-schedules-nothing",
        "the hit is not capped at num_tokens - 1: a fully cached prompt has no token to run",
        (PREFIX, "range((seq.num_tokens - 1) // bs)", "range(seq.num_tokens // bs)"),
        machines=PREFIX_MACHINES,
    ),
    mutant(
        "prefix-entry-dropped-after-hit",
        "a hit on a free cached block drops its key: the entry serves one hit only",
        (
            PREFIX,
            "                self._unlink(block)\n            self._add_ref(block, 1)",
            "                self._unlink(block)\n                self._drop_key(block)\n"
            "            self._add_ref(block, 1)",
        ),
        machines=PREFIX_MACHINES,
    ),
    mutant(
        "prefix-resumed-over-schedules",
        "a preempted request that hits still schedules its whole num_tokens (past its end)",
        (
            PHASES,
            "        n = seq.num_tokens - start\n",
            "        n = seq.num_tokens - (0 if seq.num_preemptions else start)\n",
        ),
        machines=PREFIX_MACHINES,
    ),
    mutant(
        "prefix-reclaim-between-lookup-and-use",
        "new blocks are taken before the hit is touched: a free hit block can be reclaimed",
        (
            PHASES,
            "            cache.touch(table, hit)\n"
            "            cache.grow(table, len(hit) + num_blocks)\n",
            "            new: list[int] = []\n            cache.grow(new, num_blocks)\n"
            "            cache.touch(table, hit)\n            table.extend(new)\n",
        ),
        machines=PREFIX_MACHINES,
    ),
    mutant(
        "prefix-free-in-table-order",
        "freed blocks join the free queue in table order: a request's first blocks go first",
        (PREFIX, "        for block in reversed(table):\n", "        for block in table:\n"),
        machines=PREFIX_MACHINES,
    ),
    mutant(
        "prefix-rollback-skips-cached-kv",
        "a failed forward is rolled back without restoring the K/V of reclaimed cached blocks",
        (
            "impl/engine.py",
            "reclaimed = [] if cache is None else cache.reclaimed_blocks()",
            "reclaimed: list[int] = []",
        ),
        machines=("prefix-engine",),
    ),
)


@dataclass
class Run:
    machine: str
    outcome: str  # "caught", "survived", "error"
    invariant: str = ""
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Result:
    mutant: str
    description: str
    caught: bool = False
    skipped: bool = False  # no requested machine runs the mutated code
    runs: list[Run] = field(default_factory=list)
    regressions: str = ""

    @property
    def caught_by(self) -> str:
        for run in self.runs:
            if run.outcome == "caught":
                return f"{run.machine}: {run.invariant}"
        return "-"


class StaleMutantError(RuntimeError):
    """A patch's text is no longer in the source (it changed): update the mutant."""


def make_copy(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in COPIED:
        src = ROOT / name
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=ignore)
        else:
            shutil.copy2(src, target)


def apply(m: Mutant, dest: Path) -> None:
    for patch in m.patches:
        path = dest / patch.path
        text = path.read_text()
        count = text.count(patch.old)
        if count != 1:
            raise StaleMutantError(
                f"{m.name}: {patch.path} contains the patched text {count} times, not once: "
                f"{patch.old!r}"
            )
        path.write_text(text.replace(patch.old, patch.new))


INVARIANT = re.compile(r"InvariantViolation: \[([a-z_]+)\]")
EXCEPTION = re.compile(r"^E\s+([A-Za-z_][\w.]*(?:Error|Exception|Violation))\b", re.MULTILINE)


def run_pytest(
    dest: Path, tests: Sequence[str], timeout: float, seed: int | None = None
) -> tuple[str, str, str, float]:
    """(outcome, invariant or exception, output tail, seconds) of one pytest run in ``dest``."""
    env = dict(os.environ)
    env.update(
        HYPOTHESIS_PROFILE="mutation",
        PYTHONPATH=str(dest),
        PYTHONDONTWRITEBYTECODE="1",
        KVSCHED_STATEFUL_STATS=str(dest / ".stats"),
    )
    env.pop("CI", None)
    env.pop("KVSCHED_STATEFUL_SEED", None)
    if seed is not None:
        env["KVSCHED_STATEFUL_SEED"] = str(seed)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            cwd=dest,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "error", "timeout", f"timed out after {timeout:.0f}s", time.perf_counter() - start
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    tail = output[-3000:]
    if proc.returncode == 0:
        return "survived", "", tail, seconds
    if proc.returncode != 1:  # 2: interrupted, 3: internal error, 4: usage, 5: no tests
        return "error", f"pytest exit {proc.returncode}", tail, seconds
    found = INVARIANT.search(output)
    if found:
        return "caught", found.group(1), tail, seconds
    other = EXCEPTION.search(output)
    return "caught", other.group(1) if other else "test failed", tail, seconds


def check_imports(dest: Path) -> None:
    """The copy, not the checkout (or an installed copy), must be what the tests import."""
    env = dict(os.environ, PYTHONPATH=str(dest))
    out = subprocess.run(
        [sys.executable, "-c", "import impl, spec; print(impl.__file__); print(spec.__file__)"],
        cwd=dest,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(dest.resolve()):
            raise RuntimeError(f"the copy in {dest} imports {path}: the mutants would not apply")


def evaluate(
    m: Mutant | None,
    *,
    machines: Sequence[str],
    all_machines: bool,
    regressions: bool,
    timeout: float,
    keep: bool,
    seed: int | None = None,
) -> Result:
    name = m.name if m else "(unmutated)"
    result = Result(name, m.description if m else "the checkout as it is")
    with tempfile.TemporaryDirectory(prefix=f"kvsched-mutant-{name.strip('()')}-") as tmp:
        dest = Path(tmp)
        make_copy(dest)
        if m is not None:
            apply(m, dest)
        for machine in machines:
            if m is not None and machine not in m.machines:
                continue
            outcome, invariant, tail, seconds = run_pytest(
                dest, [MACHINE_TESTS[machine]], timeout, seed
            )
            result.runs.append(Run(machine, outcome, invariant, seconds, tail))
            if outcome == "caught":
                result.caught = True
                if not all_machines:
                    break
        result.skipped = m is not None and not result.runs
        if regressions and m is not None:
            outcome, invariant, _, _ = run_pytest(dest, ["tests/regressions"], timeout)
            result.regressions = f"{outcome} {invariant}".strip()
        if keep:
            kept = Path(tempfile.gettempdir()) / f"kvsched-mutant-{name.strip('()')}"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(dest, kept)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="select", action="append", default=[], help="name filter")
    parser.add_argument(
        "--machines",
        default="scheduler,engine,prefix-scheduler,prefix-engine",
        help=(
            "comma-separated, in order (default all; each mutant runs on the machines that "
            "run its code, the engine ones only if the fast one misses it)"
        ),
    )
    parser.add_argument("--all-machines", action="store_true", help="run every machine")
    parser.add_argument("--regressions", action="store_true", help="also run tests/regressions")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument(
        "--seed", type=int, help="another fixed stream of examples (default: derandomized)"
    )
    parser.add_argument("--keep", action="store_true", help="keep each mutated copy in /tmp")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)

    machines = [m.strip() for m in args.machines.split(",") if m.strip()]
    unknown = set(machines) - set(MACHINE_TESTS)
    if unknown:
        parser.error(f"unknown machines {sorted(unknown)}")
    chosen = [m for m in MUTANTS if not args.select or any(s in m.name for s in args.select)]
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:28} {m.description}")
        return 0
    if not chosen:
        parser.error("no mutant matches")

    with tempfile.TemporaryDirectory() as tmp:  # fail early: stale patches, wrong imports
        make_copy(Path(tmp))
        check_imports(Path(tmp))
        for m in chosen:
            for patch in m.patches:
                if (Path(tmp) / patch.path).read_text().count(patch.old) != 1:
                    raise StaleMutantError(f"{m.name}: the text to patch in {patch.path} changed")

    started = time.perf_counter()
    if not args.no_baseline:
        baseline = evaluate(
            None,
            machines=machines,
            all_machines=True,
            regressions=False,
            timeout=args.timeout,
            keep=False,
            seed=args.seed,
        )
        for run in baseline.runs:
            print(f"baseline {run.machine}: {run.outcome} ({run.seconds:.0f}s)", flush=True)
            if run.outcome != "survived":
                print(run.detail)
                print("the unmutated suite must pass: fix that first", file=sys.stderr)
                return 2

    def one(m: Mutant) -> Result:
        result = evaluate(
            m,
            machines=machines,
            all_machines=args.all_machines,
            regressions=args.regressions,
            timeout=args.timeout,
            keep=args.keep,
            seed=args.seed,
        )
        status = "SKIPPED " if result.skipped else "CAUGHT  " if result.caught else "SURVIVED"
        print(f"{status} {m.name:28} {result.caught_by}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, chosen))

    skipped = [r.mutant for r in results if r.skipped]
    results = [r for r in results if not r.skipped]
    caught = sum(r.caught for r in results)
    print()
    print(f"{'mutant':28} {'caught by (machine: invariant)':44} seconds  regressions")
    for r in results:
        seconds = sum(run.seconds for run in r.runs)
        print(f"{r.mutant:28} {r.caught_by:44} {seconds:7.0f}  {r.regressions}")
        for run in r.runs:
            if run.outcome == "error":
                print(f"    {run.machine}: error {run.invariant}\n{run.detail}")
    rate = caught / len(results) if results else 0.0
    print(
        f"\nkill rate: {caught}/{len(results)} = {rate:.0%} "
        f"({time.perf_counter() - started:.0f}s wall)"
    )
    if skipped:
        print(f"skipped (no requested machine runs the mutated code): {', '.join(skipped)}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "caught": caught,
                    "total": len(results),
                    "results": [
                        {**asdict(r), "runs": [{**asdict(run), "detail": ""} for run in r.runs]}
                        for r in results
                    ],
                },
                indent=2,
            )
        )
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
