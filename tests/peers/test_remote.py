"""The subprocess protocol: its messages, and a peer driven in another process.

The wire tests need no peer. The process tests run ``kvsched.peers.server`` with this
interpreter (the protocol is the same whatever environment the child is in) and
nano-vllm, whose scheduler imports in a second; ``tests/peers/test_vllm_v0.py`` drives
vLLM V0 in its own environment.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvsched.peers import PeerUnsupportedError, make_peer, peer_version
from kvsched.peers.lockstep import run_workload
from kvsched.peers.remote import PeerProcess, RemotePeer
from kvsched.peers.wire import (
    PROTOCOL_VERSION,
    Call,
    Failure,
    PeerProtocolError,
    Reply,
    TokenAnswer,
    TokenQuery,
    decode,
    dumps,
    encode,
    loads,
)
from kvsched.workload import WorkloadRequest
from spec.oracle import HashOracle
from spec.types import (
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    PreemptionMode,
    PrefixCacheState,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    Semantics,
    StepPlan,
    UnknownRequestError,
)
from tests.peers.conftest import require_peer

ORACLE = HashOracle(vocab_size=8)
NANO = SchedulerConfig(
    num_gpu_blocks=3,
    block_size=2,
    enable_chunked_prefill=False,
    enable_prefix_caching=True,
    semantics=Semantics.NANO_VLLM,
)
WORKLOAD = [
    WorkloadRequest(
        request_id=f"r{i}",
        prompt=(200 + i, 3, 4),
        params=SamplingParams(max_tokens=3, ignore_eos=True),
        arrival_step=i,
    )
    for i in range(3)
]


# --- the wire ----------------------------------------------------------------------------


def test_every_value_crosses_intact() -> None:
    values: list[object] = [
        NANO,
        SamplingParams(max_tokens=3, eos_token_id=None, priority=-2, temperature=0.8, seed=4),
        StepPlan(
            step=3,
            scheduled_ids=("a", "b"),
            num_computed_tokens=(0, 5),
            num_scheduled_tokens=(4, 1),
            sampled_ids=("b",),
            sampled_token_ids=(7,),
            finished=(
                FinishedRequest(
                    request_id="b",
                    output_token_ids=(1, 7),
                    finish_reason=FinishReason.LENGTH,
                    num_preemptions=2,
                ),
            ),
        ),
        PrefixCacheState(free_queue=(3, 1), cached=(((1, 2), 0), ((1, 2, 3, 4), 2))),
        PreemptionMode.SWAP,
        HashOracle(vocab_size=8, salt=3),
        {"nested": [(1, 2), frozenset({"x"})]},
    ]
    for value in values:
        assert decode(json.loads(json.dumps(encode(value)))) == value


def test_messages_round_trip_with_the_version() -> None:
    for message in (
        Call(1, "step", {"peer": 2, "oracle_sent": HashOracle(vocab_size=4)}),
        Reply(1, NANO),
        Failure(2, "RequestTooLargeError", "too big"),
        TokenQuery(3, (1, 2, 3)),
        TokenAnswer(3, 5),
    ):
        line = dumps(message)
        assert json.loads(line)["v"] == PROTOCOL_VERSION
        assert loads(line) == message


def test_a_typed_error_crosses_as_itself() -> None:
    error = Failure.of(4, RequestTooLargeError("prompt of 9 tokens")).error()
    assert isinstance(error, RequestTooLargeError) and str(error) == "prompt of 9 tokens"
    assert isinstance(Failure.of(4, UnknownRequestError("no r9")).error(), UnknownRequestError)
    # Anything else is the peer failing, named.
    assert "ZeroDivisionError: boom" in str(Failure.of(4, ZeroDivisionError("boom")).error())


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"v": 999, "id": 1, "op": "hello", "args": {}}', "protocol version 999"),
        ("not json", "not a protocol line"),
        (
            f'{{"v": {PROTOCOL_VERSION}, "id": 1, "op": "x", "args": {{"a": {{"$": "Popen"}}}}}}',
            "unknown type 'Popen'",
        ),
        (f'{{"v": {PROTOCOL_VERSION}, "id": 1}}', "of no known kind"),
    ],
)
def test_a_bad_line_is_a_typed_error(line: str, message: str) -> None:
    with pytest.raises(PeerProtocolError, match=message):
        loads(line)


def test_only_the_spec_types_are_sent() -> None:
    with pytest.raises(PeerProtocolError, match="cannot send a PosixPath"):
        encode(Path("/"))


# --- a peer in another process -------------------------------------------------------------


def test_a_peer_in_a_process_agrees_as_it_does_here() -> None:
    require_peer("nano-vllm")
    here = run_workload(make_peer("nano-vllm", NANO), NANO, WORKLOAD, ORACLE)
    remote = make_peer("nano-vllm", NANO, python=sys.executable)
    assert isinstance(remote, RemotePeer)
    there = run_workload(remote, NANO, WORKLOAD, ORACLE)
    assert here == there and there.ok, there
    # A divergence, states and all, crosses too (nano-vllm's N5 at its first preemption).
    crowded = [
        WorkloadRequest(request_id=r.request_id, prompt=r.prompt[:2], params=r.params)
        for r in WORKLOAD
    ]
    here = run_workload(make_peer("nano-vllm", NANO), NANO, crowded, ORACLE)
    there = run_workload(make_peer("nano-vllm", NANO, python=sys.executable), NANO, crowded, ORACLE)
    assert here.divergence is not None and here == there
    version = peer_version("nano-vllm", remote)
    assert (version.distribution, version.version, version.tested) == (
        "nano-vllm-fork",
        "20260210",
        True,
    )


def test_an_oracle_that_cannot_cross_is_asked_token_by_token() -> None:
    require_peer("nano-vllm")
    asked: list[tuple[int, ...]] = []

    def oracle(prefix: tuple[int, ...]) -> int:
        asked.append(prefix)
        return ORACLE(prefix)

    report = run_workload(
        make_peer("nano-vllm", NANO, python=sys.executable), NANO, WORKLOAD, oracle
    )
    assert report.ok
    assert (200, 3, 4) in asked  # r0's first token was asked for (by both sides)


def test_one_process_serves_peers_one_after_another() -> None:
    require_peer("nano-vllm")
    process = PeerProcess(sys.executable, "nano-vllm")
    peers = [process.peer(NANO) for _ in range(3)]
    for peer in peers:
        assert run_workload(peer, NANO, WORKLOAD, ORACLE).ok
        peer.close()
    with pytest.raises(PeerProtocolError, match="no peer"):
        peer.observe()  # dropped there
    process.close()


def test_errors_cross_as_typed_errors() -> None:
    require_peer("nano-vllm")
    process = PeerProcess(sys.executable, "nano-vllm")
    peer = process.peer(NANO)
    with pytest.raises(EmptyPromptError, match="nano-vllm: empty prompt"):
        peer.add_request("r0", [], SamplingParams())
    with pytest.raises(PeerUnsupportedError, match="nano-vllm: no policy 'priority'"):
        process.peer(SchedulerConfig(num_gpu_blocks=4, block_size=2, policy="priority"))
    process.close()


def test_a_dead_peer_process_is_a_typed_error(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(
        PeerProtocolError, match=r"(?s)exited with code 3 during hello.*cannot start"
    ):
        PeerProcess(fake, "nano-vllm")
    with pytest.raises(PeerProtocolError, match="no such interpreter"):
        PeerProcess(tmp_path / "missing", "nano-vllm")


def test_the_server_imports_no_torch() -> None:
    """The far end needs nothing of the project's environment but the peer."""
    import subprocess  # noqa: PLC0415

    probe = (
        "import sys, kvsched.peers.server, kvsched.peers.vllm_v0, kvsched.peers.vllm_v1; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'impl', 'model', 'rich', 'matplotlib', 'hypothesis')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
