"""TokenSpeed's scheduler (tokenspeed-scheduler 0.1.42) through the protocol.

Under the ``tokenspeed`` profile the adapter (``kvsched/peers/tokenspeed.py``) agrees with
the spec through chunked prefills, skipped admissions, prefill-first plans, aborts in
every state and id reuse; what the profile does not model diverges where docs/peers.md
says (TS7: identical prompt pages de-duplicated when they are published). The
"stalled" probe of shared/reference/peers-next.md is answered here: it was the driver's
missing event, not a state of TokenSpeed's.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvsched.peers import make_peer
from kvsched.peers.lockstep import Lockstep, run_workload
from kvsched.workload import WorkloadRequest
from spec.oracle import HashOracle
from spec.types import SamplingParams, SchedulerConfig, Semantics
from tests.peers.conftest import require_peer

ORACLE = HashOracle(vocab_size=8)


def config(**fields: Any) -> SchedulerConfig:
    defaults: dict[str, Any] = {
        "num_gpu_blocks": 6,
        "block_size": 4,
        "max_num_batched_tokens": 6,
        "max_num_seqs": 3,
        "semantics": Semantics.TOKENSPEED,
    }
    return SchedulerConfig(**{**defaults, **fields})


def request(
    rid: str, prompt: tuple[int, ...], max_tokens: int, arrival: int = 0
) -> WorkloadRequest:
    return WorkloadRequest(
        request_id=rid,
        prompt=prompt,
        params=SamplingParams(max_tokens=max_tokens, eos_token_id=3),
        arrival_step=arrival,
    )


#: r0's first chunk holds the head of the line; r1 (a 4-block reserve) is skipped for
#: r2; decodes wait for plans without prefill work.
WORKLOAD = [
    request("r0", (200, 1, 2, 3, 4, 5, 6, 7), 4),
    request("r1", (201, 1, 2, 3, 4, 5, 6, 7, 8), 6),
    request("r2", (202, 1), 2),
    request("r3", (203, 5, 5), 3, arrival=3),
]


def test_tokenspeed_agrees_under_its_profile() -> None:
    require_peer("tokenspeed")
    c = config()
    report = run_workload(make_peer("tokenspeed", c), c, WORKLOAD, ORACLE)
    assert report.divergence is None, report.divergence
    assert report.steps >= 8


def test_aborts_in_every_state_and_id_reuse() -> None:
    require_peer("tokenspeed")
    c = config(max_num_batched_tokens=4)
    lock = Lockstep(make_peer("tokenspeed", c), c, ORACLE)
    for r in WORKLOAD:
        lock.add(r.request_id, r.prompt, r.params)
    lock.abort("r3")  # waiting
    lock.step()  # r0's first chunk
    lock.abort("r0")  # prefilling
    lock.compare_states()
    while not any(r.decoding for r in lock.state.running):
        lock.step()
    lock.abort(next(r.request_id for r in lock.state.running if r.decoding))  # sampled
    lock.compare_states()
    lock.add("r0", (210, 1, 2), SamplingParams(max_tokens=2))  # free again: plans since
    while lock.unfinished():
        lock.step()
    lock.finish()


def test_identical_prompt_pages_are_deduplicated_when_published() -> None:
    """TS7, not modelled: with the prefix cache off TokenSpeed still de-duplicates a
    prompt's full pages against identical pages another running request published, when
    the later one's first decode publishes them; one block comes free that the spec
    (no sharing) keeps in use."""
    require_peer("tokenspeed")
    c = config(num_gpu_blocks=16, max_num_batched_tokens=64)
    workload = [request("a", (1, 2, 3, 4, 5), 4), request("b", (1, 2, 3, 4, 9), 4)]
    report = run_workload(make_peer("tokenspeed", c), c, workload, HashOracle(vocab_size=256))
    assert report.divergence is not None
    assert (report.divergence.step, report.divergence.field) == (1, "state.num_free_gpu_blocks")
    assert (report.divergence.spec_value, report.divergence.engine_value) == (10, 11)


# --- the probe of shared/reference/peers-next.md ------------------------------------------


def _probe(*, chunk_results: bool) -> tuple[str, Any]:
    """6 pages of 4 tokens, 3 distinct prompts of 6 tokens (2 new each), 4 tokens a plan, an L2
    host cache (so plans carry write-backs, each acknowledged): TokenSpeed driven as its
    own closed-loop tests drive it, an intermediate prefill chunk answered with an empty
    ``ExtendResult`` or (``chunk_results=False``) not at all."""
    ts = pytest.importorskip("tokenspeed_scheduler")
    c = ts.SchedulerConfig()
    c.num_device_pages, c.prefix_granularity = 6, 4
    c.max_scheduled_tokens, c.max_batch_size = 4, 4
    c.num_host_pages, c.num_snapshot_pages, c.max_retracted_requests = 16, 16, 2
    c.cache_groups = [ts.CacheGroupConfig("full", 4, 6, ts.AttnKind.Full)]
    scheduler = ts.Scheduler(c)
    outputs: dict[str, int] = {}
    for k in range(3):
        spec = ts.RequestSpec()
        spec.request_id, spec.max_new_tokens = f"r{k}", 2
        spec.tokens = list(range(10 * k + 1, 10 * k + 7))  # distinct: no page shared
        scheduler.submit_requests([spec])
        outputs[spec.request_id] = 0
    empty_plans = 0
    for _ in range(40):
        plan = scheduler.next_execution_plan()
        events = ts.ExecutionEvent()
        ran = False
        for batch in plan.forward:
            for row, rid in enumerate(batch.request_ids):
                ran = True
                result = ts.ForwardEvent.ExtendResult()
                result.request_id = rid
                prefill = row < batch.num_extends()
                if (
                    prefill
                    and sum((batch.extend_prefix_lens[row], batch.input_lengths[row]))
                    < batch.prefill_lengths[row]
                ):
                    if chunk_results:
                        result.tokens = []
                        events.add_event(result)
                    continue
                result.tokens = [7]
                events.add_event(result)
                outputs[rid] += 1
                if outputs[rid] == 2:
                    finish = ts.ForwardEvent.Finish()
                    finish.request_id = rid
                    events.add_event(finish)
                elif not prefill:
                    reserve = ts.ForwardEvent.UpdateReserveNumTokens()
                    reserve.request_id = rid
                    reserve.reserve_num_tokens_in_next_schedule_event = 1
                    events.add_event(reserve)
        for operation in plan.cache:
            done_type = getattr(ts.Cache, type(operation).__name__.replace("Op", "DoneEvent"))
            for op_id in operation.op_ids:
                ack = done_type()
                ack.op_id = op_id
                events.add_event(ack)
        scheduler.advance(events)
        empty_plans = 0 if ran or plan.cache else empty_plans + 1
        if all(n == 2 for n in outputs.values()):
            return "drained", scheduler
    return f"stalled: {empty_plans} empty plans in a row", scheduler


def test_the_stalled_probe_was_a_missing_event_of_the_driver() -> None:
    """peers-next.md's probe "stalled for good after the first prefill". Answering every
    forward row, an intermediate chunk with an empty ``ExtendResult`` (as TokenSpeed's
    own tests do: "an intermediate prefill chunk produces no token"), it drains. Without
    that event each of r0 and r1 keeps a result in flight: after their ``Finish`` they
    are never erased, hold 4 of the 5 usable pages, and r2, which reserves 2, is never
    admitted; every plan is then empty, correctly (a forward may still be writing)."""
    require_peer("tokenspeed")
    outcome, _ = _probe(chunk_results=True)
    assert outcome == "drained"
    outcome, scheduler = _probe(chunk_results=False)
    assert outcome.startswith("stalled"), outcome
    assert (scheduler.waiting_size(), scheduler.available_lcm_blocks()) == (1, 1)
    assert [scheduler.request_token_size(f"r{k}") for k in range(3)] == [8, 8, 6]


def test_a_finished_id_is_held_until_the_next_plan() -> None:
    """TS8: re-adding an id in the step after it finished is refused on both sides, and
    accepted one step later."""
    require_peer("tokenspeed")
    c = config()
    lock = Lockstep(make_peer("tokenspeed", c), c, ORACLE)
    params = SamplingParams(max_tokens=1)
    lock.add("a", (200, 1), params)
    lock.step()  # "a" samples its one token and finishes
    assert lock.state.ids_held == ("a",)
    assert type(lock.add("a", (201, 1), params)).__name__ == "DuplicateRequestError"
    lock.step()  # the plan erases it
    assert lock.add("a", (202, 1), params) is None
    while lock.unfinished():
        lock.step()
    lock.finish()


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_an_aborted_id_is_held_until_the_next_plan(state: str) -> None:
    """TS8 for an abort (found by TokenSpeedMachine): the id is refused on both sides
    until the next plan, in every state the request was aborted in."""
    require_peer("tokenspeed")
    c = config(max_num_batched_tokens=2)
    lock = Lockstep(make_peer("tokenspeed", c), c, ORACLE)
    lock.add("a", (200, 1, 2), SamplingParams(max_tokens=4))
    for _ in range({"waiting": 0, "prefilling": 1, "decoding": 3}[state]):
        lock.step()
    lock.abort("a")
    assert lock.state.ids_held == ("a",)
    params = SamplingParams(max_tokens=1)
    assert type(lock.add("a", (201, 1), params)).__name__ == "DuplicateRequestError"
    lock.add("b", (202, 1), params)
    lock.step()  # the plan erases it
    assert lock.add("a", (203, 1), params) is None
    while lock.unfinished():
        lock.step()
    lock.finish()
