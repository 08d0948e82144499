"""Which contracts count as evidence, and which only restate their function's body.

Every spec function states one ``post:`` condition (a named predicate where it has
more than one conjunct). A condition such as ``__return__ == (config.semantics is
Semantics.NANO_VLLM)`` on ``prefill_first``, whose body is that very comparison, is
documentation: CrossHair confirms it, but a bug in the body would be copied into the
contract by whoever wrote both, so it proves little. Such conditions are still
analysed (every contract must be: CrossHair *assumes* a callee's postcondition while
it analyses a caller, so an unchecked one would hide bugs there, docs/crosshair.md),
and they still catch a body edited later at run time
(``tests/spec/test_contracts_runtime.py``), but ``scripts/crosshair_check`` counts
them apart from the evidence, per module.

A condition restates its body when it states the same rule the body computes, even in
other arithmetic (token slots instead of ``cdiv`` blocks, a predicate that names each
profile's rule again). A condition with one conjunct the body does not compute (a
bound, a state invariant, a conservation law the body reaches by other steps) counts
as evidence.

``RESTATEMENTS`` names each one by its function (as the runner's targets name them)
and a piece of its ``post:`` line; the runner fails if an entry matches no
condition, or more than one, so the list cannot silently go stale.
"""

from __future__ import annotations

RESTATEMENTS: dict[tuple[str, str], str] = {
    ("spec.kv.never_fits", "not fits_alone("): "the body's two checks, in token slots",
    ("spec.lifecycle.has_unfinished_requests", "__return__ == bool("): "the body",
    ("spec.lifecycle.has_requests", "__return__ == (bool(live_request_ids"): "the body",
    ("spec.profiles.num_tokens_with_placeholders", "__return__ == request.num_tokens"): "the body",
    ("spec.profiles.stale_output_in_flight", "__return__ == (request.num_stale"): "the body",
    ("spec.oracle.ConstantOracle", "__return__ == self.token"): "the body",
    ("spec.policies.stored_order", "__return__ == waiting"): "the body",
    ("spec.policies.lifo_victim", "__return__ == len(candidates) - 1"): "the body",
    ("spec.policies.is_registered", "__return__ == (name in POLICIES)"): "the body",
    ("spec.policies.select_victim", "0 <= __return__ < len(candidates)"): "the body's check",
    ("spec.profiles.model_len", "(__return__ is None) =="): "the body's test",
    ("spec.profiles.too_large", "never_fits(config, prompt_len"): "the body's branch",
    ("spec.profiles.length_capped", "over_model_len("): "the body's two tests",
    ("spec.profiles.full_sequence_fits", "sequence_in_slots("): "the gate, in token slots",
    ("spec.profiles.victim_among_all_running", "Semantics.VLLM_V1 and"): "the body",
    ("spec.profiles.prefill_first", "Semantics.NANO_VLLM)"): "the body",
    ("spec.profiles.decode_unbudgeted", "Semantics.NANO_VLLM)"): "the body",
    ("spec.profiles.running_capped", "not in (Semantics.NANO_VLLM,"): "the body",
    ("spec.profiles.next_victim", "(1 if num_candidates > 1 else 0)"): "the body",
    ("spec.profiles.victim_next", "Semantics.NANO_VLLM)"): "the body",
    ("spec.profiles.nano_caching", "enable_prefix_caching"): "the body",
    ("spec.profiles.whole_sequence_admissible", "sequence_in_slots("): "the gate, in slots",
    ("spec.scheduler.can_swap_out", "num_free_cpu_blocks * block_size"): "the body, in slots",
    ("spec.scheduler.swap_out", "preempted_as("): "the body's replace()",
    ("spec.scheduler.recompute", "preempted_as("): "the body's replace()",
    ("spec.scheduler.restart", "preempted_as("): "the body's replace()",
    ("spec.scheduler.profile_victim", "victim_by_profile("): "each profile's victim rule again",
}
"""(function, a piece of its ``post:`` line) -> what in the body it restates."""
