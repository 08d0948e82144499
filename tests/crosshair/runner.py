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
2. **diff**: ``crosshair diffbehavior`` on every spec/engine pair of
   ``tests/crosshair/adapters.py`` (one victim pair and one gate pair per policy
   registered on both sides; the two registries must name the same policies).

Exit status: 0 when no counterexample and no difference was found and every contract
was analysed; 1 on a counterexample or a difference; 2 on any other problem
(unanalysed contract, CrossHair error, timeout). "No counterexample" is a bounded
statement: see docs/crosshair.md.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from impl.policies import POLICIES as IMPL_POLICIES
from spec.policies import POLICIES as SPEC_POLICIES
from tests.crosshair.adapters import PAIRS

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "spec"
PLUGIN = "tests/crosshair/plugin.py"

BUDGET_LIGHT = 1.5
"""CPU seconds per postcondition for functions of plain values (most are exhausted sooner)."""
BUDGET_HEAVY = 3.0
"""CPU seconds per postcondition for functions of whole states (``SchedulerState``...)."""
BUDGET_DIFF = 3.0
"""CPU seconds per ``diffbehavior`` pair."""
PROCESS_TIMEOUT = 540.0
"""Wall seconds after which one CrossHair process is killed (an error)."""

HEAVY_PRECONDITIONS = ("check_state(", "kv_conserved_mid_step(", "plan_matches(")
"""A function whose preconditions ask for a valid state (a transition, or a wrapper of
one) is checked with the heavy budget; every other function with the light one."""

PREDICATES = {
    "spec.invariants.check_state": "the validity predicate the contracts use",
    "spec.invariants.check_plan": "the step predicate the contracts use",
    "spec.invariants.kv_conserved_mid_step": "a predicate the contracts use",
    "spec.invariants.live_ids_sorted": "a projection the contracts use",
    "spec.scheduler.plan_matches": "the precondition predicate of phase D",
    "spec.scheduler.draft_violations": "the predicate of the phases' contracts",
    "spec.scheduler.samples": "a predicate of one chunk",
    "spec.contracts.within_bounds": "the size predicate of the wrappers",
}
"""Public spec functions that need no contract of their own: they *are* specification."""

_CONTRACT_LINE = re.compile(r"^\s*(?:\"\"\")?(pre|post|inv)(\[[^\]]*\])?:\s")
_REPORT_LINE = re.compile(
    r"^(?P<file>/[^:]+):(?P<line>\d+): (?P<kind>info|error|warning): (?P<msg>.*)$"
)


@dataclass
class Target:
    """One function (or class, for methods) that CrossHair analyses."""

    name: str  # dotted, as ``crosshair check`` takes it
    file: Path
    conditions: list[int]  # lines CrossHair reports on: each post, or the def line
    heavy: bool


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


def audit_sources(spec_dir: Path = SPEC) -> Audit:
    """The contracts in the spec's source, found with ``ast`` (not with CrossHair)."""
    audit = Audit()
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
                ):
                    audit.problems.append(f"{path}:{function.lineno}: {name} has no contract")
            if conditions:
                audit.targets.append(Target(owner, path, sorted(conditions), heavy))
        for lineno, text in enumerate(source, start=1):
            if _CONTRACT_LINE.match(text) and lineno not in claimed:
                audit.problems.append(
                    f"{path}:{lineno}: contract line outside a function docstring "
                    f"(CrossHair would ignore it): {text.strip()}"
                )
    return audit


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


def crosshair_check(targets: Iterable[Target], budget: float, timeout: float) -> Run:
    command = [
        sys.executable,
        "-m",
        "crosshair",
        "check",
        *(t.name for t in targets),
        "--extra_plugin",
        PLUGIN,
        "--report_all",
        f"--per_condition_timeout={budget}",
    ]
    return run(command, timeout)


