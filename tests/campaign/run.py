"""scripts/campaign: a testing campaign on the stateful machines, on one machine of many.

    scripts/campaign                                   # one worker per core, until Ctrl-C
    scripts/campaign --workers 2 --seconds 120 --db redis://127.0.0.1:6379/0
    scripts/campaign --replay --db redis://10.0.0.5:6379/0 NODEID   # a failure, anywhere

It starts N workers (tests/campaign/worker.py: a pytest process each, running every
machine test in turn under the ``campaign`` Hypothesis profile with its own seed), all
on one example database (tests/campaign/database.py) under this tree's revision
(tests/campaign/revision.py); prints progress from the workers' files
(tests/campaign/progress.py) every ``--every`` seconds; and ends with a report: steps
per second per worker and machine, what the database cost, each failure with the
command that replays it from the database. Exit status: 0 no failure, 1 failures found
(or, for ``--replay``, reproduced), 2 the campaign could not run.

Nothing here imports torch or the machines: the workers do, in their own processes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tests.campaign import environment
from tests.campaign.location import CampaignError, Location, describe_meta, redis_client
from tests.campaign.revision import Revision, revision

ROOT: Final = Path(__file__).resolve().parents[2]

DEFAULT_PATHS: Final = ("tests/stateful", "tests/peers")
DEFAULT_DB: Final = ROOT / ".hypothesis" / "campaign"
#: After the deadline, how long a worker may take to end its run (an example, or the
#: shrinking of a failure it found) before it is interrupted.
GRACE_SECONDS: Final = 120.0
#: pytest's exit status when it collected (or kept) no test.
NO_TESTS_COLLECTED: Final = 5
#: Environment a replay needs to reproduce the campaign's examples exactly.
PASSED_ON: Final = ("KVSCHED_STATEFUL_STEPS",)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/campaign",
        description="Run the stateful machines as a campaign on a shared example database "
        "(docs/stateful-testing.md, 'Campaign').",
    )
    parser.add_argument(
        "tests",
        nargs="*",
        help=f"pytest paths or node ids (default: {' '.join(DEFAULT_PATHS)}); only their "
        "machine tests run",
    )
    parser.add_argument(
        "--db",
        default=str(DEFAULT_DB),
        help="redis://host:port/db or a directory (default: .hypothesis/campaign)",
    )
    parser.add_argument(
        "--workers", type=int, default=cores(), help="processes here (default: one per core)"
    )
    parser.add_argument("--seconds", type=float, default=0, help="how long (default: until Ctrl-C)")
    parser.add_argument(
        "--seed", type=int, help="the workers' seeds derive from it (default: random)"
    )
    parser.add_argument(
        "--slice",
        type=float,
        help="seconds per machine per turn (default: 10-60, so that every machine gets a turn)",
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k expression over the machine tests")
    parser.add_argument("--every", type=float, default=10, help="seconds between progress lines")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument(
        "--replay", action="store_true", help="replay the database's examples for TESTS (read only)"
    )
    parser.add_argument(
        "--revision",
        help="with --replay: read this revision's examples instead of this tree's (to check "
        "a fix against what a campaign on the old code found)",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.seconds < 0:
        parser.error("--seconds must not be negative")
    if args.revision and not args.replay:
        parser.error("--revision goes with --replay")
    if args.replay and not args.tests:
        parser.error("--replay needs the node ids to replay (the report prints them)")
    return args


def base_env(location: Location, stats: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HYPOTHESIS_PROFILE": "campaign",
            environment.DB: location.url,
            environment.STATS: str(stats),
            # The workers import this tree, whatever else is installed.
            "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH")))),
            "OMP_NUM_THREADS": "1",  # one core per worker
        }
    )
    # KVSCHED_STATEFUL_STATS: a calling pytest's folder of run reports (tests/stateful/
    # conftest.py), which would otherwise list the workers' runs as its own.
    own = ("KVSCHED_STATEFUL_EXAMPLES", "KVSCHED_STATEFUL_SEED", "KVSCHED_STATEFUL_STATS")
    for name in (*own, environment.REPLAY):
        env.pop(name, None)
    return env


def pytest_command(tests: Sequence[str], keyword: str | None) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-p", "tests.campaign.worker"]
    command += ["-p", "no:cacheprovider", "-q", *(tests or DEFAULT_PATHS)]
    return [*command, "-k", keyword] if keyword else command


def replay_command(url: str, nodeid: str) -> str:
    env = " ".join(f"{n}={shlex.quote(os.environ[n])}" for n in PASSED_ON if n in os.environ)
    command = f"scripts/campaign --replay --db {shlex.quote(url)} {shlex.quote(nodeid)}"
    return f"{env} {command}" if env else command


def read(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data


@dataclass
class Worker:
    index: int
    seed: int
    stats: Path
    log: Path
    process: subprocess.Popen[bytes]
    last: dict[str, Any] = field(default_factory=dict)  # its progress file, last read
    shown: tuple[int, float] = (0, 0.0)  # steps and time at the last progress line

    def snapshot(self) -> dict[str, Any]:
        data = read(self.stats)
        if data is not None:
            self.last = data
        return self.last

    def totals(self) -> tuple[int, int]:
        machines = self.last.get("machines", {}).values()
        return sum(m["examples"] for m in machines), sum(m["steps"] for m in machines)

    def progress(self) -> tuple[int, int, float, str]:
        """Examples, steps, steps/s since the last call, what it runs now."""
        data = self.snapshot()
        examples, steps = self.totals()
        updated = data.get("updated", 0.0)
        shown_steps, shown_at = self.shown
        since = updated - (shown_at or data.get("started", updated))
        self.shown = (steps, updated)
        rate = (steps - shown_steps) / since if since > 0 else 0.0
        state = "done" if data.get("ended") else data.get("current") or "starting"
        return examples, steps, rate, state

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def redis_usage(location: Location) -> dict[str, int]:
    """The server's counters this report divides by the examples (every client counts;
    none if the server cannot be asked)."""
    client = location.redis()
    try:
        stats = client.info("stats")
        commands = client.info("commandstats")
    except redis_client().RedisError as err:
        print(f"campaign: cannot read the Redis server's counters: {err}")
        return {}
    usage = {
        "commands": int(stats["total_commands_processed"]),
        "bytes_in": int(stats["total_net_input_bytes"]),
        "bytes_out": int(stats["total_net_output_bytes"]),
    }
    for name in ("exec", "publish", "smembers", "sadd", "srem", "expire"):
        usage[name] = int(commands.get(f"cmdstat_{name}", {}).get("calls", 0))
    return usage


def directory_usage(path: Path) -> dict[str, int]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def start_workers(
    args: argparse.Namespace, location: Location, rev: Revision, folder: Path, deadline: float
) -> list[Worker]:
    seeds = random.Random(args.seed)
    workers = []
    for index in range(args.workers):
        stats, log = folder / f"worker-{index}.json", folder / f"worker-{index}.log"
        seed = seeds.getrandbits(63)
        env = base_env(location, stats)
        env.update(
            {
                environment.WORKER: str(index),
                environment.WORKERS: str(args.workers),
                environment.SEED: str(seed),
                environment.REVISION: rev.key,
            }
        )
        if deadline < float("inf"):
            env[environment.DEADLINE] = repr(deadline)
        if args.slice:
            env[environment.SLICE] = str(args.slice)
        with log.open("wb") as out:
            process = subprocess.Popen(
                pytest_command(args.tests, args.keyword),
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the campaign, which stops them
            )
        workers.append(Worker(index, seed, stats, log, process))
    return workers


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def progress_lines(workers: list[Worker], elapsed: float) -> list[str]:
    """One line for the campaign, one per worker: examples, steps, steps/s since the last."""
    rows = [w.progress() for w in workers]
    lines = [
        f"  worker {w.index}  {state:<28} {examples:>8,} examples {steps:>11,} steps "
        f"{rate:>8,.0f} steps/s"
        for w, (examples, steps, rate, state) in zip(workers, rows, strict=True)
    ]
    head = (
        f"campaign {elapsed:>6.0f} s  load {load()}  {sum(r[0] for r in rows):,} examples  "
        f"{sum(r[1] for r in rows):,} differential steps  {sum(r[2] for r in rows):,.0f} steps/s"
    )
    return [head, *lines]


def stop(workers: list[Worker], sig: int) -> None:
    for w in workers:
        if w.process.poll() is None:
            os.killpg(w.process.pid, sig)


def wait_for(
    workers: list[Worker], args: argparse.Namespace, deadline: float, start: float
) -> bool:
    """Print progress until every worker ended; whether the campaign was interrupted."""
    interrupted = False
    next_line = time.time() + args.every
    try:
        while any(w.process.poll() is None for w in workers):
            time.sleep(0.2)
            now = time.time()
            if now >= next_line:
                print("\n".join(progress_lines(workers, now - start)), flush=True)
                next_line = now + args.every
            if now > deadline + GRACE_SECONDS:
                print(
                    f"campaign: workers still running {GRACE_SECONDS:.0f} s after the deadline: "
                    "interrupting them",
                    flush=True,
                )
                interrupted = True
                break
    except KeyboardInterrupt:
        print("\ncampaign: interrupted: stopping the workers", flush=True)
        interrupted = True
    if interrupted:
        stop(workers, signal.SIGINT)
        for w in workers:
            try:
                w.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stop([w], signal.SIGKILL)
                w.process.wait()
    for w in workers:
        w.snapshot()
    return interrupted


def failures(workers: list[Worker], url: str) -> list[dict[str, Any]]:
    """Per failing test: every worker's failing run (by time), and the replay command.

    Which worker *found* a failure the report does not claim: a worker saves each
    smaller failing example while it shrinks, so another one can replay it from the
    database (and report it, unshrunk further) before the finder has finished."""
    by_test: dict[str, dict[str, Any]] = {}
    runs = sorted(
        ({**f, "worker": w.index} for w in workers for f in w.last.get("failures", [])),
        key=lambda f: f["seconds"],
    )
    for run in runs:
        entry = by_test.setdefault(
            run["nodeid"],
            {
                "machine": run["machine"],
                "nodeid": run["nodeid"],
                "runs": [],
                "replay": replay_command(url, run["nodeid"]),
            },
        )
        entry["runs"].append(
            {k: run[k] for k in ("worker", "seconds", "run_examples", "run_seconds", "summary")}
        )
    return list(by_test.values())


def sums(counts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Examples, steps and the seconds and CPU seconds spent in the machines, added up."""
    keys = ("examples", "steps", "seconds", "cpu_seconds")
    listed = list(counts)
    return {k: sum(c[k] for c in listed) for k in keys}


