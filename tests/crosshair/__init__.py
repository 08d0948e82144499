"""CrossHair: symbolic checks of the spec's contracts, and spec-vs-engine diffs.

See docs/crosshair.md.
"""

FIRST_ERROR = "KVSCHED_CROSSHAIR_FIRST_ERROR"
"""Set in ``tests.crosshair.driver``'s environment: stop at the first counterexample."""

ANALYSED: list[str] = []
"""The dotted name of the function whose condition CrossHair analyses now (the driver
pushes it); the value builders read it to draw states of that function's profiles."""
