"""The ``kvsched`` command line: demo, workload generation, runs, plots and conformance.

This package is the one place that imports both the reference scheduler (``spec``)
and the engine (``impl``): ``kvsched conform`` drives them side by side. Nothing in
``spec`` or ``impl`` imports it.
"""
