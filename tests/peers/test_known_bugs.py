"""Known peer bugs (``kvsched.peers.known``, docs/peers.md), pinned to the peer's version.

Each bug has a test of the right behaviour that fails on the version it was found in
(``xfail(strict=True)``): when an upstream fix lands, the test passes, strict xfail
turns that into a failure, and the entry (and the machines' early stop) must go. On
another version the mark does not apply and the test must pass as written. Each also
has a test that the lockstep divergence it causes carries the signature the peer
machines classify it by.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

import spec
from kvsched.peers import make_peer
from kvsched.peers.known import N2_N6, N5, N12, V11, KnownBug, classify, installed_version
from kvsched.peers.lockstep import run_workload
from kvsched.peers.protocol import PeerFailure
from kvsched.peers.vllm_v1 import VllmAdapter
from kvsched.workload import WorkloadRequest, read_workload
from spec.oracle import HashOracle
from spec.types import InvalidRequestError, SamplingParams, SchedulerConfig, Semantics
from tests.cli.helpers import Invoke
from tests.peers.conftest import require_peer

ORACLE = HashOracle(vocab_size=8)
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)


def nano_config(fields: dict[str, int]) -> SchedulerConfig:
    return SchedulerConfig(
        num_gpu_blocks=fields["num_gpu_blocks"],
        block_size=fields["block_size"],
        max_num_batched_tokens=fields.get("max_num_batched_tokens", 2048),
        enable_chunked_prefill=False,
        enable_prefix_caching=True,
        semantics=Semantics.NANO_VLLM,
    )


def on_pinned_version(bug: KnownBug) -> pytest.MarkDecorator:
    """Expected to fail on the versions the bug was confirmed on (``KnownBug.covers``)."""
    return pytest.mark.xfail(
        bug.covers(installed_version(bug)),
        reason=f"{bug.id} on {bug.versions}: {bug.summary}",
        raises=(AssertionError, PeerFailure),
        strict=True,
    )


#: tests/peers/repros/running_keeps_victim.jsonl: two requests, one block each, that
#: both need a second block at their first decode.
N5_CONFIG = {"num_gpu_blocks": 2, "block_size": 2}
N5_WORKLOAD = [
    WorkloadRequest(request_id="r0", prompt=(201, 2), params=PARAMS),
    WorkloadRequest(request_id="r1", prompt=(202, 3), params=PARAMS),
]
#: tests/peers/repros/prefix_hit.jsonl: the same prompt of one whole block, twice.
N12_CONFIG = {"num_gpu_blocks": 8, "block_size": 4}
N12_WORKLOAD = [
    WorkloadRequest(request_id=f"r{i}", prompt=(5, 6, 7, 8), params=PARAMS) for i in range(2)
]
#: A request that never fits the pool (N6), and one longer than the budget (N2).
NEVER_SCHEDULED = {
    "never-fits": ({"num_gpu_blocks": 2, "block_size": 4}, tuple(range(1, 10))),
    "longer-than-budget": (
        {"num_gpu_blocks": 8, "block_size": 4, "max_num_batched_tokens": 4},
        (201, 2, 3, 4, 5, 6),
    ),
}


@on_pinned_version(N5)
def test_n5_a_preempted_victim_leaves_running() -> None:
    require_peer("nano-vllm")
    peer = make_peer("nano-vllm", nano_config(N5_CONFIG))
    for r in N5_WORKLOAD:
        peer.add_request(r.request_id, r.prompt, r.params)
    preempted = False
    while peer.has_unfinished_requests() and not preempted:
        preempted = bool(peer.step(ORACLE).preempted)
        state = peer.observe().state
        ids = [r.request_id for r in (*state.waiting, *state.running)]
        assert len(ids) == len(set(ids)), f"a request is queued twice: {ids}"
    assert preempted


@on_pinned_version(N2_N6)
@pytest.mark.parametrize("case", sorted(NEVER_SCHEDULED))
def test_n2_n6_a_request_that_can_never_run_is_refused_or_harmless(case: str) -> None:
    require_peer("nano-vllm")
    fields, prompt = NEVER_SCHEDULED[case]
    peer = make_peer("nano-vllm", nano_config(fields))
    try:
        peer.add_request("r0", prompt, PARAMS)
    except InvalidRequestError:
        return
    peer.step(ORACLE)  # raises PeerFailure (AssertionError in schedule()) on 20260210


@on_pinned_version(N12)
def test_n12_every_prefill_computes_a_token() -> None:
    """A prompt of whole blocks that all hit must still compute its last token (vLLM
    recomputes the last block, PC3): the model runner samples from the logits of the
    tokens a prefill computes. The adapter raises ``FullHitPrefill`` (a ``PeerFailure``)
    where nano-vllm schedules none."""
    require_peer("nano-vllm")
    peer = make_peer("nano-vllm", nano_config(N12_CONFIG))
    for r in N12_WORKLOAD:
        peer.add_request(r.request_id, r.prompt, r.params)
    plan = peer.step(ORACLE)
    assert all(n >= 1 for n in plan.num_scheduled_tokens), plan


@pytest.mark.parametrize(
    ("bug", "config", "workload"),
    [
        (N5, nano_config(N5_CONFIG), N5_WORKLOAD),
        (N12, nano_config(N12_CONFIG), N12_WORKLOAD),
        *(
            (
                N2_N6,
                nano_config(fields),
                [WorkloadRequest(request_id="r0", prompt=prompt, params=PARAMS)],
            )
            for fields, prompt in NEVER_SCHEDULED.values()
        ),
    ],
    ids=["N5", "N12", *NEVER_SCHEDULED],
)
def test_the_machines_recognise_the_bug(
    bug: KnownBug, config: SchedulerConfig, workload: list[WorkloadRequest]
) -> None:
    """On the pinned version the lockstep run diverges with the bug's signature."""
    require_peer("nano-vllm")
    if not bug.covers(installed_version(bug)):
        pytest.skip(f"{bug.id} was confirmed on {bug.versions}")
    report = run_workload(make_peer("nano-vllm", config), config, workload, ORACLE)
    assert report.divergence is not None
    assert classify("nano-vllm", report.divergence) is bug, report.divergence


