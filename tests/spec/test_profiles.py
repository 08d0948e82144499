"""The semantics profiles' config constraints and rules (docs/semantics.md, "Semantics
profiles"), on small hand-made states; the stateful suite checks them at scale."""

from __future__ import annotations

from dataclasses import replace

import pytest

import spec
from spec.profiles import profile_defaults
from spec.types import ConfigError, PreemptionMode, SamplingParams, SchedulerConfig, Semantics

VLLM = Semantics.VLLM_V1
NANO = Semantics.NANO_VLLM


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"semantics": VLLM, "preemption_mode": PreemptionMode.SWAP}, "recompute only"),
        ({"semantics": VLLM, "policy": "reserve"}, "lifo .* or priority only"),
        ({"semantics": VLLM, "max_num_batched_tokens": 4, "max_num_seqs": 8}, ">= max_num_seqs"),
        ({"semantics": VLLM, "max_model_len": 65}, "does not fit the GPU cache"),
        (
            {"semantics": VLLM, "enable_chunked_prefill": False, "max_num_batched_tokens": 8,
             "max_num_seqs": 4, "max_model_len": 9},
            "must be >= max_model_len",
        ),
        ({"semantics": NANO}, "no chunked prefill"),
        ({"semantics": NANO, "enable_chunked_prefill": False, "policy": "priority"}, "lifo"),
        ({"semantics": NANO, "enable_chunked_prefill": False, "max_model_len": 8}, "vllm-v1"),
        ({"max_model_len": 8}, "vllm-v1 setting"),
        ({"semantics": "vllm-v2"}, "unknown semantics"),
    ],
)  # fmt: skip
def test_profile_constraints_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(num_gpu_blocks=16, block_size=4, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("semantics", list(Semantics))
def test_a_profile_s_defaults_meet_its_constraints(semantics: Semantics) -> None:
    """What a profile implies is a config it accepts; nano-vllm's needs both settings."""
    config = SchedulerConfig(num_gpu_blocks=4, semantics=semantics, **profile_defaults(semantics))
    assert config.semantics is semantics
    if semantics is NANO:
        assert not config.enable_chunked_prefill and config.enable_prefix_caching
        with pytest.raises(ConfigError):
            SchedulerConfig(num_gpu_blocks=4, semantics=semantics)


def test_nano_needs_blocks_of_two_tokens() -> None:
    with pytest.raises(ConfigError, match="block_size must be >= 2"):
        SchedulerConfig(
            num_gpu_blocks=16, block_size=1, enable_chunked_prefill=False, semantics=NANO
        )


def test_vllm_max_model_len_defaults_to_the_largest_allowed() -> None:
    assert SchedulerConfig(num_gpu_blocks=16, block_size=4, semantics=VLLM).max_model_len == 64
    config = SchedulerConfig(
        num_gpu_blocks=16,
        block_size=4,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        enable_chunked_prefill=False,
        semantics="vllm-v1",  # type: ignore[arg-type]  # a profile name is accepted
    )
    assert config.max_model_len == 24
    assert config.semantics is VLLM


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_max_model_len_refuses_long_prompts_and_stops_at_the_length() -> None:
    config = SchedulerConfig(num_gpu_blocks=4, block_size=2, semantics=VLLM, max_model_len=6)
    state = spec.init_state(config)
    with pytest.raises(spec.RequestTooLargeError, match="max_model_len 6"):
        spec.add_request(state, "a", (1,) * 6, _params(1))
    state = spec.add_request(state, "a", (1,) * 4, _params(100))  # kvsched would refuse it
    plans = spec.drain(state, lambda tokens: 7, 10)[1]
    finished = [f for plan in plans for f in plan.finished]
    assert [(f.finish_reason, len(f.output_token_ids)) for f in finished] == [
        (spec.FinishReason.LENGTH, 2)
    ]


def test_full_sequence_gate_holds_a_request_whose_chunk_fits() -> None:
    config = SchedulerConfig(
        num_gpu_blocks=4, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, semantics=VLLM
    )
    state = spec.add_request(spec.init_state(config), "a", (1,) * 4, _params(8))
    state = spec.add_request(state, "b", (2,) * 15, _params(1))
    _, plan = spec.schedule(state)
    assert plan.scheduled_ids == ("a",)
    kvsched = replace(
        state, config=replace(config, semantics=Semantics.KVSCHED, max_model_len=None)
    )
    _, plan = spec.schedule(kvsched)
    assert plan.scheduled_ids == ("a", "b")  # kvsched asks only for the chunk's block


def test_nano_prefill_step_does_not_decode_and_decodes_ignore_the_budget() -> None:
    config = SchedulerConfig(
        num_gpu_blocks=8,
        block_size=4,
        max_num_batched_tokens=2,
        enable_chunked_prefill=False,
        semantics=NANO,
    )
    state = spec.init_state(config)
    for rid in ("a", "b"):
        state = spec.add_request(state, rid, (1,), _params(2))
    state, plan = spec.step(state, lambda tokens: 7)
    assert plan.scheduled_ids == ("a", "b")
    state = spec.add_request(state, "c", (1,), _params(2))
    state, plan = spec.step(state, lambda tokens: 7)
    assert plan.scheduled_ids == ("c",)  # prefill-first: a and b wait
    _, plan = spec.step(state, lambda tokens: 7)
    assert plan.scheduled_ids == ("a", "b", "c")  # 3 tokens, budget 2
    assert sum(plan.num_scheduled_tokens) == 3


def test_nano_victim_is_the_next_request() -> None:
    config = SchedulerConfig(
        num_gpu_blocks=3, block_size=2, enable_chunked_prefill=False, semantics=NANO
    )
    state = spec.init_state(config)
    for i, rid in enumerate(("r0", "r1", "r2")):
        state = spec.add_request(state, rid, (200 + i, 2), _params(4))
    state, _ = spec.step(state, lambda tokens: 7)
    _, plan = spec.step(state, lambda tokens: 7)
    # r0 needs a block: the next request r1 is the victim (lifo: r2); then r2, last,
    # needs one and preempts itself.
    assert [p.request_id for p in plan.preempted] == ["r1", "r2"]