def rates(counts: dict[str, Any]) -> dict[str, float]:
    """Steps per second of ``counts``'s wall time and per CPU second in the machines."""
    return {
        "steps_per_second": counts["steps"] / counts["seconds"] if counts["seconds"] > 0 else 0.0,
        "steps_per_cpu_second": (
            counts["steps"] / counts["cpu_seconds"] if counts["cpu_seconds"] > 0 else 0.0
        ),
    }


def report(
    *,
    args: argparse.Namespace,
    rev: Revision,
    workers: list[Worker],
    wall: float,
    usage: dict[str, int],
    loads: tuple[str, str],
) -> dict[str, Any]:
    rows = []
    for w in workers:
        machines = w.last.get("machines", {}).values()
        row = {"worker": w.index, "seed": w.seed, **sums(machines)}
        row["seconds"] = w.last.get("updated", 0) - w.last.get("started", 0)  # its lifetime
        row["process_cpu_seconds"] = w.last.get("cpu_seconds", 0.0)  # imports included
        rows.append(
            {**row, **rates(row), "exit": w.process.returncode, "revision": w.last.get("revision")}
        )
    by_machine: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        for name, m in w.last.get("machines", {}).items():
            by_machine.setdefault(name, []).append(m)
    machines = {
        name: {"nodeid": runs[0]["nodeid"], **sums(runs), **rates(sums(runs))}
        for name, runs in sorted(by_machine.items())
    }
    skipped = {
        nodeid: reason for w in workers for nodeid, reason in w.last.get("skipped", {}).items()
    }
    total = sums(rows)
    return {
        "revision": rev.as_json(),
        "database": args.db,
        "workers": rows,
        "machines": machines,
        **total,
        "seconds": wall,
        **rates({**total, "seconds": wall}),
        "load": {"start": loads[0], "end": loads[1]},
        "database_usage": usage,
        "failures": failures(workers, args.db),
        "skipped": skipped,
        # Workers stopped inside a run: one may have been shrinking a failure, which the
        # database holds (Hypothesis saves each smaller failing example as it finds it).
        "cut_short": [
            {"worker": w.index, "nodeid": w.last["nodeid"]}
            for w in workers
            if w.last.get("ended") != "finished" and w.last.get("nodeid")
        ],
    }