#: V11's two triggers: (config, workload file).
#: undone_chunk_keys.jsonl: V (priority 2) and X (priority 0, V's tokens: it shares V's
#: blocks) decode while R (priority 1) prefills; at step 3 V's decode keys the block of
#: position 4, R needs blocks, V's chunk is undone and R preempts itself; at step 4 Y
#: (V's tokens and one more) arrives and hits that block.
#: undone_prefill_chunk_keys.jsonl: V (priority 2, 127 tokens) prefills in chunks of the
#: threshold (32) once R (priority 1, 16 tokens) runs beside it; at step 2 V's chunk
#: [80, 112) keys two blocks, R's decode needs a block, V is preempted and its chunk
#: undone, R takes back one of the two; at step 3 V itself comes back and hits the
#: other (positions 80-95). No self-preemption (scripts/repro_v11_long_prefill.py is
#: the same case, standalone).
V11_TRIGGERS = {
    "requester-preempts-itself": (
        SchedulerConfig(
            num_gpu_blocks=16,
            block_size=1,
            max_num_batched_tokens=6,
            max_num_seqs=4,
            enable_prefix_caching=True,
            semantics=Semantics.VLLM_V1,
            policy="priority",
        ),
        "undone_chunk_keys.jsonl",
    ),
    "long-prefill-threshold": (
        SchedulerConfig(
            num_gpu_blocks=8,
            block_size=16,
            max_num_batched_tokens=48,
            max_num_seqs=4,
            enable_prefix_caching=True,
            semantics=Semantics.VLLM_V1,
            policy="priority",
            long_prefill_token_threshold=32,
        ),
        "undone_prefill_chunk_keys.jsonl",
    ),
}
V11_ORACLE = HashOracle(vocab_size=256)


