"""What a run reached and how much it checked: coverage events and throughput.

Each run of a machine (``harness.run_machine``) gets its own ``RunRecord``; the machine
counts every event it reaches there (and passes it to ``hypothesis.event``) and its
differential steps, so the test can assert that a ``ci`` run reaches every path its
subject requires (``Subject.required``: built from the sets below) and print the
throughput.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from spec.types import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidMaxTokensError,
    PreemptionMode,
    RequestTooLargeError,
    TokenOutOfVocabError,
    UnknownRequestError,
)
from tests.stateful.nano_cache import NANO_CACHE_EVENTS
from tests.stateful.strategies import BLOCK_SIZES, FAULT_KINDS, POLICY_NAMES, SEMANTICS


@dataclass
class RunStats:
    """What one machine's run checked (filled by the machine, timed by the test)."""

    examples: int = 0
    steps: int = 0  # committed differential steps (rules and drains)
    drain_steps: int = 0
    rejected_steps: int = 0  # faulted steps: rolled back and compared
    cpu_seconds: float = 0.0
    max_drain_ratio: dict[str, float] = field(default_factory=dict)  # policy -> actual/LIFO bound

    def steps_per_cpu_second(self) -> float:
        return self.steps / self.cpu_seconds if self.cpu_seconds > 0 else 0.0


@dataclass
class RunRecord:
    """One run's coverage (event label -> occurrences, over its examples) and stats."""

    coverage: Counter[str] = field(default_factory=Counter)
    stats: RunStats = field(default_factory=RunStats)


