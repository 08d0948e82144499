"""The campaign (scripts/campaign): its revision key, its database URLs, its command line,
and, against a real ``redis-server``, a planted failure found by a worker writing to
Redis and replayed by a fresh process that reads Redis alone."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.campaign.conftest import require_redis_client
from tests.campaign.location import CampaignError, Location
from tests.campaign.revision import revision
from tests.stateful.subjects.engine import ENGINE
from tests.stateful.subjects.scheduler import SCHEDULER
from tests.stateful.subjects.vllm_v1 import VLLM

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "campaign"
#: Caught by the fast machine within its first few examples (plan_matches_spec).
MUTANT = "admit-over-max-num-seqs"
NODE = "tests/stateful/test_scheduler_differential.py::test_scheduler_differential"


def campaign(tree: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """scripts/campaign of the tree at ``tree`` (its own code: ``tests.campaign.run``)."""
    env = dict(os.environ, PYTHONPATH=str(tree), KVSCHED_STATEFUL_STEPS="20")
    code = "import sys; from tests.campaign.run import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def tree_copy(dest: Path, mutant: str | None = None) -> Path:
    """What the stateful suite needs of the checkout, copied (scripts/mutation_check.py's
    copy), with ``mutant`` planted if given."""
    check: dict[str, Any] = runpy.run_path(str(ROOT / "scripts" / "mutation_check.py"))
    check["make_copy"](dest)
    if mutant is not None:
        (planted,) = (m for m in check["MUTANTS"] if m.name == mutant)
        check["apply"](planted, dest)
    return dest


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_revision_is_the_tested_code_and_the_versions(tmp_path: Path) -> None:
    write(tmp_path / "spec" / "rules.py", "A = 1\n")
    write(tmp_path / "docs" / "notes.md", "words\n")
    first = revision(tmp_path)
    assert first.commit is None and first.versions["hypothesis"]
    write(tmp_path / "docs" / "notes.md", "other words\n")
    assert revision(tmp_path).key == first.key, "docs do not split a campaign's corpus"
    write(tmp_path / "tests" / "stateful" / "new_machine.py", "B = 2\n")  # untracked counts
    second = revision(tmp_path)
    assert second.key != first.key
    write(tmp_path / "spec" / "rules.py", "A = 2\n")
    assert revision(tmp_path).key not in (first.key, second.key)


def test_the_campaign_runs_nightlys_rules_per_example_without_targeting() -> None:
    for subject in (SCHEDULER, ENGINE, VLLM):
        size = subject.sizes.of("campaign")
        assert size.steps == subject.sizes.nightly.steps and not size.targeting


def test_database_urls() -> None:
    assert Location("redis://127.0.0.1:6379/0").is_redis
    assert not Location("/tmp/db").is_redis
    assert Location("file:///tmp/db").directory == Path("/tmp/db")
    with pytest.raises(CampaignError, match="unknown database URL"):
        Location("http://example.com/db").check()


def test_an_unreachable_redis_is_one_clear_error() -> None:
    require_redis_client()
    proc = campaign(ROOT, "--db", "redis://127.0.0.1:1/0", "--seconds", "1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("campaign: cannot reach Redis at redis://127.0.0.1:1/0")
    assert "Traceback" not in proc.stderr


def test_help_imports_neither_torch_nor_hypothesis() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--workers" in proc.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines()}
    assert not imported & {"torch", "hypothesis", "pytest", "redis"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--replay"], "--replay needs the node ids"),
        (["--revision", "abc"], "--revision goes with --replay"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    proc = campaign(ROOT, *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_planted_failure_is_found_and_replayed_from_redis_alone(
    tmp_path: Path, redis_url: str
) -> None:
    found = tree_copy(tmp_path / "found", MUTANT)
    report = tmp_path / "report.json"
    run = campaign(
        found,
        *("--workers", "1", "--seconds", "120", "--slice", "10", "--every", "5"),
        *("--db", redis_url, "--json", str(report), NODE),
    )
    assert run.returncode == 1, run.stdout + run.stderr
    result = json.loads(report.read_text())
    (failure,) = result["failures"]
    assert failure["machine"] == "SchedulerDifferential"
    assert failure["runs"][0]["summary"].startswith("InvariantViolation: [plan_matches_spec]")
    assert f"--replay --db {redis_url} {NODE}" in failure["replay"]
    assert result["steps"] > 0 and result["database_usage"]["sadd"] > 0

    # The same code in another place, without the first one's files: Redis alone.
    fresh = tree_copy(tmp_path / "fresh", MUTANT)
    replay = campaign(fresh, "--replay", "--db", redis_url, NODE)
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert "InvariantViolation: [plan_matches_spec]" in replay.stdout
    assert "the failure reproduced" in replay.stdout
    assert not (fresh / ".hypothesis" / "examples").exists()

    # The fixed code is another revision: refused, unless asked to replay the old one.
    fixed = tree_copy(tmp_path / "fixed")
    refused = campaign(fixed, "--replay", "--db", redis_url, NODE)
    assert refused.returncode == 2
    assert "holds no campaign of revision" in refused.stderr
    assert result["revision"]["key"] in refused.stderr
    checked = campaign(
        fixed, "--replay", "--db", redis_url, "--revision", result["revision"]["key"], NODE
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "no failure reproduced" in checked.stdout
    assert "replayed 0 examples" not in checked.stdout
