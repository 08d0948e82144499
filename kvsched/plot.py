"""``--plot``: the KV-cache timeline of a run, drawn with matplotlib's Agg backend.

Top panel: GPU blocks used after each step against the capacity; preemptions marked
where they happened, one marker per mode actually applied (a swap that fell back to
recompute is drawn as recompute); and, where requests wait while blocks are free,
the blocks the waiting head's prefill needs stacked on the usage as a bar: the bar
crossing the capacity line is why the head waits (R8: it is admitted whole or not
at all). Bottom panel: how many requests are running, waiting and swapped after
each step.

matplotlib is imported when a figure is drawn, not with this module (it takes a
large part of a second), so the command line can name the formats without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, BinaryIO

from kvsched.results import RunResult
from kvsched.text import plot_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOT_FORMATS = ("png", "svg", "pdf")  # what --plot writes (matplotlib's Agg and vector backends)

# One marker per mode as applied (PreemptionMode's values): colour and shape both differ.
PREEMPTION_MARKERS = (
    ("swap", "v", "tab:blue"),
    ("recompute", "x", "tab:red"),
    ("restart", "D", "tab:purple"),
)


def plot_timeline(
    result: RunResult, out: BinaryIO, *, file_format: str, title: str = "KV cache timeline"
) -> None:
    """Draw ``result``'s timeline into ``out`` as ``file_format`` (one of ``PLOT_FORMATS``)."""
    timeline_figure(result, title=title).savefig(out, format=file_format, dpi=100)


def timeline_figure(result: RunResult, *, title: str = "KV cache timeline") -> Figure:
    """The figure; ``title`` may come from the input (a file name): it is escaped."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415  (see above)
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    timeline = result.timeline
    steps = [s.step for s in timeline]
    capacity = result.metrics.num_gpu_blocks

    fig = Figure(figsize=(11, 6), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global state
    kv, queues = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])

    kv.step(steps, [s.gpu_blocks_used for s in timeline], where="post", label="GPU blocks used")
    kv.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity ({capacity})")
    blocked = [
        s
        for s in timeline
        if s.head_blocks_needed is not None and s.gpu_blocks_used + s.head_blocks_needed > capacity
    ]
    if blocked:
        kv.bar(
            [s.step for s in blocked],
            [s.head_blocks_needed or 0 for s in blocked],
            bottom=[s.gpu_blocks_used for s in blocked],
            width=1.0,
            align="edge",
            color="tab:orange",
            alpha=0.35,
            linewidth=0,
            label="waiting head's prefill:\ndoes not fit the free blocks",
        )
    for mode, marker, color in PREEMPTION_MARKERS:
        hits = [s for s in timeline if mode in s.preempted_modes]
        if hits:
            count = sum(s.preempted_modes.count(mode) for s in hits)
            kv.scatter(
                [s.step for s in hits],
                [s.gpu_blocks_used for s in hits],
                marker=marker,
                color=color,
                zorder=3,
                label=f"{mode} preemption ({count})",
            )
    kv.set_ylabel("GPU blocks")
    top = max([capacity, *(s.gpu_blocks_used + (s.head_blocks_needed or 0) for s in blocked)])
    kv.set_ylim(0, max(top, 1) * 1.1)
    kv.set_title(plot_text(title))
    kv.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")

    for attr, label in (
        ("num_running", "running"),
        ("num_waiting", "waiting"),
        ("num_swapped", "swapped"),
    ):
        queues.step(steps, [getattr(s, attr) for s in timeline], where="post", label=label)
    queues.set_xlabel("step (state after it)")
    queues.set_ylabel("requests")
    queues.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    for ax in (kv, queues):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    return fig
