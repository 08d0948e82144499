"""The human summary that ``kvsched run`` prints when ``--json`` is not given.

Ids and error messages come from the workload: they are printed escaped
(``kvsched.text``), so none can recolour the terminal or split a line.
"""

from __future__ import annotations

from collections import Counter

from kvsched.results import FINISHED, NOT_STARTED, PARTIAL, REJECTED, RunResult
from kvsched.text import one_line, shown


def render_summary(result: RunResult, *, title: str = "run") -> str:
    m = result.metrics
    outcomes = result.outcomes
    states = Counter(o.state for o in outcomes)
    reasons = Counter(o.finish_reason for o in outcomes if o.state == FINISHED)
    detail = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
    if result.interrupted is not None:
        title += f" (stopped by {result.interrupted})"
    head = f"{title}: {len(outcomes)} requests, {states[FINISHED]} finished"
    if detail:
        head += f" ({detail})"
    head += f", {states[REJECTED]} rejected"
    if result.interrupted is not None:
        head += f", {states[PARTIAL]} partial, {states[NOT_STARTED]} not started"
    head += f", in {m.steps} steps"
    by_mode = ", ".join(f"{mode} {n}" for mode, n in sorted(m.preemptions_by_mode.items()) if n)
    lines = [
        head,
        f"preemptions: {m.preemptions}"
        + (f" ({by_mode})" if by_mode else "")
        + f"; swapped out/in: {m.swap_out_blocks}/{m.swap_in_blocks} blocks"
        + f"; recomputed tokens: {m.recomputed_tokens}",
        f"KV cache: peak {m.peak_gpu_blocks_used} of {m.num_gpu_blocks} GPU blocks"
        + f", utilization {m.kv_utilization:.1%}; {m.tokens_per_s:.1f} tokens/s",
    ]
    if m.prefix_cache is not None:
        pc = m.prefix_cache
        lines.append(
            f"prefix cache: hit rate {pc.hit_rate:.1%} ({pc.hits} of {pc.queries} tokens)"
            + f"; reclaimed cached blocks: {pc.reclaimed_blocks}"
        )
    if m.speculative is not None:
        sp = m.speculative
        lines.append(
            f"speculative decoding: {sp.accepted_tokens} of {sp.draft_tokens} drafts accepted "
            f"({sp.acceptance_rate:.1%}), mean accepted length {sp.mean_accepted_length:.2f}"
            f"; {sp.tokens_per_forward:.2f} tokens per forward"
        )
    bad = [o for o in outcomes if o.state == REJECTED]
    if bad:
        lines.append("rejected:")
        lines.extend(
            f"  {shown(o.request_id)}"
            + (f" (line {o.line})" if o.line else "")
            + f": {one_line(o.error or '')}"
            for o in bad
        )
    return "\n".join(lines)
