"""Upstream-ready reproductions: a standalone script that drives only the peer.

``kvsched conform ... --emit-repro FILE`` shrinks the workload of a divergence
(``shrink``: fewer requests, shorter prompts, fewer outputs, earlier arrivals, while
the same divergence remains) and writes a script (``render``) that a peer's maintainers
can run with nothing but their package installed: no kvsched import. It builds the
peer's scheduler the way the adapter does (``repro_templates/<peer>.tmpl``), replays the
shrunk workload step by step with a deterministic stand-in for the model, and checks a
property after every step; it exits 1 with the violated property in plain words
(``FAILED at step 3: request Y hits block 15, position 4, which no forward wrote``) or
0 if the scheduler keeps it, so a fix upstream shows as a passing script.

The property is the known bug's (``PROPERTIES``, by ``KnownBug.id``). For a divergence
that is no known bug, the script holds the peer to the spec's decisions, step by step,
up to the divergence (``expected-plans``: the chunks, the victims and the free GPU
blocks), and says what the spec would have decided.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import spec
from kvsched.peers.known import KnownBug, classify
from kvsched.peers.lockstep import Divergence
from kvsched.peers.registry import PeerVersion
from kvsched.peers.vllm_v1 import max_model_len
from kvsched.workload import WorkloadRequest
from spec.oracle import HashOracle
from spec.types import InvalidRequestError, PreemptionMode, SchedulerConfig

TEMPLATES: Final = Path(__file__).parent / "repro_templates"
#: How many lockstep runs ``shrink`` may spend.
SHRINK_RUNS: Final = 400


@dataclass(frozen=True, slots=True)
class Property:
    check: str  # the script's CHECK
    words: str  # what it holds the scheduler to, for the script's docstring
    why: str = ""  # for "no-raise": what the failure means


PROPERTIES: Final = {
    "V11": Property(
        "unwritten-hit",
        "no new request's cache hit covers a (block, position) that no forward wrote",
    ),
    "N12": Property("zero-token-prefill", "every scheduled prefill computes at least one token"),
    "N5": Property("one-queue", "a preempted request is queued once (waiting), not also running"),
    "N2/N6": Property(
        "no-raise",
        "schedule() never fails on a request add() accepted",
        "the scheduler accepted a request it can never schedule (it does not fit the "
        "pool, or it is longer than one step's budget, with no chunked prefill)",
    ),
    "V0-5": Property(
        "no-raise",
        "a preemption in swap mode never aborts the engine",
        "a swap-out the CPU pool cannot take aborts the whole engine; the FIXME in "
        "Scheduler._swap_out says to abort the sequence group instead",
    ),
    "V0-6": Property(
        "no-raise",
        "schedule() never fails after a priority preemption",
        "under the priority policy with preemption_mode='swap', a request force-preempted "
        "for the waiting head (_schedule_priority_preemption) is swapped out but put into "
        "the waiting queue, and its swap-out mapping is dropped",
    ),
}
EXPECTED_PLANS: Final = Property(
    "expected-plans",
    "the scheduler decides, step by step, what the reference scheduler decides (the "
    "chunks it runs, its victims, and the free GPU blocks after the step)",
)


# --- shrinking ---------------------------------------------------------------------------


def divergence_kind(divergence: Divergence) -> str:
    """A divergence's kind: its field, with request ids and indices blanked."""
    return re.sub(r"\[\d+\]", "[i]", re.sub(r"\('[^']*'\)", "(...)", divergence.field))


def shrink(
    workload: Sequence[WorkloadRequest],
    reproduces: Callable[[Sequence[WorkloadRequest]], bool],
    *,
    max_runs: int = SHRINK_RUNS,
) -> list[WorkloadRequest]:
    """A smaller workload ``reproduces`` still holds for (greedy, one change at a time):
    drop requests, then shorten prompts from the end, lower ``max_tokens``, move
    arrivals earlier; repeated until nothing changes or ``max_runs`` runs are spent."""
    current = list(workload)
    runs = 0

    def attempt(candidate: list[WorkloadRequest]) -> bool:
        nonlocal runs, current
        if runs >= max_runs:
            return False
        runs += 1
        if reproduces(candidate):
            current = candidate
            return True
        return False

    changed = True
    while changed and runs < max_runs:
        changed = False
        i = 0
        while i < len(current) and len(current) > 1:
            if not attempt(current[:i] + current[i + 1 :]):
                i += 1
            else:
                changed = True
        for i in range(len(current)):
            for smaller in _smaller(current[i]):
                if attempt([*current[:i], smaller, *current[i + 1 :]]):
                    changed = True
                    break
    return current


