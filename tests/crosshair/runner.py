"""Run CrossHair over the spec with a fixed budget, and fail on anything it could not do.

``scripts/crosshair_check`` runs this module. Two stages:

1. **check**: ``crosshair check`` on every spec function that has a PEP 316 contract,
   with the value builders of ``tests/crosshair/plugin.py``, a per-condition budget in
   CPU seconds (heavier for the functions of whole states), in ``--jobs`` parallel
   shards. ``--report_all`` makes CrossHair print one line per postcondition, and the
   audit compares them with the contracts found in the source (``ast``, independent
   of CrossHair): a contract CrossHair did not analyse (it could not parse it, could
   not build its arguments, or never got past its precondition) is an error, not a
   silent skip.
   CrossHair runs through ``tests/crosshair/driver.py``, which adds how many paths
   it explored for each postcondition; the summary gives, per module, the conditions
   confirmed over all paths, those explored without a counterexample (and over how
   many paths), and, apart, those that only restate their function's body
   (``tests/crosshair/evidence.py``), which are not counted as evidence.
2. **planted**: every bug of ``tests/crosshair/planted.py`` (realistic mistakes in
   the transitions) is applied to a copy of ``spec/`` and CrossHair is run on the
   function that holds it, with the same budget as the check: each must be reported
   as a counterexample. The score (k/N found) is printed; a bug not found fails.
3. **diff**: ``crosshair diffbehavior`` on every spec/engine pair of
   ``tests/crosshair/adapters.py`` (one victim pair and one gate pair per policy
   registered on both sides; the two registries must name the same policies).

Exit status: 0 when no counterexample and no difference was found, every contract
was analysed and every planted bug was found; 1 whenever a counterexample or a
difference was printed or a planted bug was not found, whatever else went wrong; 2 on
any other problem (unanalysed contract, CrossHair error, timeout). Every condition's
outcome is printed: confirmed, counterexample, explored to depth d (d paths without a
counterexample) or unanalysed. "No counterexample" is a bounded statement: see docs/crosshair.md.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from impl.policies import POLICIES as IMPL_POLICIES
from spec.policies import POLICIES as SPEC_POLICIES
from tests.crosshair import FIRST_ERROR
from tests.crosshair.adapters import PAIRS
from tests.crosshair.evidence import RESTATEMENTS
from tests.crosshair.planted import PLANTED, PlantedBug, plant

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec"
PLUGIN = "tests/crosshair/plugin.py"

BUDGET_LIGHT = 1.5
"""CPU seconds per postcondition for functions of plain values (most are exhausted sooner)."""
BUDGET_HEAVY = 16.0
"""CPU seconds per postcondition for functions of whole states (``SchedulerState``...)."""
LARGEST = ("spec.scheduler.complete_verified_step", "spec.pipeline.complete_async_step")
"""The two largest transitions (phase D's loop over runs, each token through its stop
checks; an async step applying the step in flight): checked with 1.5 times the heavy
budget. At 16 CPU s their planted bugs were found in 10-17 s (``D-eos-dropped`` missed
once, ``V-async-placeholder-kept`` at 14-16 s on 2026-12-04)."""

LARGEST_FACTOR = 1.5

BUDGET_DIFF = 3.0
"""CPU seconds per ``diffbehavior`` pair."""


def path_timeout_args(budget: float) -> list[str]:
    """The per-path timeout: the whole budget rather than CrossHair's default √budget.

    The per-path timeout is CPU time, but the solver's per-query timeout is half of it in
    *wall* time: at √8 s a loaded machine (load 11 on 2 cores) gave up on enough
    queries that paths were dropped and a planted bug found at load 3 was missed.
    """
    return [f"--per_path_timeout={budget}"]


PROCESS_TIMEOUT = 540.0
"""Wall seconds after which one CrossHair process is killed (an error)."""

HEAVY_PRECONDITIONS = ("check_state(", "kv_conserved_mid_step(", "plan_matches(")
"""A function whose preconditions ask for a valid state (a transition, or a wrapper of
one) is checked with the heavy budget; every other function with the light one."""

HEAVY_HELPERS = (
    "spec.scheduler.release_victim",
    "spec.scheduler.prefill_fit",
    "spec.scheduler.profile_victim",
    "spec.profiles.long_prefill_cap",
)
"""Helpers of the transitions that hold their block accounting (so that CrossHair
reaches it, docs/crosshair.md), and ``long_prefill_cap``, whose whole-state argument
takes most of the light budget to build (11 paths in it, 2026-12-03): checked with the
heavy budget too."""

PREDICATES = {
    "spec.policies.always_admit": "the default gate, ``return True``: a contract could only "
    "restate it",
    "spec.invariants.state_violations": "the state invariants, as readable lines",
    "spec.invariants.plan_violations": "the step rules, as readable lines",
    "spec.prefix_cache.pool_violations": "PC1 and PC9, as readable lines",
    "spec.prefix_cache.nano_pool_violations": "nano-vllm's pool rules, as readable lines",
    "spec.scheduler.swapped_head_blocked": "R7's head-of-line rule, a predicate of phase B's",
    "spec.scheduler.newest_victims": "phase A's victim rule, a predicate of its contract",
    "spec.invariants.check_state": "the validity predicate the contracts use",
    "spec.invariants.check_plan": "the step predicate the contracts use",
    "spec.invariants.kv_conserved_mid_step": "a predicate the contracts use",
    "spec.invariants.live_ids_sorted": "a projection the contracts use",
    "spec.invariants.blocks_in_use": "a projection the contracts use",
    "spec.invariants.plan_runs": "a projection the contracts use",
    "spec.kv.blocks_to_grow": "block arithmetic of every chunk: the phases would meet an "
    "assumed contract in its place",
    "spec.kv.table_blocks": "R2's count of a running request's table: the phases would "
    "meet an assumed contract in its place",
    "spec.speculative.pads": "the padded-decode rule, a predicate phase C and Rule P ask",
    "spec.profiles.num_tokens_with_spec": "one sum, vLLM's ``num_tokens_with_spec``: the "
    "phases would meet an assumed contract in its place",
    "spec.invariants.eos_sampled": "a predicate the contracts use",
    "spec.invariants.outputs_extended": "a predicate of phase D's contract",
    "spec.scheduler.plan_matches": "the precondition predicate of phase D",
    "spec.profiles.live_within_reserve": "the precondition predicate of tokenspeed's reserve",
    "spec.scheduler.draft_violations": "the predicate of the phases' contracts",
    "spec.scheduler.samples": "a predicate of one chunk",
    "spec.speculative.valid_run": "what a verify step may return: the rule phase D tests "
    "each run with",
    "spec.profiles.speculative": "one comparison, ``num_speculative_tokens > 0``: the phases "
    "would meet an assumed contract in its place",
    "spec.contracts.within_bounds": "the size predicate of the wrappers",
    "spec.progress.progress_violations": "Rule P itself, a predicate over a state and a "
    "plan (an arbitrary plan names requests the state lacks)",
}
"""Public spec functions that need no contract of their own: they *are* specification.

