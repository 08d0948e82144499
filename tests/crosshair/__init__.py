"""CrossHair: symbolic checks of the spec's contracts, and spec-vs-engine diffs.

See docs/crosshair.md.
"""