def stats_dir() -> Path:
    """Where each test writes its stats for the terminal summary (tests/stateful/conftest.py)."""
    path = Path(
        os.environ.get("KVSCHED_STATEFUL_STATS")
        or Path(tempfile.gettempdir()) / f"kvsched-stateful-{os.getppid()}"
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_report(
    machine: str,
    profile: str,
    record: RunRecord,
    missing: Sequence[str],
    *,
    required: bool = True,
) -> str:
    """Render (and save, for the terminal summary) the run's coverage and throughput.

    ``missing`` paths read as a failure only where the profile requires them
    (``required``); a short ``dev`` run (``scripts/check --quick``) lists them plainly.
    """
    stats = record.stats
    coverage = record.coverage
    lines = [
        f"{machine} [{profile}]: {stats.examples} examples, {stats.steps} differential steps "
        f"({stats.drain_steps} in drains, {stats.rejected_steps} faulted and rolled back) in "
        f"{stats.cpu_seconds:.1f} CPU s = {stats.steps_per_cpu_second():.0f} steps/CPU-s",
    ]
    if stats.max_drain_ratio:
        ratios = ", ".join(f"{k}={v:.3f}" for k, v in sorted(stats.max_drain_ratio.items()))
        lines.append(f"  max drain steps / LIFO bound: {ratios}")
    for label, count in sorted(coverage.items()):
        lines.append(f"  {count:>8}  {label}")
    if missing and required:
        lines.append(f"  NOT REACHED: {', '.join(missing)}")
    elif missing:
        lines.append(f"  not reached in this short run (required in ci only): {', '.join(missing)}")
    text = "\n".join(lines)
    summary = {"machine": machine, "profile": profile, "text": text}
    (stats_dir() / f"{machine}-{os.getpid()}.json").write_text(json.dumps(summary))
    return text


#: vllm-v1/priority-victim-any-running needs ``priority``, contention and a less important
#: request scheduled ahead of the one that needs blocks: about once per ci run of the
#: scheduler machine (2 000 examples), not on every stream, so no machine requires it;
#: tests/impl/test_undone_victim.py takes it on a fixed workload, async off and on.
UNDONE_VICTIM_EVENT: Final = (
    "vllm-v1/priority-victim-any-running: a scheduled victim's chunk undone"
)

#: V11's second trigger's shape (docs/peers.md): with caching on, a victim's undone
#: chunk was a prefill chunk, whose blocks the spec unkeys and vLLM leaves keyed.
UNDONE_PREFILL_EVENT: Final = "vllm-v1/undone-chunk-unkeyed: an undone prefill chunk"

#: vllm-v0/watermark needs a pool of 100 blocks or more (1% of it is the watermark) whose
#: free blocks are exactly what the waiting or swapped head needs: a few examples in the
#: scheduler subject's ci run on some streams, none on others, fewer than one in the
#: engine's (the same impl.Scheduler code); the vLLM V0 machine requires it, and
#: tests/impl/test_watermark.py takes it on a fixed workload.
WATERMARK_EVENT: Final = "vllm-v0/watermark: the watermark held back an admission or a swap-in"

#: Paths our machines (the toy scheduler's and the engine's subjects) must reach in a
#: ``ci`` (and ``nightly``) run.
REQUIRED_EVENTS: Final = frozenset(
    {
        *(f"config: policy={name}" for name in POLICY_NAMES),
        *(f"config: semantics={name}" for name in SEMANTICS),
        # Each profile rule made a difference at least once (tests/stateful/events.py).
        "vllm-v1/max-model-len: length at max_model_len",
        "vllm-v1/full-sequence-admission: the gate held a request back",
        "vllm-v1/long-prefill-cap: a chunk cut to the cap",
        "vllm-v1/long-prefill-cap: a prompt chunked with chunked prefill off",
        "vllm-v1/long-prefill-cap: the adaptive floor raised the cap",
        "vllm-v1/long-prefill-cap: a lone request's chunk over the threshold, uncut",
        "nano-vllm/prefill-first: a prefill-only step with requests running",
        "nano-vllm/decode-unbudgeted: a decode step over the token budget",
        "nano-vllm/victim-next: a victim lifo would not have chosen",
        "nano-vllm/seq-limit-per-step: more than max_num_seqs running",
        "vllm-v0/max-model-len: length at max_model_len",
        "vllm-v0/prefill-first: a prefill-only step with requests running",
        "vllm-v0/prefill-first: no admission after every swapped request came back",
        "vllm-v0/append-touches-last-block: a preemption R5 would not have made",
        *(f"config: mode={mode}" for mode in PreemptionMode),
        *(f"config: block_size={bs}" for bs in BLOCK_SIZES),
        "config: chunked prefill on",
        "config: chunked prefill off",
        *(f"preempt: {mode}" for mode in PreemptionMode),
        "preempt: swap fell back to recompute (CPU pool full)",
        "preempt: several victims in one step",
        "admission held back by a preemption",
        "swap-in",
        "chunked prefill: partial chunk",
        "chunked prefill: last chunk of a resumed prefill",
        "re-prefill of prompt + kept outputs",
        "max_num_seqs reached with requests waiting",
        "finish: stop",
        "finish: length",
        "finish: EOS sampled but ignored",
        "add: with EOS",
        "add: reused the id of a finished request",
        "abort: waiting",
        "abort: waiting after a preemption",
        "abort: running mid-prefill",
        "abort: running (decoding)",
        "abort: swapped",
        "abort: id of a finished request",
        *(
            f"reject: {error.__name__}"
            for error in (
                EmptyPromptError,
                InvalidMaxTokensError,
                TokenOutOfVocabError,
                DuplicateRequestError,
                RequestTooLargeError,
                UnknownRequestError,
            )
        ),
        "fault: in a step that preempted",
        *(f"fault: {kind}" for kind in FAULT_KINDS),
    }
)

PREFIX_EVENTS: Final = frozenset(
    {
        "config: prefix caching on",
        "prefix: hit",
        "prefix: partial hit (fewer blocks than it could hit)",
        "prefix: full-prompt hit (every block it may hit)",
        "prefix: full-prompt hit on exactly k blocks (last block recomputed)",
        "prefix: hit on blocks keyed in the same step",
        "prefix: hit on a free cached block",
        "prefix: block shared by running requests",
        "prefix: cached block reclaimed",
        "prefix: resumed request hit its own freed blocks",
        "prefix: resent prompt hit",
    }
)

#: The required events of the vllm-v0 profile: unreachable where a subject draws no
#: vllm-v0 config.
VLLM_V0_EVENTS: Final = frozenset(
    e for e in REQUIRED_EVENTS if e.startswith(("vllm-v0/", "config: semantics=vllm-v0"))
)

#: Our subjects with caching on never swap (caching refuses swap mode), and draw no
#: vllm-v0 config (the profile does not model V0's prefix cache: its configs refuse
#: caching); every other profile may cache, so every other event stays required.
_UNREACHABLE_WITH_CACHING: Final = frozenset(
    {
        *VLLM_V0_EVENTS,
        "config: mode=swap",
        "preempt: swap",
        "preempt: swap fell back to recompute (CPU pool full)",
        "swap-in",
        "abort: swapped",
        "fault: swap-out copy",
        "fault: swap-in copy",
    }
)

#: "vllm-v1/full-sequence-admission: the gate held back a request with a hit" (the hit
#: credited, the rest of the sequence still too large) needs a chunk cut short of the
#: sequence right then: no ci run of the prefix scheduler machine met it while only the
#: budget cut chunks (386 vllm-v1 examples, 246 gate refusals, none with a hit); with
#: vllm-v1/long-prefill-cap drawn, 395 times in 252 vllm-v1 examples (2026-12-03).
GATE_HIT_EVENT: Final = "vllm-v1/full-sequence-admission: the gate held back a request with a hit"

PREFIX_REQUIRED_EVENTS: Final = (
    (REQUIRED_EVENTS - _UNREACHABLE_WITH_CACHING)
    | PREFIX_EVENTS
    | NANO_CACHE_EVENTS
    | {GATE_HIT_EVENT}
)
