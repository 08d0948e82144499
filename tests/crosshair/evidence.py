"""Which contracts count as evidence, and which only restate their function's body.

A postcondition such as ``post: __return__ == cdiv(num_computed_tokens, block_size)``
on ``blocks_held``, whose body is that very call, is documentation: CrossHair
confirms it, but a bug in the body would be copied into the contract by whoever wrote
both, so it proves little. Such conditions are still analysed (every contract must
be: CrossHair *assumes* a callee's postcondition while it analyses a caller, so an
unchecked one would hide bugs there, docs/crosshair.md), but ``scripts/crosshair_check``
counts them apart from the evidence, per module.

``RESTATEMENTS`` names each one by its function (as the runner's targets name them)
and a piece of the ``post:`` line that picks it out; the runner fails if an entry
matches no condition, or more than one, so the list cannot silently go stale.
"""

from __future__ import annotations

RESTATEMENTS: dict[tuple[str, str], str] = {
    ("spec.invariants.state_violations", "isinstance(__return__, tuple)"): "its return type",
    ("spec.invariants.plan_violations", "isinstance(__return__, tuple)"): "its return type",
    ("spec.kv.blocks_held", "__return__ == cdiv("): "the body is that call",
    ("spec.kv.max_cached_tokens", "__return__ == prompt_len + max_tokens - 1"): "the body",
    ("spec.kv.largest_prefill", "if mode is PreemptionMode.RESTART else"): "the body's branch",
    ("spec.kv.never_fits", "post: not __return__ or"): "the body's two checks, as a formula",
    ("spec.kv.chunk_for_prefill", "__return__ == (min(remaining, budget)"): "the body",
    ("spec.lifecycle.init_state", "num_free_gpu_blocks == config.num_gpu_blocks"): "the body",
    ("spec.lifecycle.init_state", "num_free_cpu_blocks == config.num_cpu_blocks"): "the body",
    ("spec.lifecycle.has_unfinished_requests", "__return__ == bool("): "the body",
    ("spec.lifecycle.add_request", "__return__ == replace(state,"): "the body's replace()",
    ("spec.lifecycle.add_request", "__return__.waiting[-1] == RequestState("): "the body",
    ("spec.oracle.ConstantOracle", "__return__ == self.token"): "the body",
    ("spec.policies.always_admit", "post: __return__"): "the body (return True)",
    ("spec.policies.stored_order", "__return__ == waiting"): "the body",
    ("spec.policies.lifo_victim", "__return__ == len(candidates) - 1"): "the body",
    ("spec.policies.fewest_outputs_victim", "_fewest_outputs_key(candidates, i) <="): "its key",
    ("spec.policies.reserve_admit", "__return__ == (not state.running or"): "the body",
    ("spec.policies.is_registered", "__return__ == (name in POLICIES)"): "the body",
    ("spec.policies.select_victim", "__return__ == policy.select_victim("): "the body's call",
    ("spec.scheduler.can_swap_out", "__return__ == (blocks_held("): "the body",
    ("spec.scheduler.swap_out", "num_computed_tokens == victim"): "the body's replace()",
    ("spec.scheduler.swap_out", "output_token_ids == victim"): "the body's replace()",
    ("spec.scheduler.swap_out", "num_preemptions == victim"): "the body's replace()",
    ("spec.scheduler.recompute", "num_computed_tokens == 0"): "the body's replace()",
    ("spec.scheduler.recompute", "output_token_ids == victim"): "the body's replace()",
    ("spec.scheduler.recompute", "num_preemptions == victim"): "the body's replace()",
    ("spec.scheduler.restart", "num_computed_tokens == 0"): "the body's replace()",
    ("spec.scheduler.restart", "output_token_ids == ()"): "the body's replace()",
    ("spec.scheduler.restart", "num_preemptions == victim"): "the body's replace()",
    ("spec.scheduler.release_victim", "__return__[2] == free + (blocks_held("): "the body",
    ("spec.scheduler.choose_victim", "__return__ == i + policy.select_victim("): "the body",
}
"""(function, a piece of the ``post:`` line) -> what in the body it restates."""