def row_text(row: dict[str, Any]) -> str:
    return (
        f"{row['examples']:>9,} {row['steps']:>11,} {row['seconds']:>7.0f} "
        f"{row['cpu_seconds']:>7.0f} {row['steps_per_second']:>8,.0f} "
        f"{row.get('steps_per_cpu_second', 0.0):>11,.0f}"
    )


def print_report(result: dict[str, Any], rev: Revision, workers: list[Worker]) -> None:
    print(f"\ncampaign report: revision {rev.describe()}, database {result['database']}")
    print(
        f"  {len(workers)} workers, {result['seconds']:.0f} s wall, load (1/5/15 min) "
        f"{result['load']['start']} at the start, {result['load']['end']} at the end"
    )
    print(
        f"  {'':<28} {'examples':>9} {'steps':>11} {'wall s':>7} {'CPU s':>7} {'steps/s':>8} "
        f"{'steps/CPU-s':>11}"
    )
    print("  per worker (wall: its lifetime; CPU: in the machines; seed: its runs' seeds)")
    for r in result["workers"]:
        label = f"worker {r['worker']} (seed {r['seed']})"
        print(f"  {label:<28} " + row_text(r))
    print(f"  {'all workers (campaign wall)':<28} " + row_text(result))
    print("  per machine (wall: in its runs, over all workers)")
    for name, m in result["machines"].items():
        print(f"  {name:<28} " + row_text(m))
    usage = result["database_usage"]
    if usage and result["examples"]:
        n = result["examples"]
        per = ", ".join(f"{k} {v / n:.2f}" for k, v in usage.items())
        print(f"  database, per example ({n:,} examples): {per}")
    for nodeid, reason in result["skipped"].items():
        print(f"  skipped {nodeid}: {reason}")
    for w in workers:
        if w.process.returncode == NO_TESTS_COLLECTED:
            print(f"  worker {w.index} selected no machine test: check the paths and -k")
        elif w.process.returncode not in (0, 1) and not result["interrupted"]:
            print(
                f"  worker {w.index} ended with exit status {w.process.returncode}; its log "
                f"({w.log}) ends:\n{w.log_tail()}"
            )
    for c in result["cut_short"]:
        print(
            f"  worker {c['worker']} was stopped inside a run of {c['nodeid']}; if it was "
            f"shrinking a failure, the database holds it:\n"
            f"      {replay_command(result['database'], c['nodeid'])}"
        )
    if not result["failures"]:
        print("  no failure found")
    for f in result["failures"]:
        print(f"  FAILED {f['machine']} ({f['nodeid']})")
        for run in f["runs"]:
            print(
                f"    worker {run['worker']} at {run['seconds']:.0f} s, a run of "
                f"{run['run_examples']} examples in {run['run_seconds']:.0f} s: {run['summary']}"
            )
        print(
            "    replay it on any machine with this revision and access to the database:\n"
            f"      {f['replay']}"
        )