Besides these, a public function named in a ``post:`` line (a contract's named predicate,
``running_served``, ``aborted``...) is specification too, and needs none."""

_CALLED = re.compile(r"\b([A-Za-z_]\w*)\(")

_CONTRACT_LINE = re.compile(r"^\s*(?:\"\"\")?(pre|post|inv)(\[[^\]]*\])?:\s")
_REPORT_LINE = re.compile(
    r"^(?P<file>/[^:]+):(?P<line>\d+): (?P<kind>info|error|warning): (?P<msg>.*)$"
)
_PATHS_LINE = re.compile(r"^(?P<file>/[^:]+):(?P<line>\d+): paths: (?P<run>\d+) run, ")


@dataclass
class Target:
    """One function (or class, for methods) that CrossHair analyses."""

    name: str  # dotted, as ``crosshair check`` takes it
    file: Path
    conditions: list[int]  # lines CrossHair reports on: each post, or the def line
    heavy: bool
    restatements: set[int] = field(default_factory=set)  # lines that restate the body


@dataclass
class Audit:
    targets: list[Target] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _docstring_lines(node: ast.FunctionDef | ast.ClassDef, source: list[str]) -> range:
    if not node.body:
        return range(0)
    first = node.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return range(0)
    if not isinstance(first.value.value, str):
        return range(0)
    end = first.end_lineno or first.lineno
    return range(first.lineno, end + 1)


def _function_conditions(node: ast.FunctionDef, source: list[str]) -> tuple[list[int], list[int]]:
    pre: list[int] = []
    post: list[int] = []
    for lineno in _docstring_lines(node, source):
        match = _CONTRACT_LINE.match(source[lineno - 1])
        if match is None:
            continue
        (post if match.group(1) == "post" else pre).append(lineno)
    return pre, post


def _predicates(spec_dir: Path) -> set[str]:
    """The names called in some ``post:`` line of the spec: its contracts' predicates."""
    names: set[str] = set()
    for path in spec_dir.glob("*.py"):
        for text in path.read_text().splitlines():
            match = _CONTRACT_LINE.match(text)
            if match is not None and match.group(1) == "post":
                names.update(_CALLED.findall(text))
    return names


