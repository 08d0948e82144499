"""``impl.Scheduler`` with drafts in lockstep with the spec on random vllm-v1 workloads.

Small pools (preemption beside drafts), prefix caching on half the configs, ``lifo`` and
``priority``, a long-prefill cap on some, and two drafters on both sides: prompt lookup
(``PromptLookupDrafter``) and the oracle's own tokens right up to a point
(``OracleDrafter``: runs accepted whole, in part and not at all). The scheduler machine
(tests/stateful) draws the same; this fixed set of workloads takes every case it needs
on every run, a victim holding drafts among them.
"""

from __future__ import annotations

import random

import pytest

from kvsched.peers.lockstep import Diverged, Lockstep
from kvsched.peers.ours import SchedulerAdapter
from spec.oracle import Drafter, HashOracle, OracleDrafter, PromptLookupDrafter
from spec.types import ConfigError, SamplingParams, SchedulerConfig, Semantics

VOCAB = 8
ORACLE = HashOracle(vocab_size=VOCAB, salt=3)


def _config(rng: random.Random) -> SchedulerConfig | None:
    block_size = rng.choice([1, 2, 4])
    blocks = rng.randint(3, 20)
    drafts = rng.randint(1, 4)
    try:
        return SchedulerConfig(
            num_gpu_blocks=blocks,
            block_size=block_size,
            max_num_batched_tokens=rng.randint(1, 24),
            max_num_seqs=rng.randint(1, 4),
            semantics=Semantics.VLLM_V1,
            max_model_len=rng.randint(2, blocks * block_size),
            num_speculative_tokens=drafts,
            enable_prefix_caching=rng.random() < 0.5,
            enable_chunked_prefill=rng.random() < 0.7,
            policy=rng.choice(["lifo", "priority"]),
            long_prefill_token_threshold=rng.choice([0, 0, rng.randint(1 + drafts, 9 + drafts)]),
        )
    except ConfigError:  # a draw vllm-v1 refuses (a budget below 1 + K, say)
        return None


def _drafter(rng: random.Random, config: SchedulerConfig) -> Drafter:
    k = config.num_speculative_tokens
    if rng.random() < 0.5:
        return PromptLookupDrafter(k, 1, rng.randint(1, 3), config.max_model_len)
    return OracleDrafter(ORACLE, k, rng.randint(0, k + 1))


def test_the_scheduler_agrees_with_the_spec_with_drafts() -> None:
    drafted = accepted = victims_with_drafts = padded = 0
    for seed in range(250):
        rng = random.Random(seed)
        config = _config(rng)
        if config is None:
            continue
        drafter = _drafter(rng, config)
        peer = SchedulerAdapter(config, vocab_size=VOCAB, drafter=drafter)
        lock = Lockstep(peer, config, ORACLE, vocab_size=VOCAB, drafter=drafter)
        assert config.max_model_len is not None
        arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
        for i in range(rng.randint(1, 8)):
            pattern = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
            prompt = (pattern * 5)[: rng.randint(1, max(1, config.max_model_len - 1))]
            params = SamplingParams(max_tokens=rng.randint(1, 12), priority=rng.randint(0, 2))
            arrivals.setdefault(rng.randint(0, 5), []).append((f"r{i}", prompt, params))
        for step in range(400):
            for request in arrivals.get(step, []):
                lock.add(*request)
            if step > max(arrivals) and not lock.unfinished():
                break
            before = lock.state
            advance = lock.advance()
            held = {r.request_id: r.spec_token_ids for r in before.running}
            victims_with_drafts += sum(bool(held[p.request_id]) for p in advance.plan.preempted)
            padded += any(-1 in r.spec_token_ids for r in advance.mid.running)
        else:
            raise AssertionError(f"seed {seed}: not drained in 400 steps: {lock.state}")
        lock.finish()
        drafted += lock.drafts
        accepted += lock.accepted
    assert 0 < accepted < drafted
    assert victims_with_drafts > 0 and padded > 0


def test_a_divergence_names_the_drafts() -> None:
    """A wrong run handed to the spec is refused, naming the drafts the chunk ran (the
    lockstep's message is what a user debugging a drafter reads)."""
    config = SchedulerConfig(
        num_gpu_blocks=8,
        block_size=2,
        semantics=Semantics.VLLM_V1,
        max_model_len=16,
        num_speculative_tokens=2,
    )
    drafter = OracleDrafter(ORACLE, 2, 2)  # every draft right
    wrong = OracleDrafter(ORACLE, 2, 0)  # the spec's: the first is wrong
    peer = SchedulerAdapter(config, vocab_size=VOCAB, drafter=drafter)
    lock = Lockstep(peer, config, ORACLE, vocab_size=VOCAB, drafter=wrong)
    lock.add("r0", [1, 2, 3], SamplingParams(max_tokens=8))
    with pytest.raises(Diverged, match="spec_token_ids"):
        for _ in range(8):
            lock.advance()
