"""The file ``crosshair --extra_plugin`` runs: it loads the spec's value builders.

CrossHair ``exec``s a plugin file's text, so the builders live in an ordinary module
(``tests/crosshair/symbolic.py``) that this line imports (and thereby registers).
"""

import tests.crosshair.symbolic  # noqa: F401