def audit_sources(spec_dir: Path = SPEC) -> Audit:
    """The contracts in the spec's source, found with ``ast`` (not with CrossHair).

    Each function states one ``post:`` (issue 24: so that CrossHair's budget does not
    multiply, and each contract reads as one named property); a second is a problem.
    """
    audit = Audit()
    predicates = _predicates(spec_dir)
    for path in sorted(spec_dir.glob("*.py")):
        module = f"spec.{path.stem}" if path.stem != "__init__" else "spec"
        source = path.read_text().splitlines()
        tree = ast.parse("\n".join(source))
        claimed: set[int] = set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                methods: list[tuple[str, ast.FunctionDef]] = [(node.name, node)]
                owner = f"{module}.{node.name}"
            elif isinstance(node, ast.ClassDef):
                methods = [
                    (f"{node.name}.{item.name}", item)
                    for item in node.body
                    if isinstance(item, ast.FunctionDef)
                ]
                owner = f"{module}.{node.name}"
            else:
                continue
            conditions: list[int] = []
            heavy = False
            for qualname, function in methods:
                pre, post = _function_conditions(function, source)
                claimed.update(pre, post)
                if len(post) > 1:
                    audit.problems.append(
                        f"{path}:{post[1]}: {module}.{qualname} has {len(post)} post: lines "
                        "(one per function: join them in a named predicate)"
                    )
                lines = post or ([function.lineno] if pre else [])
                conditions.extend(lines)
                heavy = heavy or any(
                    marker in source[line - 1] for line in pre for marker in HEAVY_PRECONDITIONS
                )
                public = not any(part.startswith("_") for part in qualname.split("."))
                name = f"{module}.{qualname}"
                if (
                    isinstance(node, ast.FunctionDef)
                    and public
                    and not lines
                    and name not in PREDICATES
                    and function.name not in predicates
                ):
                    audit.problems.append(f"{path}:{function.lineno}: {name} has no contract")
            if conditions:
                heavy = heavy or owner in HEAVY_HELPERS
                audit.targets.append(Target(owner, path, sorted(conditions), heavy))
        for lineno, text in enumerate(source, start=1):
            if _CONTRACT_LINE.match(text) and lineno not in claimed:
                audit.problems.append(
                    f"{path}:{lineno}: contract line outside a function docstring "
                    f"(CrossHair would ignore it): {text.strip()}"
                )
    _mark_restatements(audit)
    return audit


def _mark_restatements(audit: Audit) -> None:
    """Mark the conditions ``RESTATEMENTS`` names; each entry must name exactly one."""
    by_name = {t.name: t for t in audit.targets}
    for (name, piece), _why in RESTATEMENTS.items():
        target = by_name.get(name)
        lines = [] if target is None else target.file.read_text().splitlines()
        matches = [n for n in (target.conditions if target else []) if piece in lines[n - 1]]
        if len(matches) != 1 or target is None:
            audit.problems.append(
                f"tests/crosshair/evidence.py: {name} {piece!r} matches "
                f"{len(matches)} conditions, not one"
            )
            continue
        target.restatements.add(matches[0])


