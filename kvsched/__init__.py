"""The ``kvsched`` command line: demo, workload generation, runs, plots and conformance.

This package is the one place that imports both the reference scheduler (``spec``)
and the engine (``impl``): ``kvsched conform`` drives them side by side. Nothing in
``spec`` or ``impl`` imports it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _check_names() -> None:
    """Name a user's ``spec.py``, ``impl.py`` or ``model.py`` that shadows ours.

    ``python -m kvsched`` puts the working directory first on ``sys.path``. The three
    packages check each other at import (``spec/_clash.py``), but the first one the
    CLI imports would fail with Python's own error if it were the shadowed one, so
    the checks of ``spec`` (impl, model) and ``model`` (spec, impl) run here from
    their files, without importing either package.
    """
    root = Path(__file__).resolve().parents[1]
    for package in ("spec", "model"):
        found = importlib.util.spec_from_file_location(
            f"kvsched._{package}_clash", root / package / "_clash.py"
        )
        assert found is not None and found.loader is not None
        found.loader.exec_module(importlib.util.module_from_spec(found))


_check_names()
