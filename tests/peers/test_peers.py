"""vLLM V1's and nano-vllm's real schedulers through the protocol, held to the spec.

Where none of docs/peers.md's differences applies they agree with the spec step by step;
each documented difference still shows up, at the step and field docs/peers.md gives
(an upstream change, or phase 2's profile rules, will make one of these fail).
"""

from __future__ import annotations

import builtins
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

from kvsched.peers import PeerNotInstalledError, PeerUnsupportedError, make_peer
from kvsched.peers.lockstep import Lockstep, run_workload
from kvsched.workload import WorkloadRequest, read_workload
from spec.oracle import HashOracle
from spec.types import PreemptionMode, SamplingParams, ScheduledChunk, SchedulerConfig, Semantics
from tests.cli.helpers import Invoke
from tests.drain import drain_within
from tests.peers.conftest import require_peer

REPROS = Path(__file__).parent / "repros"


def _agreeing_workload() -> list[WorkloadRequest]:
    """Distinct first tokens (no nano-vllm prefix hit), all arriving at once (no N1),
    prompts within the budget, no priorities."""
    return [
        WorkloadRequest(
            request_id=f"r{i}",
            prompt=(100 + i, *range(1, 2 + i % 3)),
            params=SamplingParams(max_tokens=2 + i % 3, eos_token_id=3, ignore_eos=i % 2 == 1),
        )
        for i in range(4)
    ]


def test_a_peer_agrees_where_no_difference_applies(peer_name: str) -> None:
    config = SchedulerConfig(
        num_gpu_blocks=16, block_size=2, max_num_batched_tokens=16, max_num_seqs=4
    )
    workload = _agreeing_workload()
    eos = 3 if peer_name == "nano-vllm" else None
    peer = make_peer(peer_name, config, eos_token_id=eos)
    report = run_workload(peer, config, workload, HashOracle(vocab_size=4))
    assert report.divergence is None, report.divergence
    assert report.steps >= 3


