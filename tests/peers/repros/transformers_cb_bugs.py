# transformers' own annotations are partial; this script is for its maintainers, as is.
# mypy: disable-error-code="attr-defined,no-untyped-call,arg-type,assignment"
"""Three scheduling bugs of transformers' continuous batching (transformers 5.19.0), standalone.

Needs only ``transformers`` and ``torch`` (CPU). Each scenario builds the
``ContinuousBatchProcessor`` the manager builds (``PagedAttentionCache``,
``FIFOScheduler``, ``OffloadingManager``) for a one-layer Llama *config* (no weights:
a fake model runner answers every sampling request with a fixed token), then calls
``prepare_next_batch`` / ``_generation_step`` / ``update_batch`` once per step, as
``ContinuousBatchingManager._generation_loop_body`` does. Requests and cancellations go
through the processor's input and cancel queues, as ``add_request`` and
``cancel_request`` put them. Block size (``page_size``) 4; a cache block is one sector.

    python transformers_cb_bugs.py                      # every scenario
    python transformers_cb_bugs.py frozen-after-cancel  # one of them

Each scenario raises ``AssertionError`` with the violated property in plain words (and
exits 1); on a fixed version it prints ``ok``.

- ``frozen-after-cancel``: after an offload, ``block_new_requests`` stays set until a
  request *finishes*; if the running requests are cancelled instead, the offloaded
  request is never scheduled again and the loop spins on empty batches forever.
- ``cpu-pool-pop``: ``OffloadingManager._reserve_cpu_blocks`` counts the free blocks of
  an allocated CPU sector, then ``try_to_free_sectors`` gives that sector back, so it
  reserves fewer blocks than the victim needs and ``get_free_blocks`` raises
  ``ValueError: Cannot pop 2 leaves from a tree with 1 leaves`` instead of falling back
  to a soft reset.
- ``oversize-request``: a request that can never fit the cache is accepted; when it is
  the only active request, ``prepare_next_batch`` raises ``RuntimeError: No requests can
  be scheduled and no requests can be offloaded.``, which ends the generation loop and
  fails every other request.
"""

from __future__ import annotations

import logging
import queue
import sys
from typing import Any

import torch
from transformers import LlamaConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import continuous_api, offloading_manager
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.initialization import (
    resolve_continuous_batching_config,
)
from transformers.generation.continuous_batching.requests import RequestState
from transformers.generation.continuous_batching.scheduler import FIFOScheduler
from transformers.generation.logits_process import LogitsProcessorList

logging.getLogger("transformers").setLevel(logging.ERROR)
PAGE = 4
HEAD_DIM = 16  # one float32 KV head: a block of PAGE tokens is 128 * PAGE bytes, one sector


class FakeRunner:
    """Answers every request that samples with token 7 (no model)."""

    pad_inputs = False

    def __init__(self, io: Any) -> None:
        self.io = io

    def maybe_pad_inputs(self, num_q: int, max_kv: int, fast: bool) -> tuple[int, int]:
        return num_q, max_kv

    def compute_batch(self, model: Any, batch_data: Any) -> None:
        samplers = [f for f in self.io.requests_in_batch if f.has_new_token]
        self.io.output_ids[0, : len(samplers)] = 7