def campaign(args: argparse.Namespace, location: Location, rev: Revision) -> int:
    meta = {**rev.as_json(), **{n: os.environ[n] for n in PASSED_ON if n in os.environ}}
    location.write_meta(rev.key, meta)
    usage_before = redis_usage(location) if location.is_redis else {}
    folder = Path(tempfile.mkdtemp(prefix="kvsched-campaign-"))
    start = time.time()
    deadline = start + args.seconds if args.seconds else float("inf")
    load_at_start = load()
    print(
        f"campaign: {args.workers} workers, revision {rev.describe()}, database {location.url}, "
        f"{f'{args.seconds:g} s' if args.seconds else 'until Ctrl-C'}, logs in {folder}",
        flush=True,
    )
    workers = start_workers(args, location, rev, folder, deadline)
    interrupted = wait_for(workers, args, deadline, start)
    wall = time.time() - start
    if location.is_redis:
        after = redis_usage(location)
        usage = {k: after[k] - usage_before[k] for k in after if k in usage_before}
    else:
        usage = directory_usage(location.directory / rev.key)
    result = report(
        args=args, rev=rev, workers=workers, wall=wall, usage=usage, loads=(load_at_start, load())
    )
    result["interrupted"] = interrupted
    print_report(result, rev, workers)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    mixed = {r["revision"] for r in result["workers"]} - {rev.key, None}
    if mixed:
        print(
            f"campaign: the workers ran revision {sorted(mixed)}, not {rev.key}: the tree "
            "changed under the campaign"
        )
        return 2
    if any(w.process.returncode not in (0, 1) for w in workers) and not interrupted:
        return 2
    return 1 if result["failures"] else 0