def shards(targets: Sequence[Target], jobs: int, light: float, heavy: float) -> list[list[Target]]:
    """Split the targets into ``jobs`` groups of about equal worst-case CPU time."""
    groups: list[list[Target]] = [[] for _ in range(max(1, jobs))]
    loads = [0.0] * len(groups)
    for target in sorted(targets, key=lambda t: -len(t.conditions) * (heavy if t.heavy else light)):
        k = loads.index(min(loads))
        groups[k].append(target)
        loads[k] += len(target.conditions) * (heavy if target.heavy else light)
    return [g for g in groups if g]


def _env() -> dict[str, str]:
    # A fixed hash seed: set and dict orders of strings (and so CrossHair's paths) repeat.
    return {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}


@dataclass
class Run:
    command: list[str]
    returncode: int
    output: str
    seconds: float


def run(command: list[str], timeout: float) -> Run:
    start = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or b""
        text = out.decode() if isinstance(out, bytes) else out
        code, output = 124, text + f"\n(killed after {timeout:.0f} s)\n"
    return Run(command, code, output, time.monotonic() - start)


def check_command(names: Iterable[str], budget: float) -> list[str]:
    """``crosshair check`` through the driver (which also prints the paths explored)."""
    return [
        sys.executable,
        "-m",
        "tests.crosshair.driver",
        "check",
        *names,
        "--extra_plugin",
        PLUGIN,
        "--report_all",
        f"--per_condition_timeout={budget}",
        *path_timeout_args(budget),
    ]


def crosshair_check(targets: Iterable[Target], budget: float, timeout: float) -> Run:
    return run(check_command((t.name for t in targets), budget), timeout)


def check_stage(args: argparse.Namespace) -> int:
    audit = audit_sources()
    targets = [t for t in audit.targets if not args.only or t.name.startswith(tuple(args.only))]
    light = [t for t in targets if not t.heavy]
    heavy = [t for t in targets if t.heavy and t.name not in LARGEST]
    largest = [t for t in targets if t.heavy and t.name in LARGEST]
    work: list[tuple[list[Target], float]] = [
        (group, args.budget_light) for group in shards(light, 1, 1, 1)
    ] + [(group, args.budget_heavy) for group in shards(heavy, args.jobs, 1, 1)]
    work += [([t], args.budget_heavy * LARGEST_FACTOR) for t in largest]
    print(
        f"crosshair check: {len(targets)} targets, "
        f"{sum(len(t.conditions) for t in targets)} conditions "
        f"({len(largest)} targets at {args.budget_heavy * LARGEST_FACTOR:g} CPU s per "
        f"condition, {len(heavy)} at {args.budget_heavy:g}, "
        f"{len(light)} at {args.budget_light:g}); {args.jobs} jobs",
        flush=True,
    )
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(lambda job: crosshair_check(job[0], job[1], args.timeout), work))
    if args.log_dir:
        for index, result in enumerate(runs):
            log = Path(args.log_dir) / f"check-{index}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(" ".join(result.command) + "\n" + result.output)
    verdict = evaluate(targets, runs)
    status = verdict.status
    for line in verdict.errors:
        print(line)
    for line in verdict.results:  # every condition's outcome (issue 25: honest tallies)
        print(f"  {line}")
    if audit.problems and status == 0:
        status = 2
    if verdict.tally[UNANALYSED] or any(r.returncode not in (0, 1) for r in runs):
        for result in runs:  # show what CrossHair said, to see why
            print(f"--- {' '.join(result.command[3:6])} ... (exit {result.returncode})")
            print(result.output[-5000:])
    for problem in (*audit.problems, *verdict.problems):
        print(f"PROBLEM: {problem}")
    for line in verdict.summary():
        print(line)
    print(
        "crosshair check: "
        + ", ".join(f"{n} {what}" for what, n in sorted(verdict.tally.items()))
        + " (CrossHair processes: "
        + ", ".join(f"{r.seconds:.0f} s" for r in runs)
        + ")",
        flush=True,
    )
    return status