def test_vllm_agrees_through_preemptions() -> None:
    require_peer("vllm")
    config = SchedulerConfig(
        num_gpu_blocks=3, block_size=2, max_num_batched_tokens=8, max_num_seqs=4
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    workload = [
        WorkloadRequest(request_id=f"r{i}", prompt=(200 + i, 2), params=params) for i in range(3)
    ]
    report = run_workload(make_peer("vllm", config), config, workload, HashOracle(vocab_size=8))
    assert report.divergence is None, report.divergence
    assert report.preemptions >= 2


# (peer, workload, options, verdict under the peer's own profile, verdict under kvsched):
# the rows of docs/peers.md. Each difference that a profile rule models agrees under the
# peer's profile (conform's default) and still diverges under kvsched, which shows that
# the rule is what makes the difference.
OK = "conform: ok: spec and engine agree at all "
DOCUMENTED = [
    ("vllm", "never_fits", "--num-gpu-blocks 2 --block-size 4",  # V1
     OK, "conform: DIVERGED at step 0: add_request('r0'): spec \"RequestTooLargeError"),
    ("vllm", "full_sequence_gate",  # V2
     "--num-gpu-blocks 4 --block-size 4 --max-num-batched-tokens 8 --max-num-seqs 4",
     OK, "conform: DIVERGED at step 0: plan.scheduled[1]: spec ScheduledChunk(request_id='r1'"),
    ("vllm", "priority_victim_scheduled", "--num-gpu-blocks 4 --block-size 4 --policy priority",
     OK, "conform: DIVERGED at step 7: plan.scheduled[0].request_id: spec 'r0', engine 'r2'"),
    ("vllm", "priority_waiting_order", "--num-gpu-blocks 4 --block-size 4 --policy priority",
     OK, "conform: DIVERGED at step 0: state.waiting[0].request.request_id: spec 'r0', "
     "engine 'r1'"),
    ("vllm", "max_model_len_stop",  # V5
     "--num-gpu-blocks 4 --block-size 4 --max-num-batched-tokens 8 --max-num-seqs 4 "
     "--no-enable-chunked-prefill",
     OK, "conform: DIVERGED at step 1: plan.finished[0]: spec (absent), engine FinishedRequest("),
    ("vllm", "full_sequence_hit_gate",  # V9: the gate with a cache hit
     "--num-gpu-blocks 7 --block-size 4 --max-num-batched-tokens 8 --max-num-seqs 4 "
     "--enable-prefix-caching",
     OK, "conform: DIVERGED at step 1: plan.scheduled[1]: spec ScheduledChunk(request_id='r1', "
     "start=8, num_tokens=7), engine (absent)"),
    ("vllm", "full_sequence_hit_credit",  # V9: the hit's blocks are not asked for again
     "--num-gpu-blocks 7 --block-size 4 --max-num-batched-tokens 8 --max-num-seqs 4 "
     "--enable-prefix-caching",
     OK, OK),
    # V9 on a 40-request shared-prefix workload (the first look's steps 77 and 27).
    ("vllm", "shared_prefix_40",
     "--num-gpu-blocks 40 --block-size 4 --max-num-batched-tokens 32 --max-num-seqs 8 "
     "--enable-prefix-caching",
     OK, "conform: DIVERGED at step 77: plan.scheduled[4]: spec ScheduledChunk(request_id='r1', "
     "start=0, num_tokens=19), engine (absent)"),
    ("vllm", "shared_prefix_40",
     "--num-gpu-blocks 20 --block-size 4 --max-num-batched-tokens 32 --max-num-seqs 8 "
     "--enable-prefix-caching",
     OK, "conform: DIVERGED at step 27: plan.scheduled[4]: spec ScheduledChunk(request_id='r16', "
     "start=24, num_tokens=1), engine (absent)"),
    ("vllm", "victim_order", "--num-gpu-blocks 3 --block-size 2", OK, OK),
    ("vllm", "prefill_only_steps", "--num-gpu-blocks 8 --block-size 4", OK, OK),
    # N6: the spec keeps R4's refusal; nano-vllm accepts, then fails `assert scheduled_seqs`.
    ("nano-vllm", "never_fits", "--num-gpu-blocks 2 --block-size 4",
     "conform: DIVERGED at step 0: add_request('r0'): spec \"RequestTooLargeError",
     "conform: DIVERGED at step 0: add_request('r0'): spec \"RequestTooLargeError"),
    ("nano-vllm", "prefill_only_steps", "--num-gpu-blocks 8 --block-size 4",  # N1
     OK, "conform: DIVERGED at step 1: plan.scheduled[0].request_id: spec 'r0', engine 'r1'"),
    ("nano-vllm", "decode_unbudgeted",  # N3
     "--num-gpu-blocks 8 --block-size 4 --max-num-batched-tokens 2",
     OK, "conform: DIVERGED at step 1: plan.scheduled[0].request_id: spec 'r0', engine 'r2'"),
    ("nano-vllm", "seq_limit_per_step",  # N11
     "--num-gpu-blocks 8 --block-size 4 --max-num-seqs 1",
     OK, "conform: DIVERGED at step 1: plan.scheduled[0].request_id: spec 'r0', engine 'r1'"),
    # N2: under the profile R4 refuses what nano-vllm would crash on; under kvsched (chunked
    # prefill on) the spec chunks it and nano-vllm fails `assert scheduled_seqs`.
    ("nano-vllm", "no_chunked_prefill",
     "--num-gpu-blocks 8 --block-size 4 --max-num-batched-tokens 4",
     "conform: DIVERGED at step 0: add_request('r0'): spec \"RequestTooLargeError",
     "conform: DIVERGED at step 0: step(): spec '(returns)', engine 'raised nano-vllm: "
     "AssertionError"),
    # N4 agrees on the plan under the profile; then N5 (the fork keeps the victim in
    # running, a peer bug, not modelled) shows in the state of the same step.
    ("nano-vllm", "victim_order", "--num-gpu-blocks 3 --block-size 2",
     "conform: DIVERGED at step 1: state.running[1]: spec (absent), engine RequestState(",
     "conform: DIVERGED at step 1: plan.preempted[0].request_id: spec 'r2', engine 'r1'"),
    ("nano-vllm", "running_keeps_victim", "--num-gpu-blocks 2 --block-size 2",  # N5
     "conform: DIVERGED at step 1: state.running[0]: spec (absent), engine RequestState(",
     "conform: DIVERGED at step 1: state.running[0]: spec (absent), engine RequestState("),
    # N12: a prompt of whole blocks that all hit: nano-vllm prefills zero tokens (a peer
    # bug, whatever the spec's profile).
    ("nano-vllm", "prefix_hit", "--num-gpu-blocks 8 --block-size 4",
     "conform: DIVERGED at step 0: step(): spec '(returns)', engine \"raised nano-vllm: "
     "FullHitPrefill",
     "conform: DIVERGED at step 0: step(): spec '(returns)', engine \"raised nano-vllm: "
     "FullHitPrefill"),
    # N7: a hit between running requests; the kvsched run has caching off.
    ("nano-vllm", "shared_prefix_hit", "--num-gpu-blocks 8 --block-size 4",
     OK, "conform: DIVERGED at step 0: plan.scheduled[1].start: spec 0, engine 4"),
]  # fmt: skip

# nano-vllm's prefix-cache rules (N7, N8, N13): each agrees under the nano-vllm profile
# (caching on by default there) and diverges under kvsched's own caching rules (PC1-PC9).
NANO_CACHE_RULES = [
    ("shared_prefix_hit", "--num-gpu-blocks 8 --block-size 4",  # drop-key-on-free (tail)
     "conform: DIVERGED at step 2: state.prefix_cache.free_queue[0]: spec 2, engine 3"),
    ("drop_key_on_free", "--num-gpu-blocks 8 --block-size 4",
     "conform: DIVERGED at step 0: state.prefix_cache.free_queue[0]: spec 1, engine 2"),
    ("admission_len_seq", "--num-gpu-blocks 3 --block-size 4",
     "conform: DIVERGED at step 0: plan.scheduled[1]: spec ScheduledChunk(request_id='r1', "
     "start=4, num_tokens=1), engine (absent)"),
    ("last_key_wins", "--num-gpu-blocks 8 --block-size 4",
     "conform: DIVERGED at step 1: state.prefix_cache.cached[0][1]: spec 0, engine 1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("peer", "name", "options", "verdict", "kvsched_verdict"),
    DOCUMENTED,
    ids=[f"{row[0]}-{row[1]}-{row[2].split()[1]}" for row in DOCUMENTED],
)
def test_documented_differences(
    invoke: Invoke, *, peer: str, name: str, options: str, verdict: str, kvsched_verdict: str
) -> None:
    require_peer(peer)
    path = str(REPROS / f"{name}.jsonl")
    result = invoke("conform", "--engine", peer, path, *options.split())
    assert result.out.startswith(verdict), result.out + result.err
    assert result.code == (0 if verdict == OK else 1)
    kvsched = ["--semantics", "kvsched"]
    if peer == "nano-vllm" and name != "no_chunked_prefill":
        kvsched.append("--no-enable-chunked-prefill")  # the difference is not chunking
    result = invoke("conform", "--engine", peer, path, *options.split(), *kvsched)
    assert result.out.startswith(kvsched_verdict), result.out + result.err
    assert result.code == (0 if kvsched_verdict == OK else 1)


@pytest.mark.parametrize(
    ("name", "options", "kvsched_verdict"), NANO_CACHE_RULES, ids=[r[0] for r in NANO_CACHE_RULES]
)
def test_nano_vllm_cache_rules(
    invoke: Invoke, *, name: str, options: str, kvsched_verdict: str
) -> None:
    require_peer("nano-vllm")
    path = str(REPROS / f"{name}.jsonl")
    result = invoke("conform", "--engine", "nano-vllm", path, *options.split())
    assert result.out.startswith(OK), result.out + result.err
    kvsched = ["--semantics", "kvsched", "--no-enable-chunked-prefill", "--enable-prefix-caching"]
    result = invoke("conform", "--engine", "nano-vllm", path, *options.split(), *kvsched)
    assert result.out.startswith(kvsched_verdict), result.out + result.err
    assert result.code == 1


@pytest.mark.parametrize(
    ("peer", "config", "message"),
    [
        ("vllm", SchedulerConfig(num_gpu_blocks=4, preemption_mode=PreemptionMode.SWAP,
                                 num_cpu_blocks=2), "recompute only"),
        ("vllm", SchedulerConfig(num_gpu_blocks=4, max_num_batched_tokens=4, max_num_seqs=8),
         "must be >= max_num_seqs"),
        ("vllm", SchedulerConfig(num_gpu_blocks=4, policy="reserve"), "no vLLM counterpart"),
        ("nano-vllm", SchedulerConfig(num_gpu_blocks=4, block_size=1), "block_size >= 2"),
        ("nano-vllm", SchedulerConfig(num_gpu_blocks=4, policy="priority"), "no policy"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused(peer: str, config: SchedulerConfig, message: str) -> None:
    require_peer(peer)
    with pytest.raises(PeerUnsupportedError, match=message):
        make_peer(peer, config)


def test_cli_bad_input_is_one_line(invoke: Invoke, tmp_path: Path) -> None:
    require_peer("nano-vllm")
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"id": "a", "prompt": [1, 2], "max_tokens": 2, "eos_token_id": 1}\n'
        '{"id": "b", "prompt": [1, 2], "max_tokens": 2, "eos_token_id": 2}\n'
    )
    result = invoke("conform", "--engine", "nano-vllm", str(path), "--num-gpu-blocks", "4")
    assert result.code == 2
    assert result.err.count("\n") == 1 and "one EOS for the engine" in result.err


@pytest.mark.parametrize(("peer", "module"), [("vllm", "vllm"), ("nano-vllm", "nanovllm")])
def test_a_missing_peer_names_the_install_script(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peer: str, module: str
) -> None:
    real_import = builtins.__import__
    real_find_spec = importlib.util.find_spec

    def no_peer_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".", maxsplit=1)[0] == module:
            raise ImportError(f"No module named {module!r}")
        return real_import(name, *args, **kwargs)

    def no_peer_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return (
            None
            if name.split(".", maxsplit=1)[0] == module
            else real_find_spec(name, *args, **kwargs)
        )

    for key in [k for k in sys.modules if k.split(".")[0] == module]:
        monkeypatch.delitem(sys.modules, key)
    for adapter in ("kvsched.peers.vllm_v1", "kvsched.peers.nano"):
        if adapter in sys.modules:
            monkeypatch.setattr(
                sys.modules[adapter], "_vllm" if "vllm_v1" in adapter else "_nano", {}
            )
    monkeypatch.setattr(builtins, "__import__", no_peer_import)
    monkeypatch.setattr(importlib.util, "find_spec", no_peer_spec)
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "a", "prompt": [1, 2], "max_tokens": 2}\n')
    with pytest.raises(PeerNotInstalledError, match="scripts/install_peers"):
        make_peer(peer, SchedulerConfig(num_gpu_blocks=4))
    result = invoke("conform", "--engine", peer, str(path), "--num-gpu-blocks", "4")
    assert result.code == 2
    assert result.err.count("\n") == 1 and "scripts/install_peers" in result.err


def drain(lock: Lockstep) -> None:
    bound = drain_within(lock.state)
    while lock.unfinished():
        bound.tick(lock.state)
        lock.step()


def test_aborts_in_every_state_and_id_reuse(peer_name: str) -> None:
    """Abort while waiting and while running, re-add a freed id, drain: every step agrees."""
    config = SchedulerConfig(
        num_gpu_blocks=16, block_size=2, max_num_batched_tokens=16, max_num_seqs=8
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    lock = Lockstep(make_peer(peer_name, config), config, HashOracle(vocab_size=8))
    for i in range(3):
        lock.add(f"r{i}", (100 + i, 1, 2), params)
    lock.abort("r2")  # waiting
    lock.compare_states()
    lock.step()
    lock.abort("r1")  # running
    lock.compare_states()
    drain(lock)
    lock.add("r1", (110, 1), params)  # the id is free again
    drain(lock)
    lock.finish()
    assert lock.steps >= 5


def test_vllm_credits_a_hit_in_its_full_sequence_gate() -> None:
    """V9: r1's 20 tokens need 5 blocks and 4 are free, but 2 are r0's, hit: vLLM admits."""
    require_peer("vllm")
    config = SchedulerConfig(
        num_gpu_blocks=7,
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        enable_prefix_caching=True,
        semantics=Semantics.VLLM_V1,
    )
    workload = read_workload(REPROS / "full_sequence_hit_credit.jsonl")
    lock = Lockstep(make_peer("vllm", config), config, HashOracle(vocab_size=256))
    lock.add(workload[0].request_id, workload[0].prompt, workload[0].params)
    lock.step()
    lock.add(workload[1].request_id, workload[1].prompt, workload[1].params)
    assert lock.state.num_free_gpu_blocks == 5
    plan = lock.step()  # compared with vLLM's, as every step
    # r0's last prompt token takes its third block, so 4 are free when r1 is admitted.
    assert plan.scheduled == (
        ScheduledChunk(request_id="r0", start=8, num_tokens=1),
        ScheduledChunk(request_id="r1", start=8, num_tokens=7),
    )
