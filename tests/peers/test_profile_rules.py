"""Each rule of the transformers and tokenspeed profiles is what makes the spec agree.

For every rule a reproduction in ``tests/peers/repros/`` (found by searching random
workloads for one whose spec run changes when the rule is taken out) agrees with the
real peer at every step under the profile, and diverges from it once the rule's
function is patched out of the spec (docs/peers.md, "transformers", "TokenSpeed").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvsched.demo import KV_SLOTS, NUM_REQUESTS, seed_workload
from kvsched.peers import make_peer
from kvsched.peers.lockstep import Lockstep, run_workload
from kvsched.workload import read_workload
from spec.oracle import HashOracle
from spec.types import PreemptionMode, SchedulerConfig, Semantics
from tests.peers.conftest import require_peer
from tests.stateful.offload_reserve_events import WITHOUT

REPROS = Path(__file__).parent / "repros"
ORACLE = HashOracle(vocab_size=8)
SWAP = PreemptionMode.SWAP


# (rule, peer, repro, config fields, the step the peer and the spec without the rule part
#  at); the rule's function and its stand-in: ``WITHOUT[rule]``
RULES: list[tuple[str, str, str, dict[str, Any], int]] = [
    ("transformers/safety-margin", "transformers", "tf_safety_margin",
     {"num_gpu_blocks": 3, "block_size": 16, "max_num_batched_tokens": 6, "max_num_seqs": 6,
      "preemption_mode": SWAP, "num_cpu_blocks": 6}, 4),
    ("transformers/skip-not-fit", "transformers", "tf_skip_not_fit",
     {"num_gpu_blocks": 2, "block_size": 8, "max_num_batched_tokens": 20, "max_num_seqs": 5,
      "preemption_mode": SWAP, "num_cpu_blocks": 3}, 5),
    ("transformers/offload-starved", "transformers", "tf_offload_newest_starved",
     {"num_gpu_blocks": 3, "block_size": 5, "max_num_batched_tokens": 47, "max_num_seqs": 5}, 7),
    ("transformers/offloaded-interleaved", "transformers", "tf_offloaded_interleaved",
     {"num_gpu_blocks": 4, "block_size": 5, "max_num_batched_tokens": 20, "max_num_seqs": 6,
      "preemption_mode": SWAP, "num_cpu_blocks": 8}, 16),
    ("transformers/admission-frozen", "transformers", "tf_admission_frozen",
     {"num_gpu_blocks": 2, "block_size": 5, "max_num_batched_tokens": 17, "max_num_seqs": 2}, 5),
    ("tokenspeed/reserve-generation", "tokenspeed", "ts_reserve_generation",
     {"num_gpu_blocks": 4, "block_size": 1, "max_num_batched_tokens": 16, "max_num_seqs": 5}, 5),
    ("tokenspeed/skip-not-fit", "tokenspeed", "ts_skip_not_fit",
     {"num_gpu_blocks": 5, "block_size": 1, "max_num_batched_tokens": 40, "max_num_seqs": 6}, 1),
    ("tokenspeed/submission-order", "tokenspeed", "ts_submission_order",
     {"num_gpu_blocks": 4, "block_size": 8, "max_num_batched_tokens": 5, "max_num_seqs": 5}, 11),
]  # fmt: skip


@pytest.mark.parametrize("case", RULES, ids=[r[0] for r in RULES])
def test_the_rule_makes_the_spec_agree(
    monkeypatch: pytest.MonkeyPatch,
    case: tuple[str, str, str, dict[str, Any], int],
) -> None:
    rule, peer, repro, fields, step = case
    module, name, without = WITHOUT[rule]
    require_peer(peer)
    config = SchedulerConfig(**fields, semantics=Semantics(peer))
    workload = read_workload(REPROS / f"{repro}.jsonl")
    report = run_workload(make_peer(peer, config), config, workload, ORACLE)
    assert report.divergence is None, report.divergence
    monkeypatch.setattr(module, name, without)
    report = run_workload(make_peer(peer, config), config, workload, ORACLE)
    assert report.divergence is not None, f"{rule} made no difference"
    assert report.divergence.step == step, report.divergence


def test_tokenspeed_prefill_first_and_head_of_line() -> None:
    """tokenspeed/head-of-line-chunk and prefill-first on the peer (every plan compared):
    r0's incomplete first chunk ends the prefill work; its last chunk lets r1 and r2 in,
    r2's cut first chunk ends it again; r2's next chunk runs alone, and only then do the
    three decode."""
    require_peer("tokenspeed")
    config = SchedulerConfig(
        num_gpu_blocks=16,
        block_size=4,
        max_num_batched_tokens=5,
        max_num_seqs=8,
        semantics=Semantics.TOKENSPEED,
    )
    workload = read_workload(REPROS / "ts_prefill_first.jsonl")
    lock = Lockstep(make_peer("tokenspeed", config), config, ORACLE)
    for r in workload:
        lock.add(r.request_id, r.prompt, r.params)
    plans = [[(c.request_id, c.start, c.num_tokens) for c in lock.step().scheduled] for _ in "abcd"]
    assert plans == [
        [("r0", 0, 5)],
        [("r0", 5, 2), ("r1", 0, 2), ("r2", 0, 1)],
        [("r2", 1, 1)],
        [("r0", 7, 1), ("r1", 2, 1), ("r2", 2, 1)],
    ]


# The seed's workload (kvsched/demo.py: 8 requests of 5 + 8 tokens, 20 KV slots) under
# each profile's constraints: transformers with pages of 4 (5 pages, a CPU pool of 5 under
# swap), TokenSpeed with its blocks of 1.
SEED_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "transformers-recompute": ("transformers", {"block_size": 4, "num_gpu_blocks": 5}),
    "transformers-swap": (
        "transformers",
        {"block_size": 4, "num_gpu_blocks": 5, "preemption_mode": SWAP, "num_cpu_blocks": 5},
    ),
    "tokenspeed": ("tokenspeed", {"block_size": 1, "num_gpu_blocks": KV_SLOTS}),
}


@pytest.mark.parametrize("name", sorted(SEED_CONFIGS))
def test_the_seed_workload_agrees(name: str) -> None:
    """Every step of the seed's workload agrees with the peer, and it preempts (but
    under TokenSpeed, which reserves each request's generation and preempts nothing)."""
    peer, fields = SEED_CONFIGS[name]
    require_peer(peer)
    config = SchedulerConfig(
        **fields, max_num_seqs=NUM_REQUESTS, semantics=Semantics(peer), enable_chunked_prefill=True
    )
    report = run_workload(make_peer(peer, config), config, seed_workload(), ORACLE)
    assert report.divergence is None, report.divergence
    assert report.num_requests == NUM_REQUESTS and report.num_rejected == 0
    assert (report.preemptions > 0) == (peer == "transformers"), report
