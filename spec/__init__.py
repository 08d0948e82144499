"""The reference scheduler: pure functions over immutable state (see docs/semantics.md).

Each rule ``R1``-``R11`` of ``docs/semantics.md`` is written once, in words, beside the
code that implements it:

- ``spec.kv``: block arithmetic (R2) and the never-fits check (R4);
- ``spec.policies``: victim choice, waiting order and admission gate (R9);
- ``spec.lifecycle``: ``init_state``, ``add_request`` (R4, with the liveness
  argument), ``abort_request`` (R11) and read-only queries;
- ``spec.scheduler``: a step: ``schedule`` (phases A-C, R5-R8, preemption R6) and
  ``complete_step`` (phase D, R10), or both at once with ``step``;
- ``spec.prefix_cache``: the GPU block pool with prefix caching (PC1-PC9), each
  profile's variant beside the rule it replaces, and ``grow`` (how a chunk takes blocks);
- ``spec.profiles``: the semantics profiles' rules (the one module that names a
  profile) and the settings each implies (``profile_defaults``);
- ``spec.invariants``: ``state_violations`` / ``plan_violations`` (what must hold);
- ``spec.liveness``: ``drain_step_bound`` (how long a drain can take), ``drain`` and
  ``progress_violations`` (no preempted request waits in a step that could take it back);
- ``spec.speculative``: the speculative-decoding rules under vllm-v1 (drafts scheduled,
  verified and rolled back; ``update_draft_token_ids``);
- ``spec.oracle``: pure toy next-token functions and the prompt-lookup drafter.

Nothing here mutates a value, does I/O or imports torch; every transition returns new
values. The data types live in ``spec.types`` and are shared with the engine, which
must never import the functions.
"""

import spec._clash  # noqa: F401  (first: names a shadowed spec/impl/model)
from spec.invariants import check_plan, check_state, plan_runs, plan_violations, state_violations
from spec.kv import (
    blocks_held,
    blocks_needed,
    cdiv,
    largest_prefill,
    max_cached_tokens,
    never_fits,
)
from spec.lifecycle import (
    abort_request,
    add_request,
    blocks_owned,
    find_request,
    has_unfinished_requests,
    init_state,
    is_live,
    live_request_ids,
    num_unfinished_requests,
)
from spec.liveness import (
    drain,
    drain_step_bound,
    head_steps,
    worst_head_steps,
)
from spec.oracle import ConstantOracle, HashOracle, SuccessorOracle, TokenOracle
from spec.policies import POLICIES, Policy, get_policy, is_registered, select_victim
from spec.progress import progress_violations
from spec.scheduler import (
    can_swap_out,
    complete_step,
    complete_verified_step,
    finish_reason,
    oracle_runs,
    oracle_tokens,
    plan_matches,
    preempt,
    recompute,
    restart,
    sampling_request_ids,
    schedule,
    step,
    swap_out,
)
from spec.speculative import update_draft_token_ids
from spec.types import (
    ConfigError,
    DuplicateRequestError,
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    KVSchedError,
    Preemption,
    PreemptionMode,
    Request,
    RequestState,
    RequestTooLargeError,
    SampledToken,
    SampledTokensError,
    SamplingParams,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    TokenOutOfVocabError,
    UnknownRequestError,
)

__all__ = [
    "POLICIES",
    "ConfigError",
    "ConstantOracle",
    "DuplicateRequestError",
    "EmptyPromptError",
    "FinishReason",
    "FinishedRequest",
    "HashOracle",
    "InvalidMaxTokensError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "KVSchedError",
    "Policy",
    "Preemption",
    "PreemptionMode",
    "Request",
    "RequestState",
    "RequestTooLargeError",
    "SampledToken",
    "SampledTokensError",
    "SamplingParams",
    "ScheduledChunk",
    "SchedulerConfig",
    "SchedulerState",
    "StepPlan",
    "SuccessorOracle",
    "TokenOracle",
    "TokenOutOfVocabError",
    "UnknownRequestError",
    "abort_request",
    "add_request",
    "blocks_held",
    "blocks_needed",
    "blocks_owned",
    "can_swap_out",
    "cdiv",
    "check_plan",
    "check_state",
    "complete_step",
    "complete_verified_step",
    "drain",
    "drain_step_bound",
    "find_request",
    "finish_reason",
    "get_policy",
    "has_unfinished_requests",
    "head_steps",
    "init_state",
    "is_live",
    "is_registered",
    "largest_prefill",
    "live_request_ids",
    "max_cached_tokens",
    "never_fits",
    "num_unfinished_requests",
    "oracle_runs",
    "oracle_tokens",
    "plan_matches",
    "plan_runs",
    "plan_violations",
    "preempt",
    "progress_violations",
    "recompute",
    "restart",
    "sampling_request_ids",
    "schedule",
    "select_victim",
    "state_violations",
    "step",
    "swap_out",
    "update_draft_token_ids",
    "worst_head_steps",
]