def _admitted_with_hit(scheduler_output: Any) -> list[tuple[str, int]]:
    """(request, hit length) of each request a ``SchedulerOutput`` (re)admits: a new one
    carries its hit in ``num_computed_tokens``, and so does a resumed one (vLLM's V1
    model runner gets resumed requests among the cached ones)."""
    cached = scheduler_output.scheduled_cached_reqs
    return [
        *((new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs),
        *(
            (rid, computed)
            for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
            if rid in cached.resumed_req_ids
        ),
    ]


@on_pinned_version(V11)
@pytest.mark.parametrize("trigger", sorted(V11_TRIGGERS))
def test_v11_every_hit_block_was_written_by_a_forward(trigger: str) -> None:
    """No admission may hit a block whose K/V no forward wrote. The peer runs alone: its
    ``SchedulerOutput``s tell which (block, position) each forward computes and what
    each (re)admitted request hit; on 0.32.0 a block keyed by an undone chunk is hit (Y
    hits V's block of position 4; V hits its own block of positions 80-95)."""
    require_peer("vllm")
    config, file = V11_TRIGGERS[trigger]
    peer = VllmAdapter(config)
    scheduler = peer.scheduler
    block_size = config.block_size
    written: set[tuple[int, int]] = set()  # (vLLM block id, position) a forward computed
    hit_unwritten: list[str] = []
    schedule = scheduler.schedule

    def recording_schedule() -> Any:
        out = schedule()
        for rid, computed in _admitted_with_hit(out):  # the hit: positions below computed
            (blocks,) = scheduler.kv_cache_manager.get_block_ids(rid)
            if any((blocks[p // block_size], p) not in written for p in range(computed)):
                hit_unwritten.append(rid)
        for rid, n in out.num_scheduled_tokens.items():
            start = scheduler.requests[rid].num_computed_tokens - n
            (blocks,) = scheduler.kv_cache_manager.get_block_ids(rid)
            written.update((blocks[p // block_size], p) for p in range(start, start + n))
        return out

    scheduler.schedule = recording_schedule
    workload = read_workload(Path(__file__).parent / "repros" / file)
    pending = sorted(workload, key=lambda r: r.arrival_step)
    steps = 0
    while pending or peer.has_unfinished_requests():
        while pending and pending[0].arrival_step <= steps:
            r = pending.pop(0)
            peer.add_request(r.request_id, r.prompt, r.params)
        peer.step(V11_ORACLE)
        steps += 1
    assert not hit_unwritten, f"hits on blocks no forward wrote: {hit_unwritten}"


#: The step at whose end the pools first differ, by trigger: the step that undoes the chunk.
V11_DIVERGES_AT = {"requester-preempts-itself": 3, "long-prefill-threshold": 2}


@pytest.mark.parametrize("trigger", sorted(V11_TRIGGERS))
def test_the_vllm_machines_recognise_v11(trigger: str) -> None:
    """The spec drops the undone chunk's keys (vllm-v1/undone-chunk-unkeyed): after the
    step that undoes it the pools differ by the keys vLLM kept, which carries V11's
    signature; on the second trigger the spec agrees up to there, long-prefill cap
    included (vllm-v1/long-prefill-cap)."""
    require_peer("vllm")
    if not V11.covers(installed_version(V11)):
        pytest.skip(f"V11 was confirmed on {V11.versions}")
    config, file = V11_TRIGGERS[trigger]
    workload = read_workload(Path(__file__).parent / "repros" / file)
    report = run_workload(make_peer("vllm", config), config, workload, V11_ORACLE)
    divergence = report.divergence
    assert divergence is not None
    assert divergence.step == V11_DIVERGES_AT[trigger], divergence
    assert divergence.field.startswith("state.prefix_cache"), divergence
    assert classify("vllm", divergence) is V11, divergence


#: V11's second shape, found by ``scripts/explore_peers.py vllm --long-prefill
#: --shared-prefix --policy priority`` (seed 40236, 4 of 1,000 runs): block size 1, cap 5
#: with the adaptive floor; at step 4 r3's decode is undone for r0 (vllm-v1/priority-
#: victim-any-running), vLLM keeps the key of its one new block (5), so freed, it joins
#: the free queue's tail, not its head, and r0's chunk, scheduled next in the same step,
#: takes blocks 6-10 then 5 where the spec's r0 takes 5-10. No hit on unwritten K/V.
V11_BLOCK_ORDER_CONFIG = SchedulerConfig(
    num_gpu_blocks=36,
    block_size=1,
    max_num_batched_tokens=29,
    max_num_seqs=4,
    enable_prefix_caching=True,
    semantics=Semantics.VLLM_V1,
    policy="priority",
    long_prefill_token_threshold=5,
    long_prefill_token_threshold_adaptive=True,
)


def test_the_vllm_machines_recognise_v11_by_block_order() -> None:
    """The spec and vLLM agree until the step that undoes r3's decode; then r0's blocks
    are the same set in another order, which carries V11's second signature (only
    after a step that undid a chunk: from a state where none is undone it is no V11)."""
    require_peer("vllm")
    if not V11.covers(installed_version(V11)):
        pytest.skip(f"V11 was confirmed on {V11.versions}")
    config = V11_BLOCK_ORDER_CONFIG
    workload = read_workload(Path(__file__).parent / "repros" / "undone_chunk_block_order.jsonl")
    report = run_workload(make_peer("vllm", config), config, workload, ORACLE)
    divergence = report.divergence
    assert divergence is not None
    assert divergence.step == 4, divergence
    assert divergence.field == "state.running[0].block_ids[9]", divergence
    assert classify("vllm", divergence) is V11, divergence
    assert divergence.spec_before is not None
    no_undo = dataclasses.replace(divergence, spec_before=spec.init_state(config))
    assert classify("vllm", no_undo) is None


def test_conform_names_a_known_peer_bug(invoke: Invoke) -> None:
    require_peer("nano-vllm")
    if not N5.covers(installed_version(N5)):
        pytest.skip(f"N5 was confirmed on {N5.versions}")
    repro = Path(__file__).parent / "repros" / "running_keeps_victim.jsonl"
    result = invoke(
        "conform", "--engine", "nano-vllm", str(repro), "--num-gpu-blocks", "2",
        "--block-size", "2", "--no-enable-chunked-prefill",
    )  # fmt: skip
    lines = result.out.splitlines()
    assert result.code == 1 and lines[0].startswith("conform: DIVERGED at step 1: state.running")
    assert lines[1].startswith(
        "  known peer bug N5, confirmed on nano-vllm-fork 20260210 (docs/peers.md): "
    )
