"""``crosshair check``, run in this process, that also says how far each search went.

CrossHair reports a postcondition as "Confirmed over all paths", "Not confirmed" (no
counterexample before the budget ran out) or an error; how many paths stand behind a
"Not confirmed" appears only in its debug log, which is too large to keep. This
driver wraps two CrossHair internals (``crosshair.core.explore_loop``, which runs the
paths of one condition, and ``analyze_calltree``, which calls it for one
postcondition) and prints one more line per postcondition::

    /path/to/file.py:123: paths: 17 run, 2 discarded

``run`` counts the paths executed, ``discarded`` those abandoned before the function
returned (an input the builders or a precondition rejected). The runner
(``tests/crosshair/runner.py``) reads these lines beside CrossHair's own. Everything
else is ``python -m crosshair`` unchanged: the same arguments, output and exit status.

It also tells the value builders which module's function is analysed
(``tests.crosshair.ANALYSED``), so that a state given to one profile's own step
(``spec.offload``, ``spec.reserve``) has that profile (``symbolic.DOMAINS``).

It also gives each postcondition its own random sequence of paths. CrossHair starts
the search of every condition from one fixed seed, so the postconditions of one
function (the same arguments, the same branches) replay nearly the same first paths,
and three postconditions explore little more than one. The driver seeds each search
from the function's name and the postcondition's text instead: still reproducible
(the same condition explores the same paths, in the real spec and in a planted copy),
but different conditions explore different paths.

With ``KVSCHED_CROSSHAIR_FIRST_ERROR`` set (the planted stage sets it), the first
counterexample is printed as soon as its postcondition's search ends, in CrossHair's own
``file:line: error: ...`` form, and the process exits with status 1. CrossHair itself
prints its messages only after every postcondition of the function was searched, so a
planted bug found by the first of two postconditions in 2 s used to cost the whole
budget of the second one too before it showed up.

The wrapped names are internals of the pinned ``crosshair-tool`` version; if they
move, the runner finds no ``paths:`` line and says so.
"""

from __future__ import annotations

import os
import random
import sys
import zlib
from collections.abc import Callable
from typing import Any

from crosshair import IgnoreAttempt, core
from crosshair.main import main, short_describe_message

from tests.crosshair import ANALYSED, FIRST_ERROR

_counts: list[list[int]] = []  # [run, discarded] of the condition being analysed
_seed: list[int] = []  # the seed of the condition being analysed


def _explore_loop(
    options: Any, search_root: Any, run_path: Callable[[Any], Any], *args: Any, **kwargs: Any
) -> Any:
    counts = [0, 0]
    _counts.append(counts)
    if _seed:
        search_root._random = random.Random(_seed[-1])

    def counted(space: Any) -> Any:
        counts[0] += 1
        try:
            outcome = run_path(space)
        except IgnoreAttempt:
            counts[1] += 1
            raise
        if outcome.analysis.verification_status is None:  # e.g. a precondition was false
            counts[1] += 1
        return outcome

    return _original_explore_loop(options, search_root, counted, *args, **kwargs)


def _analyze_calltree(options: Any, conditions: Any) -> Any:
    start = len(_counts)
    post = conditions.post[0]
    _seed.append(zlib.crc32(f"{conditions.fn.__qualname__}: {post.expr_source}".encode()))
    ANALYSED.append(f"{conditions.fn.__module__}.{conditions.fn.__qualname__}")
    try:
        analysis = _original_analyze_calltree(options, conditions)
    finally:
        _seed.pop()
        ANALYSED.pop()
    run = sum(c[0] for c in _counts[start:])
    discarded = sum(c[1] for c in _counts[start:])
    del _counts[start:]
    sys.stdout.write(f"{post.filename}:{post.line}: paths: {run} run, {discarded} discarded\n")
    if os.environ.get(FIRST_ERROR):
        for message in analysis.messages:
            line = short_describe_message(message, options)
            if line is not None and ": error: " in line:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
                os._exit(1)  # no cleanup to wait for: the searches are over
    sys.stdout.flush()
    return analysis


_original_explore_loop = core.explore_loop
_original_analyze_calltree = core.analyze_calltree
core.explore_loop = _explore_loop
core.analyze_calltree = _analyze_calltree

if __name__ == "__main__":
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # each result as soon as it is known
    main()
