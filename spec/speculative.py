"""Speculative decoding under vllm-v1 (vllm-v1/spec-*): drafts scheduled as tokens,
verified in the step, rejected drafts rolled back.

vLLM 0.32 with an n-gram ``speculative_config`` (``num_speculative_tokens = K``) runs
one verify forward per step over each request's last token and its drafts; the model
accepts the longest prefix of the drafts it agrees with and samples one more token.
These are the rules that changes, each named as docs/semantics.md names it (paths in
vLLM 0.32.0's ``vllm/``; docs/design/speculative-decoding.md has the walk through the
source). The phases call them; nothing here knows a queue.

- **vllm-v1/spec-drafts-scheduled**: a running request's chunk runs up to its
  ``num_tokens + len(spec_token_ids)``, cut like any chunk (long-prefill cap, budget)
  and to ``max_model_len - 1 - computed``; the drafts scheduled are the first
  ``start + n - num_tokens`` of them (``spec.profiles.num_tokens_with_spec``,
  ``drafts_scheduled``). They take budget and blocks like any token.
- **vllm-v1/spec-padded-new-decode**: a waiting request whose chunk is one token is
  padded with ``K`` drafts of ``-1``, never accepted (``pads``).
- **vllm-v1/spec-verify**: a request that samples returns its accepted drafts and one
  more token; ``computed`` goes back by the drafts rejected, the blocks stay
  (``num_blocks_ahead``), and the stop checks run token by token (``verified``).
- **vllm-v1/spec-propose**: after the step, each request of the batch that sampled
  and is still running gets the drafter's next drafts; one mid-prefill gets none
  (``update_draft_token_ids``).
- **vllm-v1/spec-unkeyed-drafts**: prefix caching keys no draft (``spec.prefix_cache.grow``
  keys up to the known tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from spec.kv import cdiv
from spec.oracle import Drafter, TokenOracle
from spec.profiles import model_len, num_tokens_with_placeholders, speculative
from spec.types import RequestState, SchedulerConfig, SchedulerState, StepPlan

#: The draft id of a padded new decode (vllm-v1/spec-padded-new-decode): never a token.
PAD = -1


def num_drafts_run(request: RequestState, start: int, num_tokens: int) -> int:
    """**vllm-v1/spec-drafts-scheduled**: how many draft positions a chunk ``start ..
    start + num_tokens`` of ``request`` runs: those past its known tokens (and
    placeholders), ``scheduler.py:864-869``.

    post: __return__ == max(0, start + num_tokens - num_tokens_with_placeholders(request))
    """
    return max(0, start + num_tokens - num_tokens_with_placeholders(request))


def drafts_scheduled(request: RequestState, start: int, num_tokens: int) -> tuple[int, ...]:
    """**vllm-v1/spec-drafts-scheduled**: the drafts that chunk runs, the first
    ``num_drafts_run`` of the request's ``spec_token_ids`` (``scheduler.py:860-876``). A
    chunk cut short drops drafts from the end; one that ends at or before
    ``num_tokens`` runs none.

    post: __return__ == request.spec_token_ids[: num_drafts_run(request, start, num_tokens)]
    """
    return request.spec_token_ids[: num_drafts_run(request, start, num_tokens)]


def capped_to_model_len(config: SchedulerConfig, request: RequestState, remaining: int) -> int:
    """**vllm-v1/spec-drafts-scheduled**, the length cap: a running chunk ends at
    ``max_model_len - 1`` at most (``scheduler.py:714-721``: a position past it could not
    be sampled). Only drafts can reach it: a request without them has fewer tokens than
    ``max_model_len`` (it would have finished by length), and its one token left to
    compute sits below it.

    pre: remaining >= 1
    pre: request.num_computed_tokens < request.num_tokens
    post: 1 <= __return__ <= remaining
    """
    length = model_len(config)
    if length is None or not request.spec_token_ids:
        return remaining
    return max(1, min(remaining, length - 1 - request.num_computed_tokens))


def pads(
    config: SchedulerConfig,
    *,
    start: int,
    num_tokens: int,
    prefill_scheduled: bool,
    running_scheduled: bool,
) -> bool:
    """**vllm-v1/spec-padded-new-decode** (``scheduler.py:1128-1153``): whether phase C
    pads the one-token chunk of a waiting request starting at ``start`` (its cache hit)
    to ``1 + K`` tokens, ``K`` drafts of ``PAD``, so that every decode of the step has
    the drafts' width (a full CUDA graph).

    It pads when ``K > 0``, the chunk is one token (a resumed or fully cached request,
    or a one-token prompt), no running request of the step is mid-prefill
    (``prefill_scheduled``), some running request was scheduled (``running_scheduled``)
    or the request has a hit, and the padded chunk leaves room for its sampled token:
    ``start + 1 + K + 1 <= max_model_len``. A padded chunk that does not fit the budget
    stops the admissions (``scheduler.py:1149-1151``: "prefer to not schedule than
    schedule un-padded"); phase C tests that. Under a budget below ``1 + K`` a padded
    chunk could never fit and the request would wait forever, as in vLLM, so the config
    refuses that budget (``SchedulerConfig``). No contract: the predicate phase C and
    Rule P ask of every candidate (CrossHair would assume it in their place).
    """
    drafts = config.num_speculative_tokens
    length = model_len(config)
    return (
        drafts > 0
        and num_tokens == 1
        and not prefill_scheduled
        and (running_scheduled or start > 0)
        and length is not None
        and start + 1 + drafts + 1 <= length
    )


def padded(request: RequestState, config: SchedulerConfig) -> RequestState:
    """The admitted request with its ``K`` pad drafts, which its chunk runs
    (vllm-v1/spec-padded-new-decode; ``scheduler.py:1371-1375``).

    post: __return__.spec_token_ids == (PAD,) * config.num_speculative_tokens
    """
    return replace(request, spec_token_ids=(PAD,) * config.num_speculative_tokens)


def verify(
    context: tuple[int, ...], drafts: Sequence[int], next_token: TokenOracle
) -> tuple[int, ...]:
    """**vllm-v1/spec-verify**, greedy: the longest prefix of ``drafts`` that a model
    sampling ``next_token(prefix)`` agrees with, then the model's next token (the
    bonus token when every draft is accepted). A ``PAD`` is never accepted: the model
    samples token ids, never ``-1``.

    post: __return__ and __return__[:-1] == tuple(drafts)[: len(__return__) - 1]
    """
    accepted: list[int] = []
    for draft in drafts:
        if draft != next_token((*context, *accepted)):
            break
        accepted.append(draft)
    return (*accepted, next_token((*context, *accepted)))


def valid_run(drafts: tuple[int, ...], run: tuple[int, ...]) -> bool:
    """**vllm-v1/spec-verify**: what a verify step may return for a request whose chunk
    ran ``drafts``: one token to ``len(drafts) + 1``, all but the last its drafts (the
    accepted ones; a ``PAD`` never is). No contract: it is the rule phase D tests each
    run with (CrossHair would assume a weaker one in its place).
    """
    return (
        1 <= len(run) <= len(drafts) + 1
        and run[:-1] == drafts[: len(run) - 1]
        and PAD not in run[:-1]
    )


def num_accepted(drafts: tuple[int, ...], run: tuple[int, ...]) -> int:
    """How many of a delivered ``run``'s tokens are accepted drafts: all but the last,
    and the last too when it is a draft (a run cut after a stop inside the accepted
    drafts; an uncut run ends with a token no draft matched, or the bonus token).

    pre: valid_run(drafts, run)
    post: len(run) - 1 <= __return__ <= min(len(run), len(drafts))
    """
    if len(run) <= len(drafts) and run[-1] == drafts[len(run) - 1]:
        return len(run)
    return len(run) - 1


def blocks_ahead_after(
    request: RequestState, start: int, num_tokens: int, computed: int, block_size: int
) -> int:
    """**vllm-v1/spec-rejected-blocks-kept** (``update_from_output``,
    ``scheduler.py:2110-2128``): a request that ran ``start .. start + num_tokens`` and
    ends the step with ``computed`` tokens keeps every block its table held, those of
    its rejected drafts included; this is how many lie past ``cdiv(computed, bs)``.

    pre: block_size >= 1
    pre: 0 <= request.num_computed_tokens and 0 <= request.num_blocks_ahead
    pre: 0 <= start <= computed <= start + num_tokens
    post: __return__ >= 0
    """
    held = max(
        cdiv(start + num_tokens, block_size),
        cdiv(request.num_computed_tokens, block_size) + request.num_blocks_ahead,
    )
    return max(0, held - cdiv(computed, block_size))


def update_draft_token_ids(
    state: SchedulerState, plan: StepPlan, drafter: Drafter
) -> SchedulerState:
    """**vllm-v1/spec-propose** (``EngineCore.post_step`` hands the drafter's output to
    ``Scheduler.update_draft_token_ids``, ``v1/core/sched/scheduler.py:2550-2569``): each
    request the step scheduled that is still running gets ``drafter(prompt + outputs)``,
    at most ``K`` of them, if it sampled in the step, and none (its drafts cleared) if
    its chunk ended mid-prefill. Finished requests are gone; a request not scheduled
    keeps what it had. ``state`` is the state after ``plan``'s step.

    post: len(__return__.running) == len(state.running)
    """
    if not speculative(state.config) or not plan.scheduled_ids:
        return state
    limit = state.config.num_speculative_tokens
    in_batch = set(plan.scheduled_ids)
    sampled = set(plan.sampled_ids)
    running = tuple(
        replace(
            r,
            spec_token_ids=(
                tuple(drafter((*r.request.prompt_token_ids, *r.output_token_ids)))[:limit]
                if r.request_id in sampled
                else ()
            ),
        )
        if r.request_id in in_batch
        else r
        for r in state.running
    )
    return replace(state, running=running)
