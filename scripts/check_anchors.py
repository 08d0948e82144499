#!/usr/bin/env python
"""Do the planted-bug tables still apply to the tree? (scripts/check runs this.)

Each text patch of a mutant (scripts/mutation_check.py) and of a planted CrossHair bug
(tests/crosshair/planted.py) must match its file exactly once, and each planted bug
must name a function CrossHair checks. An edit that moves such an anchor but keeps the
behaviour is no bug, so no test fails on it (a mutation campaign over the tests would
count that failure as a kill); the table is stale instead, and this names each entry
to re-anchor. Exit 0: every entry applies; 1: the stale ones are listed.

    python scripts/check_anchors.py          # the checkout
    python scripts/check_anchors.py --root DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.crosshair.planted import PLANTED  # noqa: E402
from tests.crosshair.runner import audit_sources  # noqa: E402


def mutation_check() -> ModuleType:
    """scripts/mutation_check.py as a module (it is a script, not a package module)."""
    path = ROOT / "scripts" / "mutation_check.py"
    module_spec = importlib.util.spec_from_file_location("mutation_check", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["mutation_check"] = module  # its dataclasses look their module up
    module_spec.loader.exec_module(module)
    return module


def stale_anchors(root: Path) -> list[str]:
    """One line per entry of either table that does not apply to the tree in ``root``."""
    checker = mutation_check()
    stale = [line for m in checker.MUTANTS for line in checker.stale_patches(m, root)]
    targets = {t.name for t in audit_sources(root / "spec").targets}
    for bug in PLANTED:
        count = (root / "spec" / bug.file).read_text().count(bug.old)
        if count != 1:
            stale.append(
                f"planted {bug.name}: spec/{bug.file} contains the planted text {count} times, "
                f"not once: {bug.old!r}"
            )
        if bug.target not in targets:
            stale.append(f"planted {bug.name}: CrossHair checks no function {bug.target}")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to check")
    args = parser.parse_args(argv)
    stale = stale_anchors(args.root)
    for line in stale:
        print(line)
    if stale:
        print(f"check_anchors: {len(stale)} stale entries: re-anchor them", file=sys.stderr)
        return 1
    print(f"check_anchors: every mutant and planted bug applies to {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
