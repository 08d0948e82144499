"""A request's life outside the step: creating the state, adding (R4), aborting (R11).

Also the read-only queries the others use (where a request is, whether anything is
left to do). Every function is pure: it returns a new state and leaves its inputs as
they were; an error is raised before anything is built, so a refused call changes
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

from spec.invariants import check_state
from spec.kv import blocks_held
from spec.policies import get_policy
from spec.prefix_cache import holders, release_blocks
from spec.profiles import gpu_blocks_owned, held_after_finish, model_len, too_large
from spec.types import (
    ConfigError,  # noqa: F401  (named by a contract's raises:)
    DuplicateRequestError,
    EmptyPromptError,
    FinishedRequest,
    FinishReason,
    InvalidMaxTokensError,
    PrefixCacheState,
    Request,
    RequestState,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    Semantics,
    UnknownRequestError,
)

Queue = Literal["waiting", "running", "swapped"]


def init_state(config: SchedulerConfig) -> SchedulerState:
    """The empty state for ``config``: all blocks free, no request, step 0.

    ``ConfigError`` if ``config.policy`` names no registered policy (R9); the other
    fields were checked when the config was built.

    post: check_state(__return__) and __return__.config == config and not is_busy(__return__)
    raises: ConfigError
    """
    get_policy(config.policy)
    return SchedulerState(
        config=config,
        num_free_gpu_blocks=config.num_gpu_blocks,
        num_free_cpu_blocks=config.num_cpu_blocks,
        # PC1: every block free, in id order (vLLM's initial free queue), none keyed.
        prefix_cache=PrefixCacheState(free_queue=tuple(range(config.num_gpu_blocks)))
        if config.enable_prefix_caching
        else None,
    )


def found_at(state: SchedulerState, request_id: str, where: tuple[Queue, int] | None) -> bool:
    """``find_request``'s contract: ``where`` holds ``request_id``; None only if it is not live."""
    if where is None:
        return request_id not in live_request_ids(state)
    queue, index = where
    return index >= 0 and getattr(state, queue)[index].request_id == request_id


def is_busy(state: SchedulerState) -> bool:
    """Whether any request is live or step in flight, or any block (GPU or CPU) is not free."""
    return bool(live_request_ids(state) or state.in_flight) or (
        state.num_free_gpu_blocks,
        state.num_free_cpu_blocks,
    ) != (state.config.num_gpu_blocks, state.config.num_cpu_blocks)


def find_request(state: SchedulerState, request_id: str) -> tuple[Queue, int] | None:
    """Where the live request ``request_id`` is (R1): its queue and index, or None.

    post: found_at(state, request_id, __return__)
    """
    queues: tuple[tuple[Queue, tuple[RequestState, ...]], ...] = (
        ("waiting", state.waiting),
        ("running", state.running),
        ("swapped", state.swapped),
    )
    for name, queue in queues:
        for index, request in enumerate(queue):
            if request.request_id == request_id:
                return name, index
    return None


def is_live(state: SchedulerState, request_id: str) -> bool:
    """Whether ``request_id`` names a request in one of the queues (R1).

    post: __return__ == (request_id in live_request_ids(state))
    """
    return find_request(state, request_id) is not None


def live_request_ids(state: SchedulerState) -> tuple[str, ...]:
    """Every live id: waiting, then running, then swapped, each in queue order (R1).

    post: len(__return__) == len(state.waiting) + len(state.running) + len(state.swapped)
    """
    return tuple(r.request_id for r in (*state.waiting, *state.running, *state.swapped))


def has_unfinished_requests(state: SchedulerState) -> bool:
    """Whether any request is still live (waiting, running or swapped), or, under async
    scheduling, a step is still in flight (``EngineCore`` steps until its batch queue is
    empty, vllm-v1/async-batch-queue).

    post: __return__ == bool(state.waiting or state.running or state.swapped or state.in_flight)
    """
    return bool(state.waiting or state.running or state.swapped or state.in_flight)


def has_requests(state: SchedulerState) -> bool:
    """**vllm-v1/async-batch-queue**: whether an async step schedules at all: a request
    is live, or one finished or was aborted since the last ``schedule`` (vLLM's
    ``has_requests``, ``v1/core/sched/interface.py:199-202``; ``EngineCore`` reads it at
    ``v1/engine/core.py:723``).

    post: __return__ == (bool(live_request_ids(state)) or state.has_finished_requests)
    """
    return bool(state.waiting or state.running or state.swapped) or state.has_finished_requests


def num_unfinished_requests(state: SchedulerState) -> int:
    """How many requests are live.

    post: __return__ == len(live_request_ids(state))
    """
    return len(state.waiting) + len(state.running) + len(state.swapped)


