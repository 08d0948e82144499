"""The forward worker of the engine's async step: one thread that runs the forwards in
the order they were submitted, as a CUDA stream orders kernels.

Under async scheduling (impl/pipeline.py) the engine submits step N's forward and goes
on to apply step N-1's outputs and schedule step N+1 while it runs. A forward scheduled
on placeholders needs the tokens the step before it sampled: the worker hands them over
(``SchedulerOutput.pending``) when it starts the forward, after that step's forward has
finished. A forward whose predecessor failed does not run (``ForwardSkipped``): its
inputs are not known.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from impl.pipeline import InFlightStep
from impl.scheduler_output import SchedulerOutput
from spec.types import KVSchedError


class ForwardSkipped(KVSchedError, RuntimeError):
    """A forward not run because the forward before it failed."""


class ForwardWorker:
    """Runs ``execute`` on submitted steps, one at a time, in submission order."""

    def __init__(self, execute: Callable[[SchedulerOutput], list[int]]) -> None:
        self.execute = execute
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsched-forward")

    def submit(
        self,
        out: SchedulerOutput,
        after: tuple[InFlightStep, Future[list[int]]] | None,
    ) -> Future[list[int]]:
        """Run ``out``'s forward once ``after`` (the step in flight before it, and its
        forward) has run, with the tokens it brings."""

        def run() -> list[int]:
            if after is not None:
                step, forward = after
                if forward.exception() is not None:
                    raise ForwardSkipped(f"step {out.step}: the forward before it failed")
                out.pending = step.pending(forward.result())
            return self.execute(out)

        return self._executor.submit(run)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
