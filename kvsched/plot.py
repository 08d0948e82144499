"""``--plot``: the KV-cache timeline of a run, drawn with matplotlib's Agg backend.

Top panel: GPU blocks used after each step against the capacity, preemptions marked
where they happened. Bottom panel: how many requests are running, waiting and
swapped after each step.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvsched.results import RunResult

PLOT_FORMATS = ("png", "svg", "pdf")  # what --plot writes (matplotlib's Agg and vector backends)


def plot_timeline(result: RunResult, path: str | Path, *, title: str = "KV cache timeline") -> None:
    timeline = result.timeline
    steps = [s.step for s in timeline]
    capacity = result.metrics.num_gpu_blocks

    fig = Figure(figsize=(9, 6), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global state
    kv, queues = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])

    kv.step(steps, [s.gpu_blocks_used for s in timeline], where="post", label="GPU blocks used")
    kv.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity ({capacity})")
    pre = [s for s in timeline if s.num_preempted]
    if pre:
        kv.scatter(
            [s.step for s in pre],
            [s.gpu_blocks_used for s in pre],
            marker="v",
            color="tab:red",
            zorder=3,
            label=f"preemption ({result.metrics.preemptions})",
        )
    kv.set_ylabel("GPU blocks")
    kv.set_ylim(0, max(capacity, 1) * 1.1)
    kv.set_title(title)
    kv.legend(loc="best", fontsize="small")

    for attr, label in (
        ("num_running", "running"),
        ("num_waiting", "waiting"),
        ("num_swapped", "swapped"),
    ):
        queues.step(steps, [getattr(s, attr) for s in timeline], where="post", label=label)
    queues.set_xlabel("step (state after it)")
    queues.set_ylabel("requests")
    queues.legend(loc="best", fontsize="small")
    for ax in (kv, queues):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)

    fig.savefig(str(path), dpi=100)