def _smaller(r: WorkloadRequest) -> list[WorkloadRequest]:
    found = []
    if len(r.prompt) > 1:
        found.append(replace(r, prompt=r.prompt[: len(r.prompt) // 2] or r.prompt[:1]))
        found.append(replace(r, prompt=r.prompt[:-1]))
    if r.params.max_tokens > 1:
        found.append(replace(r, params=replace(r.params, max_tokens=r.params.max_tokens // 2)))
        found.append(replace(r, params=replace(r.params, max_tokens=r.params.max_tokens - 1)))
    if r.arrival_step > 0:
        found.append(replace(r, arrival_step=r.arrival_step - 1))
    return found


# --- the script ---------------------------------------------------------------------------


def peer_settings(engine: str, config: SchedulerConfig, eos: int | None) -> dict[str, object]:
    """The scheduler's settings in the peer's own terms (what its adapter passes)."""
    length = max_model_len(config)
    common: dict[str, object] = {
        "num_gpu_blocks": config.num_gpu_blocks,
        "block_size": config.block_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
    }
    if engine == "nano-vllm":
        return {**common, "eos": -1 if eos is None else eos}
    policy = {"lifo": "fcfs", "priority": "priority"}.get(config.policy, config.policy)
    common |= {
        "max_model_len": length,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "policy": policy,
    }
    if engine == "vllm":
        return {**common, "enable_prefix_caching": config.enable_prefix_caching}
    swap = config.preemption_mode is PreemptionMode.SWAP
    return {
        **common,
        "num_cpu_blocks": config.num_cpu_blocks,
        "preemption_mode": "swap" if swap else None,
    }


def expected_plans(
    config: SchedulerConfig, workload: Sequence[WorkloadRequest], oracle: HashOracle, steps: int
) -> list[dict[str, object]]:
    """The spec's decisions and the state after each of the first ``steps`` steps."""
    state = spec.init_state(config)
    pending = sorted(workload, key=lambda r: r.arrival_step)
    expected: list[dict[str, object]] = []
    while len(expected) < steps and (pending or spec.has_unfinished_requests(state)):
        while pending and pending[0].arrival_step <= state.num_steps:
            r = pending.pop(0)
            try:
                state = spec.add_request(state, r.request_id, r.prompt, r.params)
            except InvalidRequestError:
                continue
        state, plan = spec.step(state, oracle)
        expected.append(
            {
                "scheduled": [[c.request_id, c.start, c.num_tokens] for c in plan.scheduled],
                "preempted": [p.request_id for p in plan.preempted],
                "free_gpu_blocks": state.num_free_gpu_blocks,
            }
        )
    return expected


def render(
    engine: str,
    config: SchedulerConfig,
    workload: Sequence[WorkloadRequest],
    *,
    divergence: Divergence,
    bug: KnownBug | None,
    version: PeerVersion | None,
    oracle_vocab: int,
    eos: int | None,
    command: str,
) -> str:
    """The standalone script for ``workload`` (already shrunk)."""
    prop = PROPERTIES.get(bug.id, EXPECTED_PLANS) if bug is not None else EXPECTED_PLANS
    oracle = HashOracle(vocab_size=oracle_vocab)
    expected = (
        expected_plans(config, workload, oracle, divergence.step + 1)
        if prop is EXPECTED_PLANS
        else []
    )
    ran = "?" if version is None else f"{version.distribution} {version.version}"
    what = (
        f"{bug.id} (docs/peers.md): {bug.summary}"
        if bug is not None
        else f"a divergence from kvsched's spec (profile {config.semantics}): {divergence}"
    )
    upstream = f"\nUpstream: {bug.upstream}.\n" if bug is not None and bug.upstream else ""
    confirmed = f" on {bug.versions}" if bug is not None else f" on {ran}"
    requests = [
        {
            "id": r.request_id,
            "prompt": list(r.prompt),
            "max_tokens": r.params.max_tokens,
            "eos_token_id": r.params.eos_token_id,
            "ignore_eos": r.params.ignore_eos,
            "priority": r.params.priority,
            "arrival": r.arrival_step,
        }
        for r in workload
    ]
    head = f'''#!/usr/bin/env python3
"""Reproduction for {engine}'s scheduler ({ran}): {what}

Run it where the peer is installed; it needs nothing else (no kvsched):

    python {{this file}}

It replays {len(workload)} request(s) through the scheduler alone, with a deterministic
stand-in for the model, and checks after every step that {prop.words}.
Expected{confirmed}: it prints "FAILED at step ...: <the violated property>" and exits 1;
it exits 0 ("OK") where the scheduler keeps the property.
{upstream}
Written by `kvsched conform --emit-repro` (kvsched's docs/peers.md) from:
    {command}
"""

import sys
from pathlib import Path

CHECK = {prop.check!r}
NO_RAISE_WHY = {prop.why!r}
REFERENCE = "kvsched's spec, profile {config.semantics} (docs/semantics.md)"
VOCAB = {oracle_vocab}
SALT = 0
MAX_STEPS = {10 * (divergence.step + 1) + 1000}
CONFIG = {_literal(peer_settings(engine, config, eos))}
REQUESTS = {_literal(requests)}
EXPECTED = {_literal(expected)}
'''
    driver = (TEMPLATES / f"{engine}.tmpl").read_text()
    main = (TEMPLATES / "main.tmpl").read_text()
    return head + driver + main


def failure(output: str) -> str | None:
    """A script's failure, without its numbers and names: what shrinking must keep."""
    line = next((ln for ln in output.splitlines() if ln.startswith("FAILED")), None)
    if line is None:
        return None
    raised = re.search(r"raised (\w+)", line)
    return raised.group(1) if raised else re.sub(r"at step \d+: .*", "", line)


def emit(
    path: str | Path,
    engine: str,
    config: SchedulerConfig,
    workload: Sequence[WorkloadRequest],
    divergence: Divergence,
    *,
    run: Callable[[str], tuple[int, str]],  # kvsched.peers.server.run_script, here or there
    version: PeerVersion | None,
    oracle_vocab: int,
    eos: int | None,
    command: str,
) -> tuple[int, str, str]:
    """Write the script of ``divergence`` to ``path``, its workload shrunk while the
    script (``run`` runs it where the peer is) still fails the same way.

    Returns the requests kept, the script's check and what it printed last.
    """
    bug = classify(engine, divergence, version=None if version is None else version.version)
    prop = PROPERTIES.get(bug.id, EXPECTED_PLANS) if bug is not None else EXPECTED_PLANS

    def script(candidate: Sequence[WorkloadRequest], at: Divergence) -> str:
        return render(
            engine,
            config,
            candidate,
            divergence=at,
            bug=bug,
            version=version,
            oracle_vocab=oracle_vocab,
            eos=eos,
            command=command,
        )

    code, output = run(script(workload, divergence))
    wanted = failure(output) if code == 1 else None
    shrunk = list(workload)
    if wanted is not None:

        def reproduces(candidate: Sequence[WorkloadRequest]) -> bool:
            code, output = run(script(candidate, divergence))
            return code == 1 and failure(output) == wanted

        shrunk = shrink(workload, reproduces)
        code, output = run(script(shrunk, divergence))
    Path(path).write_text(script(shrunk, divergence), encoding="utf-8")
    lines = output.strip().splitlines()
    return len(shrunk), prop.check, next((ln for ln in lines if ln.startswith("FAILED")), "")


def _literal(value: object) -> str:
    """``value`` as Python source (JSON's, with Python's None/True/False)."""
    text = json.dumps(value, separators=(", ", ": "))
    return re.sub(r"\b(null|true|false)\b", lambda m: _PY[m.group(1)], text)


_PY: Final = {"null": "None", "true": "True", "false": "False"}


__all__ = [
    "EXPECTED_PLANS",
    "PROPERTIES",
    "Property",
    "divergence_kind",
    "emit",
    "expected_plans",
    "failure",
    "peer_settings",
    "render",
    "shrink",
]