CONFIRMED = "confirmed"
"""CrossHair explored every path (within the builders' sizes): a proof, as far as it goes."""
COUNTEREXAMPLE = "counterexample"
EXPLORED = "explored"
"""No counterexample on the paths CrossHair ran before the budget: "explored to depth d",
``d`` the number of paths."""
UNANALYSED = "unanalysed"
"""No verdict: no report line, the precondition never met, or the process failed."""


@dataclass
class Outcome:
    """One condition's result."""

    where: str
    kind: str  # CONFIRMED, COUNTEREXAMPLE, EXPLORED or UNANALYSED
    restating: bool
    paths: int | None  # paths run, as the driver counted them
    message: str

    def line(self) -> str:
        if self.kind == EXPLORED:
            what = f"explored to depth {self.paths or 0} (paths) without a counterexample"
        elif self.kind == CONFIRMED:
            what = f"confirmed over all paths ({self.paths or 0} paths)"
        elif self.kind == COUNTEREXAMPLE:
            what = f"counterexample: {self.message}"
        else:
            what = f"unanalysed: {self.message or 'no report line'}"
        return f"{self.where}: {what}{' [restates the body]' if self.restating else ''}"


@dataclass
class ModuleTally:
    """One module's conditions: those independent of the body and the restating ones apart."""

    independent: Counter[str] = field(default_factory=Counter)
    restating: Counter[str] = field(default_factory=Counter)
    explored_paths: list[int] = field(default_factory=list)  # independent, explored ones

    def add(self, outcome: Outcome) -> None:
        (self.restating if outcome.restating else self.independent)[outcome.kind] += 1
        if outcome.kind == EXPLORED and not outcome.restating:
            self.explored_paths.append(outcome.paths or 0)


@dataclass
class Verdict:
    status: int = 0
    tally: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # CrossHair's error lines, as printed
    outcomes: list[Outcome] = field(default_factory=list)  # one per condition
    modules: dict[str, ModuleTally] = field(default_factory=dict)

    @property
    def results(self) -> list[str]:
        return [o.line() for o in self.outcomes]

    def summary(self) -> list[str]:
        """Per module and in all: the independent conditions by outcome (the explored ones
        with their depth, paths min-median), then the restating ones."""
        lines = [
            "  module            independent of the body: confirmed | explored (depth: paths "
            "min-median) | counterexample | unanalysed || restating: confirmed | explored | other"
        ]
        total = ModuleTally()
        for module, t in sorted(self.modules.items()):
            lines.append(f"  {module:<17} {_row(t)}")
            total.independent.update(t.independent)
            total.restating.update(t.restating)
            total.explored_paths.extend(t.explored_paths)
        lines.append(f"  {'total':<17} {_row(total)}")
        return lines


def _row(t: ModuleTally) -> str:
    paths = sorted(t.explored_paths)
    spread = f"{paths[0]}-{paths[len(paths) // 2]}" if paths else "-"
    i, r = t.independent, t.restating
    other = r[COUNTEREXAMPLE] + r[UNANALYSED]
    return (
        f"{i[CONFIRMED]:>9} | {i[EXPLORED]:>3} ({spread:>7}) | {i[COUNTEREXAMPLE]} | "
        f"{i[UNANALYSED]} || {r[CONFIRMED]:>3} | {r[EXPLORED]} | {other}"
    )


