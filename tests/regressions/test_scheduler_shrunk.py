"""Shrunk failures of ``SchedulerDifferential``, replayed as plain tests.

Each test is the program Hypothesis printed for a failure ("Failing test case: <state
machine>"), pasted as it is: it builds the machine, calls its rules with the shrunk
arguments, runs the invariants it ran, and ``teardown()`` (bounded drain, every
request finished, outputs equal to solo runs). It passes on correct code and fails
on the bug it was shrunk from; ``scripts/mutation_check.py --regressions`` checks
the second half. (``@example`` does not work for state machines; these are the
maintainers' recommended replacement, see docs/stateful-testing.md.)

The bugs here were planted by the mutation check (its mutant names are given), not
found in the shipped code: the suite has found no divergence between spec/ and
impl/ so far. A real one would be pinned the same way.
"""

from __future__ import annotations

from spec.types import PreemptionMode, SchedulerConfig
from tests.stateful.strategies import NewRequest
from tests.stateful.test_scheduler_differential import SchedulerDifferential


def test_swap_in_copies_into_the_right_blocks() -> None:
    """Mutant ``swap-in-wrong-slots``: the swap-in copy reversed the GPU block ids.

    Failed with ``[kv_contents] step 8: 'r5' (arrival 3) reads position 0 from slot 0,
    which holds (1, 0, 49)`` during the drain: a request swapped back in read another
    request's K/V. Shrunk under the ci profile.
    """
    state = SchedulerDifferential()
    state.init_engine(
        initial=[
            NewRequest(
                prompt_len=1,
                max_tokens=3,
                oversize=False,
                salt=1,
                eos=None,
                ignore_eos=False,
                priority=0,
                temperature=0.8,
            )
        ],
        config=SchedulerConfig(
            num_gpu_blocks=8,
            block_size=1,
            max_num_batched_tokens=60,
            max_num_seqs=8,
            enable_chunked_prefill=True,
            preemption_mode=PreemptionMode.SWAP,
            num_cpu_blocks=6,
            policy="priority",
        ),
    )
    state.blocks_conserved()
    state.kv_within_capacity()
    state.observe_matches_spec()
    state.real_self_check()
    state.spec_state_valid()
    state.abort_unknown()
    state.blocks_conserved()
    state.kv_within_capacity()
    state.observe_matches_spec()
    state.real_self_check()
    state.spec_state_valid()
    state.abort_live(pick=0, queue="waiting")
    state.blocks_conserved()
    state.kv_within_capacity()
    state.observe_matches_spec()
    state.real_self_check()
    state.spec_state_valid()
    state.add_request(
        req=NewRequest(
            prompt_len=1,
            max_tokens=8,
            oversize=False,
            salt=0,
            eos=None,
            ignore_eos=False,
            priority=0,
            temperature=0.0,
        )
    )
    state.blocks_conserved()
    state.kv_within_capacity()
    state.observe_matches_spec()
    state.real_self_check()
    state.spec_state_valid()
    state.add_burst(
        reqs=[
            NewRequest(
                prompt_len=1,
                max_tokens=1,
                oversize=False,
                salt=0,
                eos=None,
                ignore_eos=False,
                priority=0,
                temperature=0.0,
            ),
            NewRequest(
                prompt_len=1,
                max_tokens=5,
                oversize=False,
                salt=28,
                eos=None,
                ignore_eos=True,
                priority=3,
                temperature=0.8,
            ),
        ]
    )
    state.blocks_conserved()
    state.kv_within_capacity()
    state.observe_matches_spec()
    state.real_self_check()
    state.spec_state_valid()
    state.teardown()


def test_no_admission_in_a_step_that_preempted() -> None:
    """Mutant ``admit-after-preemption``: phase C ran in a step that had preempted.

    Two requests of one prompt token and five outputs in eight one-token blocks with a
    budget of two: the step that preempts one (restart) must not admit it, or any
    other, again. Failed in the drain with ``[plan_matches_spec] step 4: scheduled:
    real (r1 4+1, r2 0+1) != spec (r1 4+1)``.
    """
    state = SchedulerDifferential()
    state.init_engine(
        config=SchedulerConfig(
            num_gpu_blocks=8,
            block_size=1,
            max_num_batched_tokens=2,
            max_num_seqs=2,
            enable_chunked_prefill=False,
            preemption_mode=PreemptionMode.RESTART,
            num_cpu_blocks=0,
            policy="fewest-outputs",
        ),
        initial=[
            NewRequest(
                prompt_len=1,
                max_tokens=5,
                oversize=False,
                salt=0,
                eos=None,
                ignore_eos=False,
                priority=0,
                temperature=0.0,
            ),
            NewRequest(
                prompt_len=1,
                max_tokens=5,
                oversize=False,
                salt=0,
                eos=None,
                ignore_eos=False,
                priority=0,
                temperature=0.0,
            ),
        ],
    )
    state.blocks_conserved()
    state.kv_within_capacity()
    state.observe_matches_spec()
    state.real_self_check()
    state.spec_state_valid()
    state.teardown()
