"""The ``--json`` document of ``kvsched run``.

::

    {"requests": [{"id", "line", "state", "output", "finish_reason", "num_preemptions",
                   "error"}, ...],
     "metrics": {"steps", "preemptions", "preemptions_by_mode", "swap_out_blocks",
                 "swap_in_blocks", "recomputed_tokens", "peak_gpu_blocks_used", "num_gpu_blocks",
                 "kv_utilization", "tokens_per_s",
                 "prefix_cache": {"queries", "hits", "hit_rate", "reclaimed_blocks"},
                 "speculative": {"draft_tokens", "accepted_tokens", "acceptance_rate",
                                 "mean_accepted_length", "tokens_per_forward"}},
     "interrupted": null | {"signal", "after_step"}}

``metrics.preemptions_by_mode`` counts the victims by the mode used, every mode named
(``{"recompute", "restart", "swap"}``; a swap that fell back to recompute is a
recompute). ``metrics.prefix_cache`` is there only with ``--enable-prefix-caching``,
``metrics.speculative`` only with ``--speculative-config`` (``impl.engine.EngineMetrics``
defines its figures: drafts verified, those accepted, their ratio, the tokens a run
with drafts delivers on average, the tokens generated per forward).

Requests are in workload order; ``line`` is the request's line in the workload file
(two requests may share an id once the first has finished), ``error`` the refusal of
a rejected request as ``ErrorType: message``. ``state`` is ``finished`` or
``rejected``; a run a signal stopped (``interrupted``: ``"SIGINT"`` or
``"SIGTERM"``, after step ``after_step``, the metrics counting up to it) also has
``partial`` requests (admitted, or waiting with outputs kept: ``output`` the tokens
so far, ``finish_reason`` null) and ``not_started`` ones. ``tokens_per_s`` is the
only value that depends on the machine; everything else is a function of the
workload and the options.

Ids are JSON strings as read: ``json.dumps`` escapes control characters and lone
surrogates (``"\\ud800"``), so the document is ASCII and reads back the same ids.
"""

from __future__ import annotations

import json

from kvsched.results import RunMetrics, RunResult
from spec.types import PreemptionMode

METRIC_KEYS = (
    "steps",
    "preemptions",
    "preemptions_by_mode",
    "swap_out_blocks",
    "swap_in_blocks",
    "recomputed_tokens",
    "peak_gpu_blocks_used",
    "num_gpu_blocks",
    "kv_utilization",
    "tokens_per_s",
)


def _metric(m: RunMetrics, key: str) -> object:
    if key == "preemptions_by_mode":
        return {str(mode): m.preemptions_by_mode.get(str(mode), 0) for mode in PreemptionMode}
    return getattr(m, key)


def to_document(result: RunResult) -> dict[str, object]:
    m = result.metrics
    metrics: dict[str, object] = {key: _metric(m, key) for key in METRIC_KEYS}
    if m.prefix_cache is not None:
        pc = m.prefix_cache
        metrics["prefix_cache"] = {
            "queries": pc.queries,
            "hits": pc.hits,
            "hit_rate": pc.hit_rate,
            "reclaimed_blocks": pc.reclaimed_blocks,
        }
    if m.speculative is not None:
        sp = m.speculative
        metrics["speculative"] = {
            "draft_tokens": sp.draft_tokens,
            "accepted_tokens": sp.accepted_tokens,
            "acceptance_rate": sp.acceptance_rate,
            "mean_accepted_length": sp.mean_accepted_length,
            "tokens_per_forward": sp.tokens_per_forward,
        }
    return {
        "requests": [
            {
                "id": o.request_id,
                "line": o.line,
                "state": o.state,
                "output": list(o.output),
                "finish_reason": o.finish_reason,
                "num_preemptions": o.num_preemptions,
                "error": o.error,
            }
            for o in result.outcomes
        ],
        "metrics": metrics,
        "interrupted": None
        if result.interrupted is None
        else {"signal": result.interrupted, "after_step": m.steps},
    }


def dumps(result: RunResult) -> str:
    """The document as JSON text, one request per line (outputs stay on their line)."""
    doc = to_document(result)
    requests = doc["requests"]
    assert isinstance(requests, list)
    lines = ["{", '  "requests": [' if requests else '  "requests": [],']
    for i, request in enumerate(requests):
        lines.append("    " + json.dumps(request) + ("," if i < len(requests) - 1 else ""))
    if requests:
        lines.append("  ],")
    lines.append('  "metrics": ' + json.dumps(doc["metrics"]) + ",")
    lines.append('  "interrupted": ' + json.dumps(doc["interrupted"]))
    lines.append("}")
    return "\n".join(lines)