def check_stage(args: argparse.Namespace) -> int:
    audit = audit_sources()
    targets = [t for t in audit.targets if not args.only or t.name.startswith(tuple(args.only))]
    light = [t for t in targets if not t.heavy]
    heavy = [t for t in targets if t.heavy]
    work: list[tuple[list[Target], float]] = [
        (group, args.budget_light) for group in shards(light, 1, 1, 1)
    ] + [(group, args.budget_heavy) for group in shards(heavy, args.jobs, 1, 1)]
    print(
        f"crosshair check: {len(targets)} targets, "
        f"{sum(len(t.conditions) for t in targets)} conditions "
        f"({len(heavy)} targets at {args.budget_heavy:g} CPU s per condition, "
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
    if args.verbose:
        for line in verdict.results:
            print(f"  {line}")
    if audit.problems:
        status = max(status, 2)
    if verdict.status == 2:
        for result in runs:  # show what CrossHair said, to see why
            print(f"--- {' '.join(result.command[3:6])} ... (exit {result.returncode})")
            print(result.output[-5000:])
    for problem in (*audit.problems, *verdict.problems):
        print(f"PROBLEM: {problem}")
    print(
        "crosshair check: "
        + ", ".join(f"{n} {what}" for what, n in sorted(verdict.tally.items()))
        + " (CrossHair processes: "
        + ", ".join(f"{r.seconds:.0f} s" for r in runs)
        + ")",
        flush=True,
    )
    return status


@dataclass
class Verdict:
    status: int = 0
    tally: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # CrossHair's error lines, as printed
    results: list[str] = field(default_factory=list)  # one line per condition


def evaluate(targets: Sequence[Target], runs: Sequence[Run]) -> Verdict:
    """Match CrossHair's ``--report_all`` lines with the contracts found in the source.

    Status 1 if CrossHair reported an error (a counterexample, an exception, a
    precondition of a callee broken); 2 if a process failed or a contract was not
    analysed: no report line for it, or "Unable to meet precondition".
    """
    verdict = Verdict()
    reported: dict[tuple[str, int], tuple[str, str]] = {}
    for result in runs:
        if result.returncode not in (0, 1):
            verdict.status = max(verdict.status, 2)
            verdict.problems.append(
                f"crosshair exited with {result.returncode}:\n{result.output[-3000:]}"
            )
        for line in result.output.splitlines():
            match = _REPORT_LINE.match(line)
            if match is None:
                continue
            reported[(match["file"], int(match["line"]))] = (match["kind"], match["msg"])
            if match["kind"] == "error":
                verdict.status = max(verdict.status, 1)
                verdict.errors.append(line)
    for target in targets:
        for lineno in target.conditions:
            kind, message = reported.get((str(target.file), lineno), ("missing", ""))
            where = f"{target.file.relative_to(ROOT)}:{lineno} ({target.name})"
            verdict.results.append(f"{where}: {kind}: {message}")
            if kind == "missing":
                verdict.status = max(verdict.status, 2)
                verdict.problems.append(f"{where}: not analysed by CrossHair (no report line)")
                verdict.tally["not analysed"] += 1
            elif kind == "error":
                verdict.tally["counterexample or error"] += 1
            elif message.startswith("Confirmed"):
                verdict.tally["confirmed over all paths"] += 1
            elif message.startswith("Not confirmed"):
                verdict.tally["no counterexample within the budget"] += 1
            else:  # "Unable to meet precondition", ...
                verdict.status = max(verdict.status, 2)
                verdict.problems.append(f"{where}: {message}")
                verdict.tally["not analysed"] += 1
    return verdict


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
    parser.add_argument("--stage", choices=("all", "check", "diff"), default="all")
    parser.add_argument(
        "--only", action="append", help="check only targets starting with this (repeatable)"
    )
    parser.add_argument(
        "--only-diff", action="append", help="run only this diffbehavior pair (repeatable)"
    )
    parser.add_argument("--verbose", action="store_true", help="print every condition's result")
    parser.add_argument("--log-dir", help="write each CrossHair process's whole output here")
    args = parser.parse_args(argv)
    start = time.monotonic()
    status = 0
    if args.stage in ("all", "check"):
        status = max(status, check_stage(args))
    if args.stage in ("all", "diff"):
        status = max(status, diff_stage(args))
    print(f"crosshair: {'OK' if status == 0 else 'FAILED'} in {time.monotonic() - start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