class Unpinned:
    """torch, with ``empty`` ignoring ``pin_memory`` (pinning needs an accelerator)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return torch.empty(*args, **kwargs)


def processor(num_blocks: int, budget: int, cpu_blocks: int = 0) -> Any:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=HEAD_DIM,
        intermediate_size=HEAD_DIM,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
    )
    config._attn_implementation = "sdpa"
    sector = 2 * HEAD_DIM * 4 * PAGE
    logits = ContinuousBatchingLogitsProcessorList(LogitsProcessorList(), False, True)
    cb = resolve_continuous_batching_config(
        config,
        ContinuousBatchingConfig(
            page_size=PAGE,
            num_blocks=num_blocks,
            max_batch_tokens=budget,
            max_requests_per_batch=4,
            allow_block_sharing=False,
            use_async_batching=False,
            use_cuda_graph=False,
            max_blocks_per_request=0,
            max_memory_percent=0.9,
            cpu_offload_space=(cpu_blocks + 0.5) * sector / 2**30 if cpu_blocks else 0.0,
            cpu_offload_space_safety_threshold=1.0,
        ),
        None,
        has_logit_processors=False,
    )
    helper = DistributedHelper(None, None)
    cache = PagedAttentionCache(config, cb, torch.device("cpu"), helper, dtype=torch.float32)
    scheduler = FIFOScheduler(cache, cb.safety_margin, cb.max_requests_per_batch)
    offloading_manager.torch = Unpinned()
    try:
        proc = continuous_api.ContinuousBatchProcessor(
            cache, config, GenerationConfig(), cb, logits, queue.Queue(), queue.Queue(),
            continuous_api.OutputRouter(), continuous_api.BackgroundThreadStatus(),
            torch.device("cpu"), torch.float32, scheduler, helper,
        )  # fmt: skip
    finally:
        offloading_manager.torch = torch
    runner: Any = FakeRunner(proc.inputs_and_outputs)
    proc.model_runner = runner
    return proc


def add(proc: Any, request_id: str, prompt_len: int, max_new_tokens: int) -> None:
    state = RequestState(
        request_id=request_id,
        initial_tokens=list(range(1, prompt_len + 1)),
        max_new_tokens=max_new_tokens,
    )
    proc.input_queue.put(state)


def step(proc: Any) -> list[str]:
    """One iteration of the manager's loop; the ids of the batch it ran ([] if none)."""
    if not proc.prepare_next_batch():
        return []
    batch = [f.state.request_id for f in proc.inputs_and_outputs.requests_in_batch]
    proc._generation_step(None)
    proc.update_batch()
    return batch


def frozen_after_cancel() -> None:
    proc = processor(num_blocks=6, budget=8)
    add(proc, "a", 8, 8)
    add(proc, "b", 6, 8)
    add(proc, "c", 10, 6)
    for _ in range(5):  # at the fifth step "b" is offloaded (soft reset) to let "a" decode
        step(proc)
    sched = proc.scheduler
    assert list(sched.waiting_requests_order) == ["b"] and sched.block_new_requests, "setup"
    proc.cancel_queue.put("a")  # the client of every running request goes away
    proc.cancel_queue.put("c")
    ran = [step(proc) for _ in range(50)]
    if proc.has_pending_requests() and not any(ran):
        raise AssertionError(
            "request 'b', requeued by an offload, is never scheduled again: its running "
            "requests were cancelled, block_new_requests stays True (only a request that "
            "finishes clears it, continuous_api.py:567-569), so schedule_batch takes no "
            "waiting request (scheduler.py:330-331) and 50 prepare_next_batch calls in a "
            "row ran nothing while has_pending_requests() is True"
        )


def cpu_pool_pop() -> None:
    proc = processor(num_blocks=3, budget=5, cpu_blocks=1)
    arrivals = {1: [("r2", 8, 5)], 2: [("r0", 6, 5), ("r1", 3, 3)]}
    for k in range(12):
        for request in arrivals.get(k, []):
            add(proc, *request)
        try:
            step(proc)
        except ValueError as e:
            raise AssertionError(
                f"step {k}: prepare_next_batch raised ValueError({e!s}) offloading a "
                "request of 2 blocks into a CPU pool of 1 sector: _reserve_cpu_blocks "
                "counted the one free block of an allocated sector, then "
                "try_to_free_sectors gave that sector back, so it took 1 block for 2 "
                "(offloading_manager.py:321-343); a victim that does not fit the CPU pool "
                "should be soft reset"
            ) from e


def oversize_request() -> None:
    proc = processor(num_blocks=2, budget=16)  # 8 token slots
    add(proc, "small", 3, 2)
    add(proc, "big", 7, 4)  # 7 + 4 - 1 = 10 tokens to cache: it can never fit
    try:
        for _ in range(10):
            step(proc)
    except RuntimeError as e:
        raise AssertionError(
            f"a request that can never fit 2 blocks of {PAGE} was accepted, and then "
            f"prepare_next_batch raised RuntimeError({e!s}), which ends the generation "
            "loop for every request (continuous_api.py:506-509, 1134-1136); nothing "
            "refuses it when it is added"
        ) from e


SCENARIOS = {
    "frozen-after-cancel": frozen_after_cancel,
    "cpu-pool-pop": cpu_pool_pop,
    "oversize-request": oversize_request,
}


def main(names: list[str]) -> int:
    failed = 0
    for name in names or list(SCENARIOS):
        try:
            SCENARIOS[name]()
            print(f"{name}: ok")
        except AssertionError as e:
            failed += 1
            print(f"{name}: FAILED: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