def evaluate(targets: Sequence[Target], runs: Sequence[Run]) -> Verdict:
    """Match CrossHair's ``--report_all`` lines with the contracts found in the source.

    Each condition gets one outcome: confirmed, counterexample, explored to depth d
    (no counterexample on ``d`` paths), or unanalysed (no report line, "Unable to meet
    precondition", a failed process). Status 1 whenever CrossHair printed an error (a
    counterexample, an exception, a callee's precondition broken), whatever else went
    wrong; else 2 if a process failed or a condition went unanalysed; else 0.
    """
    verdict = Verdict()
    reported: dict[tuple[str, int], tuple[str, str]] = {}
    paths: dict[tuple[str, int], int] = {}
    failed = False
    for result in runs:
        if result.returncode not in (0, 1):
            failed = True
            verdict.problems.append(
                f"crosshair exited with {result.returncode}:\n{result.output[-3000:]}"
            )
        for line in result.output.splitlines():
            counted = _PATHS_LINE.match(line)
            if counted is not None:
                paths[(counted["file"], int(counted["line"]))] = int(counted["run"])
                continue
            match = _REPORT_LINE.match(line)
            if match is None:
                continue
            key = (match["file"], int(match["line"]))
            if reported.get(key, ("", ""))[0] != "error":  # the first error line stays
                reported[key] = (match["kind"], match["msg"])
            if match["kind"] == "error":
                verdict.errors.append(line)
    for target in targets:
        module = verdict.modules.setdefault(target.name.rsplit(".", 1)[0], ModuleTally())
        # A callee's broken precondition is reported at the call's line, not the
        # condition's, naming the analysed function: its condition's counterexample.
        calling = f"when calling {target.name.rsplit('.', 1)[1]}("
        inside = [
            msg
            for (file, _), (kind, msg) in reported.items()
            if file == str(target.file) and kind == "error" and calling in msg
        ]
        for lineno in target.conditions:
            key = (str(target.file), lineno)
            kind, message = reported.get(key, ("missing", ""))
            if kind == "missing" and inside and len(target.conditions) == 1:
                kind, message = "error", inside[0]
            where = f"{_shown(target.file)}:{lineno} ({target.name})"
            if kind == "error":
                outcome = COUNTEREXAMPLE
            elif message.startswith("Confirmed"):
                outcome = CONFIRMED
            elif message.startswith("Not confirmed"):
                outcome = EXPLORED
            else:  # no line, "Unable to meet precondition", ...
                outcome = UNANALYSED
                verdict.problems.append(f"{where}: {message or 'not analysed (no report line)'}")
            found = Outcome(where, outcome, lineno in target.restatements, paths.get(key), message)
            verdict.outcomes.append(found)
            module.add(found)
            verdict.tally[outcome] += 1
    if verdict.errors:
        verdict.status = 1
    elif failed or verdict.tally[UNANALYSED]:
        verdict.status = 2
    return verdict


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


@dataclass
class PlantedResult:
    bug: PlantedBug
    found: bool
    seconds: float  # wall
    cpu_seconds: float
    line: str  # the counterexample, or why it was not found


