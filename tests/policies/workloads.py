"""A small workload on which every shipped policy preempts, ``reserve`` included.

6 GPU blocks of 4 tokens and a 4-token budget: prefills are chunked, so requests fall
behind the one-token-per-step schedule that ``reserve``'s estimate assumes, and even it
must preempt. (Found by a search over small random workloads; no EOS, so the sampled
tokens do not change the scheduling.)
"""

from __future__ import annotations

from spec.types import PreemptionMode, SamplingParams, SchedulerConfig

#: (id, prompt, max_tokens, arrival_step, priority)
REQUESTS: tuple[tuple[str, tuple[int, ...], int, int, int], ...] = (
    ("r0", (1, 2, 3), 8, 0, 1),
    ("r1", (8, 9, 10, 11, 12, 13), 9, 0, 0),
    ("r3", (22, 23, 24, 25, 26, 27, 28), 2, 2, 2),
    ("r2", (15, 16, 17, 18, 19), 3, 3, 0),
    ("r4", (29, 30, 31, 32, 33, 34, 35, 36), 5, 4, 1),
    ("r7", (50, 51, 52, 53), 8, 5, 2),
    ("r5", (36, 37, 38, 39), 4, 6, 0),
    ("r6", (43, 44, 45, 46, 47, 48), 1, 6, 1),
)

#: The options that make it preempt (vLLM's names, as ``kvsched`` takes them).
OPTIONS = {
    "num_gpu_blocks": 6,
    "block_size": 4,
    "max_num_batched_tokens": 4,
    "num_cpu_blocks": 3,
}


def config(policy: str, mode: str = "recompute") -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=OPTIONS["num_gpu_blocks"],
        block_size=OPTIONS["block_size"],
        max_num_batched_tokens=OPTIONS["max_num_batched_tokens"],
        num_cpu_blocks=OPTIONS["num_cpu_blocks"],
        preemption_mode=PreemptionMode(mode),
        policy=policy,
    )


def params(max_tokens: int, priority: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, priority=priority)


def jsonl_lines() -> list[dict[str, object]]:
    """The workload as ``kvsched`` workload lines."""
    return [
        {
            "id": rid,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "arrival_step": arrival,
            "priority": priority,
        }
        for rid, prompt, max_tokens, arrival, priority in REQUESTS
    ]


def cli_options() -> list[str]:
    options: list[str] = []
    for key, value in OPTIONS.items():
        options += [f"--{key.replace('_', '-')}", str(value)]
    return options
