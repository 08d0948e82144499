"""Print what vLLM's scheduler does, step by step, with async scheduling or n-gram
speculative decoding on: the scenarios of tests/peers/engine_order.py (the tests in
tests/peers/test_vllm_engine_order.py assert what each shows)::

    PYTHONPATH=. python scripts/vllm_engine_steps.py    # every scenario
    PYTHONPATH=. python scripts/vllm_engine_steps.py async-preempt-in-flight spec-budget

One line per ``EngineCore`` step: the chunks ``schedule()`` decided (request, start,
tokens), the drafts scheduled, the output placeholders after it, the victims; then
which step's output ``update_from_output()`` applied and what it did (tokens appended,
drafts rejected, outputs delivered to a preempted request or discarded, finishes).
"""

from __future__ import annotations

import argparse

from kvsched.peers.vllm_v1 import EngineStep
from tests.peers.engine_order import SCENARIOS, trace


def line(step: EngineStep) -> str:
    parts = [f"{step.step:>2}: sched {list(step.scheduled)}"]
    if step.spec_decode:
        parts.append(f"drafts {dict(step.spec_decode)}")
    if step.placeholders:
        parts.append(f"placeholders {dict(step.placeholders)}")
    if step.preempted:
        parts.append(f"preempted {list(step.preempted)}")
    if step.processed is not None:
        applied = f"| applied {step.processed}: {dict(step.sampled)}"
        if step.rejected:
            applied += f" rejected {dict(step.rejected)}"
        if step.stale:
            applied += f" stale {list(step.stale)}"
        if step.discarded:
            applied += f" discarded {list(step.discarded)}"
        if step.finished:
            applied += " finished " + ", ".join(
                f"{f.request_id} {f.finish_reason.value} {list(f.output_token_ids)}"
                for f in step.finished
            )
        parts.append(applied)
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", choices=[[], *sorted(SCENARIOS)], default=[])
    names = parser.parse_args().names or sorted(SCENARIOS)
    for name in names:
        scenario = SCENARIOS[name]
        result = trace(scenario)
        config = scenario.config
        print(
            f"== {name}: {config.num_gpu_blocks} blocks of {config.block_size}, budget "
            f"{config.max_num_batched_tokens}, caching {config.enable_prefix_caching}; "
            f"requests {[(a[0], a[1], a[2], a[3].max_tokens) for a in scenario.requests]}"
        )
        for step in result.steps:
            print("  " + line(step))


if __name__ == "__main__":
    main()