def check_new_request(
    state: SchedulerState, request_id: str, prompt_len: int, params: SamplingParams
) -> None:
    """R4, checks 1, 2, 4 and 5 in this order; the first that fails raises.

    Check 3 (a token id outside the vocabulary) is the engine's: only it knows the
    vocabulary, so the spec accepts any int.

    Check 4 also refuses an id tokenspeed/finished-id-held still holds. Check 5 is the
    profile's ``too_large`` (``never_fits``, vllm-v1/max-model-len's "prompt >=
    max_model_len", vllm-v0/max-model-len's "prompt > max_model_len",
    tokenspeed/submit-refusal's "P + M tokens exceed the cache").

    post: not too_large(state.config, prompt_len, params.max_tokens)
    raises: EmptyPromptError, InvalidMaxTokensError, DuplicateRequestError, RequestTooLargeError
    """
    if prompt_len < 1:
        raise EmptyPromptError(f"request {request_id!r} has an empty prompt")
    if params.max_tokens < 1:
        raise InvalidMaxTokensError(
            f"request {request_id!r}: max_tokens must be >= 1, got {params.max_tokens}"
        )
    if is_live(state, request_id):
        raise DuplicateRequestError(f"request {request_id!r} is already live")
    if request_id in state.ids_held:  # tokenspeed/finished-id-held
        raise DuplicateRequestError(f"request {request_id!r} finished in the last step")
    if too_large(state.config, prompt_len, params.max_tokens):
        config = state.config
        length = model_len(config)
        if length is not None:
            relation = ">" if config.semantics is Semantics.VLLM_V0 else ">="
            raise RequestTooLargeError(
                f"request {request_id!r}: prompt of {prompt_len} tokens {relation} "
                f"max_model_len {length}"
            )
        raise RequestTooLargeError(
            f"request {request_id!r} can never be scheduled: prompt {prompt_len} + "
            f"max_tokens {params.max_tokens} - 1 tokens in {config.num_gpu_blocks} GPU "
            f"blocks of {config.block_size}, budget {config.max_num_batched_tokens}, "
            f"chunked prefill {'on' if config.enable_chunked_prefill else 'off'}, "
            f"{config.preemption_mode} mode"
        )


def accepted_at_tail(
    state: SchedulerState,
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    after: SchedulerState,
) -> bool:
    """``add_request``'s contract: ``after`` is valid, and is ``state`` with one fresh
    request at the tail of ``waiting``, given the next arrival."""
    new = RequestState(
        request=Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            arrival=state.next_arrival,
        )
    )
    return check_state(after) and after == replace(
        state, waiting=(*state.waiting, new), next_arrival=state.next_arrival + 1
    )


def add_request(
    state: SchedulerState,
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
) -> SchedulerState:
    """Accept a request (R4): it goes to the tail of ``waiting``.

    The checks of R4 run in order and the first that fails raises its typed error
    (``EmptyPromptError``, ``InvalidMaxTokensError``, ``DuplicateRequestError``,
    ``RequestTooLargeError``) and changes nothing. An accepted request gets
    ``arrival = next_arrival`` (then ``next_arrival`` goes up by one), no outputs,
    ``computed = 0``, no preemptions.

    **Why every accepted request finishes (liveness, under ``lifo``).** Check 5 refuses
    exactly the requests that could never be scheduled alone: an accepted request's
    ``L = P + M - 1`` cached tokens fit the whole GPU pool, and with chunked prefill off
    its largest prefill fits one step's budget. Now take the head of ``running``. The
    ``lifo`` victim is the *last* candidate, and the candidates for ``running[i]`` are
    ``running[i:]``, so the head is only ever a victim when it is alone in ``running``.
    But then every GPU block it does not own is free (swapped requests own CPU blocks
    only), so by check 5 its next chunk fits and no victim is needed at all: the head
    is never preempted. It is scheduled first in every step with the whole budget, so
    it makes progress every step (a prefill chunk of ``min(remaining, budget) >= 1``
    tokens or a decode) and finishes after at most ``ceil(remaining / budget)`` prefill
    steps plus one decode step per missing output. When it finishes the next request
    in ``running`` becomes the head; when ``running`` is empty, the head of ``swapped``
    (or, with ``swapped`` empty, the first waiting request) is alone, fits by check 5
    and is admitted in that very step. So every step serves some head, heads follow one
    another, and each request is head at most once: with no new arrivals all requests
    finish, within ``spec.liveness.drain_step_bound(state)`` steps.

    pre: check_state(state)
    post: accepted_at_tail(state, request_id, prompt_token_ids, params, __return__)
    raises: EmptyPromptError, InvalidMaxTokensError, DuplicateRequestError, RequestTooLargeError
    """
    prompt = tuple(prompt_token_ids)
    check_new_request(state, request_id, len(prompt), params)
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        arrival=state.next_arrival,
    )
    return replace(
        state,
        waiting=(*state.waiting, RequestState(request=request)),
        next_arrival=state.next_arrival + 1,
    )


