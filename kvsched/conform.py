"""``kvsched conform``: the reference scheduler and an engine in lockstep.

The comparison itself is ``kvsched.peers.lockstep`` (shared with the peer tests);
this module picks the scheduler under test and renders the one-line verdict.
``--engine kvsched`` is our ``LLMEngine`` (its model samples); ``vllm`` and
``nano-vllm`` are those projects' real schedulers, sampling with a pure toy oracle
(``HashOracle(oracle_vocab)``) so that the spec and the peer apply the same tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace

from kvsched.drive import StepCallback, admission_window
from kvsched.peers.known import classify
from kvsched.peers.lockstep import LockstepReport, run_workload
from kvsched.peers.protocol import SchedulerUnderTest
from kvsched.peers.registry import PeerVersion
from kvsched.workload import WorkloadRequest
from spec.oracle import HashOracle, PromptLookupDrafter
from spec.types import SchedulerConfig

ConformReport = LockstepReport


def conform(
    peer: SchedulerUnderTest,
    config: SchedulerConfig,
    workload: Sequence[WorkloadRequest],
    *,
    oracle_vocab: int = 256,
    max_steps: int | None = None,
    on_step: StepCallback | None = None,
    speculative: PromptLookupDrafter | None = None,
) -> ConformReport:
    """Run ``workload`` through ``peer`` and the spec in lockstep; stop at a divergence.

    Arrivals are admitted lazily where the policy allows it (``admission_window``): the
    spec's state is immutable tuples, so a long waiting queue would cost every step.
    ``speculative``: the n-gram drafter both sides propose with (vllm-v1/spec-propose;
    it stops at the config's ``max_model_len``, as vLLM's does).
    """
    return run_workload(
        peer,
        config,
        workload,
        HashOracle(vocab_size=oracle_vocab),
        max_steps=max_steps,
        on_step=on_step,
        window=admission_window(config),
        drafter=None
        if speculative is None
        else replace(speculative, max_model_len=config.max_model_len),
    )


def setup(
    config: SchedulerConfig, engine: str = "kvsched", version: PeerVersion | None = None
) -> str:
    """What the verdict was reached under: ``vllm, policy lifo, recompute mode``; for a
    peer, the ``version`` that ran (and where, when not in this process)."""
    text = f"policy {config.policy}, {config.preemption_mode} mode"
    if engine == "kvsched":
        return text
    ran = engine
    if version is not None and version.version is not None:
        ran = f"{engine}: {version.distribution} {version.version}"
        if version.python != sys.executable:
            ran = f"{ran} in {version.python}"
    return f"{ran}, {text}"


def _drafts_text(report: ConformReport, config: SchedulerConfig) -> str:
    """Under speculative decoding: the drafts run and accepted, and the rate."""
    if not config.num_speculative_tokens:
        return ""
    rate = f" ({report.accepted / report.drafts:.0%})" if report.drafts else ""
    return f", {report.drafts} drafts, {report.accepted} accepted{rate}"


def render(
    report: ConformReport,
    config: SchedulerConfig,
    engine: str = "kvsched",
    *,
    version: PeerVersion | None = None,
) -> str:
    """The one-line verdict, under ``setup``'s line, and a known peer bug the divergence
    is the signature of."""
    setup_text = setup(config, engine, version)
    if report.divergence is None:
        return (
            f"conform: ok: spec and engine agree at all {report.steps} steps "
            f"({report.num_requests} requests, {report.num_rejected} rejected, "
            f"{report.preemptions} preemption{'' if report.preemptions == 1 else 's'}"
            f"{_drafts_text(report, config)}; {setup_text})"
        )
    verdict = f"conform: DIVERGED at {report.divergence} ({setup_text})"
    bug = classify(engine, report.divergence, version=None if version is None else version.version)
    if bug is None:
        return verdict
    return (
        f"{verdict}\n  known peer bug {bug.id}, confirmed on {bug.versions} "
        f"(docs/peers.md): {bug.summary}"
    )