def replay(args: argparse.Namespace, location: Location, rev: Revision) -> int:
    key = args.revision or rev.key
    held = location.revisions()
    if key not in held:
        listed = "; ".join(describe_meta(k, v) for k, v in sorted(held.items())) or "none"
        print(
            f"campaign: the database {location.url} holds no campaign of revision {key} "
            f"(this tree: {rev.describe()}); it holds: {listed}. Check out the campaign's "
            "code, or pass --revision KEY to replay another revision's examples on this tree.",
            file=sys.stderr,
        )
        return 2
    if key != rev.key:
        print(f"campaign: replaying revision {key}'s examples on this tree ({rev.describe()})")
    for name in PASSED_ON:
        if held[key].get(name) != os.environ.get(name):
            print(
                f"campaign: warning: the campaign ran with {name}={held[key].get(name)}, this "
                f"replay with {os.environ.get(name)}: its examples may not replay"
            )
    with tempfile.TemporaryDirectory(prefix="kvsched-replay-") as folder:
        stats = Path(folder) / "replay.json"
        env = base_env(location, stats)
        env.update({environment.REPLAY: key, "KVSCHED_STATEFUL_EXAMPLES": "1"})
        command = pytest_command(args.tests, args.keyword)
        code = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
        data = read(stats) or {}
    replayed = sum(m["examples"] for m in data.get("machines", {}).values())
    verdict = {0: "no failure reproduced", 1: "the failure reproduced"}.get(
        code, f"pytest exit {code}"
    )
    print(
        f"campaign: replayed {replayed} examples from {location.url} "
        f"(revision {key}, read only): {verdict}"
    )
    return code if code in (0, 1) else 2


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    location = Location(args.db)
    try:
        location.check()
        rev = revision(ROOT)
        return replay(args, location, rev) if args.replay else campaign(args, location, rev)
    except CampaignError as err:
        print(f"campaign: {err}", file=sys.stderr)
        return 2