def blocks_owned(state: SchedulerState, request_id: str) -> tuple[int, int]:
    """``(gpu, cpu)`` blocks the live request owns (R2); ``(0, 0)`` if it is not live.

    A running request owns GPU blocks (``gpu_blocks_owned``: its computed tokens', or
    under tokenspeed/reserve-generation its whole generation's), a swapped one CPU
    blocks, a waiting one none.

    pre: check_state(state)
    post: __return__[0] >= 0 and __return__[1] >= 0
    """
    where = find_request(state, request_id)
    if where is None:
        return 0, 0
    queue, index = where
    bs = state.config.block_size
    if queue == "running":
        request = state.running[index]
        return gpu_blocks_owned(state.config, request, request.num_computed_tokens), 0
    if queue == "swapped":
        return 0, blocks_held(state.swapped[index].num_computed_tokens, bs)
    return 0, 0


def within_owned(state: SchedulerState, request_id: str, freed: tuple[int, int]) -> bool:
    """``blocks_freed``' contract: at most the GPU blocks it owns, exactly its CPU blocks."""
    gpu, cpu = blocks_owned(state, request_id)
    return 0 <= freed[0] <= gpu and freed[1] == cpu


def blocks_freed(state: SchedulerState, request_id: str) -> tuple[int, int]:
    """``(gpu, cpu)`` blocks that come free when the live request leaves (R2, PC6).

    ``blocks_owned``, but with prefix caching on only the request's GPU blocks that no
    other running request holds: a shared block stays in use (counted once, PC1).

    pre: check_state(state)
    post: within_owned(state, request_id, __return__)
    """
    gpu, cpu = blocks_owned(state, request_id)
    if state.prefix_cache is None or gpu == 0:
        return gpu, cpu
    others = holders(tuple(r for r in state.running if r.request_id != request_id))
    (request,) = (r for r in state.running if r.request_id == request_id)
    return len(set(request.block_ids) - others.keys()), cpu


def _without(queue: tuple[RequestState, ...], index: int) -> tuple[RequestState, ...]:
    return queue[:index] + queue[index + 1 :]


def aborted(
    state: SchedulerState, request_id: str, after: SchedulerState, finished: FinishedRequest
) -> bool:
    """``abort_request``'s contract: ``after`` is valid; exactly ``blocks_freed`` came free;
    every other live request is kept, in order; the request is reported aborted, with
    its outputs and preemption count."""
    if not check_state(after):
        return False
    gpu, cpu = blocks_freed(state, request_id)
    kept = tuple(rid for rid in live_request_ids(state) if rid != request_id)
    live = (*state.waiting, *state.running, *state.swapped)
    reports = [(r.output_token_ids, r.num_preemptions) for r in live if r.request_id == request_id]
    return (
        after.num_free_gpu_blocks == state.num_free_gpu_blocks + gpu
        and after.num_free_cpu_blocks == state.num_free_cpu_blocks + cpu
        and live_request_ids(after) == kept
        and (finished.request_id, finished.finish_reason) == (request_id, FinishReason.ABORTED)
        and reports == [(finished.output_token_ids, finished.num_preemptions)]
    )


def abort_request(state: SchedulerState, request_id: str) -> tuple[SchedulerState, FinishedRequest]:
    """Abort a live request, wherever it is (R11).

    It leaves its queue; a running request frees its GPU blocks, a swapped one its CPU
    blocks (with prefix caching, those no other request holds, PC6), a waiting one
    holds none. It is returned as ``FinishedRequest(outputs so
    far, reason aborted, num_preemptions)`` (R3: reported once, here). An id that is
    not live raises ``UnknownRequestError`` and changes nothing.

    pre: check_state(state)
    post: aborted(state, request_id, *__return__)
    raises: UnknownRequestError
    """
    where = find_request(state, request_id)
    if where is None:
        raise UnknownRequestError(f"no live request {request_id!r}")
    queue, index = where
    gpu, cpu = blocks_owned(state, request_id)
    if queue == "waiting":
        request = state.waiting[index]
        new_state = replace(state, waiting=_without(state.waiting, index))
    elif queue == "running":
        request = state.running[index]
        running = _without(state.running, index)
        cache = state.prefix_cache
        if cache is not None:  # PC6: blocks shared with another request stay in use
            cache = release_blocks(state.config, cache, request.block_ids, holders(running))
            gpu = len(cache.free_queue) - state.num_free_gpu_blocks
        new_state = replace(
            state,
            running=running,
            num_free_gpu_blocks=state.num_free_gpu_blocks + gpu,
            prefix_cache=cache,
        )
    else:
        request = state.swapped[index]
        new_state = replace(
            state,
            swapped=_without(state.swapped, index),
            num_free_cpu_blocks=state.num_free_cpu_blocks + cpu,
        )
    finished = FinishedRequest(
        request_id=request_id,
        output_token_ids=request.output_token_ids,
        finish_reason=FinishReason.ABORTED,
        num_preemptions=request.num_preemptions,
    )
    if state.config.async_scheduling:  # vllm-v1/async-batch-queue: finished_req_ids
        new_state = replace(new_state, has_finished_requests=True)
    held = held_after_finish(state.config, (request_id,))  # until the next plan
    if held:
        new_state = replace(new_state, ids_held=(*state.ids_held, *held))
    return new_state, finished
