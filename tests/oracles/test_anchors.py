"""``scripts/check_anchors.py``: a moved anchor is named, not failed as a bug.

The planted-bug tables (mutants, CrossHair's planted bugs) patch source text. An edit
that moves an anchor but keeps the behaviour must not fail a test (a mutation campaign
would count it as a kill): the script, which ``scripts/check`` runs, names the stale
entry instead. Checked here on a copy with such an edit, never on the checkout.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def check_anchors() -> ModuleType:
    path = ROOT / "scripts" / "check_anchors.py"
    module_spec = importlib.util.spec_from_file_location("check_anchors", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["check_anchors"] = module
    module_spec.loader.exec_module(module)
    return module


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))


def test_a_harmless_edit_names_the_entries_it_moved(tmp_path: Path) -> None:
    for package in ("spec", "impl", "model"):  # every file a table patches
        shutil.copytree(ROOT / package, tmp_path / package)
    # The same statements, written differently.
    edit(
        tmp_path / "impl" / "engine.py",
        "metrics.swap_in_blocks += len(out.swap_in)",
        "metrics.swap_in_blocks = metrics.swap_in_blocks + len(out.swap_in)",
    )
    edit(
        tmp_path / "spec" / "scheduler.py",
        "                budget -= n\n            free -= need\n",
        "                budget = budget - n\n            free -= need\n",
    )
    module = check_anchors()
    stale = module.stale_anchors(tmp_path)
    assert any(line.startswith("metric-swap-in-counts-requests: impl/engine.py") for line in stale)
    assert any(line.startswith("planted A-blocks-not-taken: spec/scheduler.py") for line in stale)
    assert module.main(["--root", str(tmp_path)]) == 1
