#!/usr/bin/env python3
"""Reproduction for nano-vllm's scheduler (nano-vllm-fork 20260210): N2/N6 (docs/peers.md): a request R4 refuses is accepted (it never fits the pool, or its prompt, or its prompt plus outputs re-prefilled after a preemption, is longer than the budget); at the waiting head with nothing running, schedule() fails `assert scheduled_seqs`

Run it where the peer is installed; it needs nothing else (no kvsched):

    python {this file}

It replays 1 request(s) through the scheduler alone, with a deterministic
stand-in for the model, and checks after every step that schedule() never fails on a request add() accepted.
Expected on nano-vllm-fork 20260210: it prints "FAILED at step ...: <the violated property>" and exits 1;
it exits 0 ("OK") where the scheduler keeps the property.

Upstream: GeeeekExplorer/nano-vllm issue #274.

Written by `kvsched conform --emit-repro` (kvsched's docs/peers.md) from:
    kvsched conform --engine nano-vllm tests/peers/repros/no_chunked_prefill.jsonl --num-gpu-blocks 8 --block-size 4 --max-num-batched-tokens 4 --no-enable-chunked-prefill --emit-repro docs/repros/n2_n6_never_scheduled.py
"""

import sys
from pathlib import Path

CHECK = 'no-raise'
NO_RAISE_WHY = "the scheduler accepted a request it can never schedule (it does not fit the pool, or it is longer than one step's budget, with no chunked prefill)"
REFERENCE = "kvsched's spec, profile nano-vllm (docs/semantics.md)"
VOCAB = 256
SALT = 0
MAX_STEPS = 1010
CONFIG = {"num_gpu_blocks": 8, "block_size": 4, "max_num_batched_tokens": 4, "max_num_seqs": 256, "eos": -1}
REQUESTS = [{"id": "r0", "prompt": [201, 2, 3, 4, 5], "max_tokens": 1, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 0}]
EXPECTED = []


# --- nano-vllm's scheduler (nano-vllm-fork), driven as its LLMEngine.step drives it ------

import importlib
import importlib.util
import types
from pathlib import Path

# nanovllm/__init__.py imports the CUDA engine (triton, flash-attn): load the scheduler's
# modules with the package's __init__ bypassed.
_found = importlib.util.find_spec("nanovllm")
_package = types.ModuleType("nanovllm")
_package.__path__ = list(_found.submodule_search_locations)
_package.__file__ = str(Path(_package.__path__[0]) / "__init__.py")
_package.__spec__ = _found
sys.modules["nanovllm"] = _package
Scheduler = importlib.import_module("nanovllm.engine.scheduler").Scheduler
Sequence = importlib.import_module("nanovllm.engine.sequence").Sequence
SamplingParams = importlib.import_module("nanovllm.sampling_params").SamplingParams


class Record:
    def __init__(self, scheduled, preempted):
        self.scheduled = scheduled  # (request id, first position, tokens) in batch order
        self.preempted = preempted
        self.hit_unwritten = []


class Peer:
    """The scheduler reads five config fields; Sequence.block_size is a class attribute
    its block manager relies on."""

    def __init__(self, c):
        Sequence.block_size = c["block_size"]
        self.scheduler = Scheduler(
            types.SimpleNamespace(
                max_num_seqs=c["max_num_seqs"],
                max_num_batched_tokens=c["max_num_batched_tokens"],
                eos=c["eos"],
                num_kvcache_blocks=c["num_gpu_blocks"],
                kvcache_block_size=c["block_size"],
            )
        )
        self.ids = {}

    def add(self, r):
        seq = Sequence(
            list(r["prompt"]),
            SamplingParams(temperature=1.0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]),
        )
        self.ids[seq.seq_id] = r["id"]
        self.scheduler.add(seq)

    def step(self, next_token):
        s = self.scheduler
        running_before = {id(q) for q in s.running}
        waiting_before = list(s.waiting)
        seqs, is_prefill = s.schedule()
        victims = [q for q in s.waiting if id(q) in running_before and q not in waiting_before]
        scheduled = [
            (self.ids[q.seq_id], q.num_cached_tokens, len(q) - q.num_cached_tokens)
            if is_prefill
            else (self.ids[q.seq_id], len(q) - 1, 1)
            for q in seqs
        ]
        record = Record(scheduled, [self.ids[q.seq_id] for q in reversed(victims)])
        if CHECK == "zero-token-prefill" and any(n == 0 for _, _, n in scheduled):
            return record  # the model runner could not run this batch
        s.postprocess(seqs, [next_token(tuple(q.token_ids)) for q in seqs])
        return record

    def has_unfinished(self):
        return not self.scheduler.is_finished()

    def free_gpu_blocks(self):
        return len(self.scheduler.block_manager.free_block_ids)

    def queues(self):
        s = self.scheduler
        return [self.ids[q.seq_id] for q in s.waiting], [self.ids[q.seq_id] for q in s.running]


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
