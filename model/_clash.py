"""Fails the import of ``model`` if ``spec`` or ``impl`` is not kvsched's own package.

kvsched installs the generic top-level names ``spec``, ``impl`` and ``model`` (README,
"Name clashes"), so a user's ``model.py`` (or ``spec.py``, ``impl.py``) that comes
first on ``sys.path`` shadows one, and the import fails later with an obscure
``cannot import name``. Each of the three packages imports a copy of this module
first and checks the other two, so the clash is named whichever is shadowed (the
shadowed one's own code never runs). It is copied, not shared, because none may
import another for it: ``spec`` imports nothing, ``impl`` only ``spec.types``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

for name in ("spec", "impl"):
    found = importlib.util.find_spec(name)
    origin = None if found is None else found.origin
    if origin is not None and Path(origin).resolve() != ROOT / name / "__init__.py":
        raise ImportError(
            f"name clash: {name!r} is {origin}, not kvsched's package {ROOT / name}; "
            f"your own {name}.py (or {name}/) shadows it: rename it or run from elsewhere"
        )
