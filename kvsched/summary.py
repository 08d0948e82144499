"""The human summary that ``kvsched run`` prints when ``--json`` is not given."""

from __future__ import annotations

from collections import Counter

from kvsched.results import REJECTED, RunResult


def render_summary(result: RunResult, *, title: str = "run") -> str:
    m = result.metrics
    outcomes = result.outcomes
    reasons = Counter(o.finish_reason for o in outcomes)
    rejected = reasons.pop(REJECTED, 0)
    finished = sum(reasons.values())
    detail = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
    head = f"{title}: {len(outcomes)} requests, {finished} finished"
    if detail:
        head += f" ({detail})"
    head += f", {rejected} rejected, in {m.steps} steps"
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
    bad = [o for o in outcomes if o.finish_reason == REJECTED]
    if bad:
        lines.append("rejected:")
        lines.extend(
            f"  {o.request_id}" + (f" (line {o.line})" if o.line else "") + f": {o.error}"
            for o in bad
        )
    return "\n".join(lines)
