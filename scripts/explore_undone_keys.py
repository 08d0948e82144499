"""Random spec runs under vllm-v1 with ``priority`` and prefix caching: do keys given to
the blocks of an undone chunk outlive their step? (docs/peers.md, V11)

vLLM keys the blocks a chunk fills when it schedules the chunk; when
vllm-v1/priority-victim-any-running then undoes the chunk, the forward never writes its
K/V but the keys stay. The spec drops them (vllm-v1/undone-chunk-unkeyed), so here every
count of a stale key must be 0; it was written when the spec still kept them (and found
0 on these workloads too: the bug needs the requester to preempt itself right after the
undo, tests/peers/repros/undone_chunk_keys.jsonl). This counts, over random workloads, the
undone chunks, the keys given in a step to blocks no chunk of the final plan wrote that
are still cached after the step's decisions and after the step, and the admissions that
hit such a block::

    python scripts/explore_undone_keys.py --runs 3000

Exploration, not a test: it prints what it found.
"""

from __future__ import annotations

import argparse
import contextlib
import random

import spec
from spec.kv import cdiv
from spec.oracle import HashOracle
from spec.scheduler import StepDraft, schedule_running
from spec.types import InvalidRequestError, SamplingParams, SchedulerConfig, Semantics

Arrival = tuple[int, str, tuple[int, ...], SamplingParams]  # step, id, prompt, params


def draw(rng: random.Random) -> tuple[SchedulerConfig, list[Arrival]]:
    config = SchedulerConfig(
        num_gpu_blocks=rng.randint(4, 40),
        block_size=rng.choice([1, 1, 2, 4]),
        max_num_batched_tokens=rng.randint(6, 32),
        max_num_seqs=6,
        enable_prefix_caching=True,
        semantics=Semantics.VLLM_V1,
        policy="priority",
    )
    assert config.max_model_len is not None
    requests = []
    for i in range(rng.randint(3, 9)):
        # Three token values: prompts share prefixes often.
        prompt = tuple(rng.randrange(3) for _ in range(rng.randint(1, config.max_model_len - 1)))
        params = SamplingParams(
            max_tokens=rng.randint(1, 16), priority=rng.randint(0, 2), ignore_eos=True
        )
        requests.append((rng.randint(0, 12), f"r{i}", prompt, params))
    return config, sorted(requests, key=lambda r: r[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    oracle = HashOracle(vocab_size=3)
    undone = keying = unwritten = surviving = hits = 0
    for k in range(args.runs):
        config, requests = draw(random.Random(args.seed + k))
        bs = config.block_size
        state = spec.init_state(config)
        stale: set[int] = set()
        while requests or spec.has_unfinished_requests(state):
            while requests and requests[0][0] <= state.num_steps:
                _, request_id, prompt, params = requests.pop(0)
                with contextlib.suppress(InvalidRequestError):
                    state = spec.add_request(state, request_id, prompt, params)
            budget = config.max_num_batched_tokens
            victims = schedule_running(StepDraft(state=state, budget=budget)).undone
            undone += len(victims)
            # A victim scheduled before the request that needed blocks was not cut by
            # the budget: its chunk was the rest of its tokens, and it keyed the blocks
            # that rest filled.
            running = {r.request_id: r for r in state.running}
            keying += sum(
                running[v].num_tokens // bs > running[v].num_computed_tokens // bs for v in victims
            )
            mid, plan = spec.schedule(state)
            assert state.prefix_cache is not None and mid.prefix_cache is not None
            held = {r.request_id: r.block_ids for r in mid.running}
            waiting = {r.request_id for r in state.waiting}
            written: set[int] = set()
            for chunk in plan.scheduled:
                ids = held[chunk.request_id]
                if chunk.request_id in waiting and set(ids[: chunk.start // bs]) & stale:
                    hits += 1
                last = cdiv(chunk.start + chunk.num_tokens, bs)
                written.update(ids[chunk.start // bs : last])
            keyed_before = {block for _, block in state.prefix_cache.cached}
            new = {block for _, block in mid.prefix_cache.cached} - keyed_before
            state, _ = spec.step(state, oracle)
            assert state.prefix_cache is not None
            keyed = {block for _, block in state.prefix_cache.cached}
            unwritten += len(new - written)
            surviving += len((new - written) & keyed)
            stale = ((stale - written) | (new - written)) & keyed
    print(
        f"{args.runs} runs: {undone} undone chunks, {keying} of them keyed a block; "
        f"{unwritten} keys on blocks no forward wrote were left after the step's decisions, "
        f"{surviving} outlived the step, {hits} admissions hit one"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