def run_planted(bug: PlantedBug, budget: float, timeout: float) -> PlantedResult:
    """Apply ``bug`` to a copy of the spec and run CrossHair on its function.

    Found means CrossHair printed an ``error`` line about the copy; the process is
    stopped at the first one (the rest of its budget would only confirm it).
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvsched-planted-") as tmp:
        try:
            plant(bug, Path(tmp))
        except ValueError as error:
            return PlantedResult(bug, False, 0.0, 0.0, f"not planted: {error}")
        # The copy, not the real spec; and stop at the first counterexample (driver.py).
        env = {**_env(), "PYTHONPATH": tmp, FIRST_ERROR: "1"}
        process = subprocess.Popen(
            check_command([bug.target], budget),
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # os.kill, not Popen.kill: that one polls first and may reap a process that has
        # just exited (the driver exits after the first counterexample), and wait4 below
        # would then find no child.
        killer = threading.Timer(timeout, os.kill, (process.pid, signal.SIGKILL))
        killer.start()
        found_line = ""
        tail: list[str] = []
        assert process.stdout is not None
        for line in process.stdout:
            tail = [*tail[-20:], line.rstrip()]
            match = _REPORT_LINE.match(line.rstrip())
            if match and match["kind"] == "error" and match["file"].startswith(tmp):
                found_line = line.rstrip().replace(tmp + "/", "")
                os.kill(process.pid, signal.SIGKILL)
                break
        _, _, usage = os.wait4(process.pid, 0)  # reaps it, with its CPU time
        process.returncode = -1
        killer.cancel()
    seconds = time.monotonic() - start
    why = found_line or "no counterexample within the budget: " + " / ".join(tail[-3:])
    cpu = usage.ru_utime + usage.ru_stime
    return PlantedResult(bug, bool(found_line), seconds, cpu, why)


def planted_stage(args: argparse.Namespace) -> int:
    bugs = [b for b in PLANTED if not args.only_bug or b.name in args.only_bug]
    audit = audit_sources()
    heavy = {t.name for t in audit.targets if t.heavy}
    print(
        f"crosshair planted bugs: {len(bugs)} bugs in copies of spec/, each checked at its "
        f"function with the check's budget; {args.jobs} jobs",
        flush=True,
    )

    def one(bug: PlantedBug) -> PlantedResult:
        budget = args.budget_heavy if bug.target in heavy else args.budget_light
        if bug.target in LARGEST:
            budget *= LARGEST_FACTOR
        return run_planted(bug, budget, args.timeout)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, bugs))
    for r in results:
        verdict = "found" if r.found else "NOT FOUND"
        print(
            f"  {r.bug.name:<32} {r.bug.where:<22} {verdict:<9} {r.cpu_seconds:5.1f} CPU s  "
            f"{r.bug.bug}"
        )
        if args.verbose or not r.found:
            print(f"      {r.line[:400]}")
    found = sum(r.found for r in results)
    print(f"crosshair planted bugs: {found}/{len(results)} found", flush=True)
    return 0 if found == len(results) else 1


def diff_stage(args: argparse.Namespace) -> int:
    status = 0
    if set(SPEC_POLICIES) != set(IMPL_POLICIES):
        print(
            "PROBLEM: the policy registries differ: spec "
            f"{sorted(SPEC_POLICIES)}, engine {sorted(IMPL_POLICIES)}"
        )
        status = 2
    pairs = [
        (name, pair) for name, pair in PAIRS.items() if not args.only_diff or name in args.only_diff
    ]
    print(
        f"crosshair diffbehavior: {len(pairs)} pairs at {args.budget_diff:g} CPU s each; "
        f"{args.jobs} jobs",
        flush=True,
    )

    def one(item: tuple[str, tuple[str, str]]) -> tuple[str, Run]:
        name, (spec_fn, impl_fn) = item
        command = [
            sys.executable,
            "-m",
            "crosshair",
            "diffbehavior",
            spec_fn,
            impl_fn,
            "--extra_plugin",
            PLUGIN,
            f"--per_condition_timeout={args.budget_diff}",
        ]
        return name, run(command, args.timeout)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, pairs))
    for name, result in results:
        first = result.output.strip().splitlines()[0] if result.output.strip() else ""
        if result.returncode == 0:
            print(f"  {name}: {first}")
        elif result.returncode == 1:
            status = max(status, 1)
            print(f"  {name}: DIFFERENCE\n{result.output}")
        else:
            status = max(status, 2)
            print(f"  {name}: crosshair exited with {result.returncode}\n{result.output[-3000:]}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="parallel CrossHair processes")
    parser.add_argument("--budget-light", type=float, default=BUDGET_LIGHT)
    parser.add_argument("--budget-heavy", type=float, default=BUDGET_HEAVY)
    parser.add_argument("--budget-diff", type=float, default=BUDGET_DIFF)
    parser.add_argument("--timeout", type=float, default=PROCESS_TIMEOUT)
    parser.add_argument("--stage", choices=("all", "check", "planted", "diff"), default="all")
    parser.add_argument(
        "--only", action="append", help="check only targets starting with this (repeatable)"
    )
    parser.add_argument(
        "--only-diff", action="append", help="run only this diffbehavior pair (repeatable)"
    )
    parser.add_argument(
        "--only-bug", action="append", help="run only this planted bug (repeatable)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="print each planted bug's counterexample"
    )
    parser.add_argument("--log-dir", help="write each CrossHair process's whole output here")
    args = parser.parse_args(argv)
    start = time.monotonic()
    statuses = [0]
    if args.stage in ("all", "check"):
        statuses.append(check_stage(args))
    if args.stage in ("all", "planted"):
        statuses.append(planted_stage(args))
    if args.stage in ("all", "diff"):
        statuses.append(diff_stage(args))
    # 1 whenever something was found (or a planted bug was not): that is the finding,
    # whatever else could not be analysed.
    status = 1 if 1 in statuses else max(statuses)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"crosshair: {'OK' if status == 0 else 'FAILED'} in {time.monotonic() - start:.0f} s "
        f"({children.ru_utime + children.ru_stime:.0f} CPU s in CrossHair processes)"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
