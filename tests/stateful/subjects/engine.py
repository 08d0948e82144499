"""The spec against the whole ``impl.LLMEngine`` with the tiny Llama in float64.

One model object is shared by every example (built once per process); each example
builds a fresh engine around it. The engine's sampled tokens are fed to the spec's
phase D, so the spec checks every scheduling decision and the full plan; the token
*values* are checked against solo runs: every sampled token online (the token at
output index ``k`` must be the solo run's ``k``-th), and every final output in the
teardown (aborted ones must be a prefix). Solo = the request alone in a fresh engine
with ample blocks, memoised by ``(prompt, params)``. In float64 the model is
batch-invariant to the bit, so any difference is a scheduling or KV bug (lost tokens
after preemption, a wrong swap copy, a block reused while live, a rollback that did
not restore the K/V it should). With prefix caching a hit attends over K/V another
request wrote, so a stale key changes a token.

Metrics: each step's counters against its plan (``metrics_match_plans``), and once
drained every metric against its recomputation from the spec's trace (``metric_<name>``,
tests/oracles/metrics.py).

Faults: the next forward raises (before, or after it wrote K/V into the cache), or the
next swap-out / swap-in copy raises. The engine must roll the step back: ``observe()``,
the metrics and the live (and cached) K/V unchanged, the spec not advanced; the next
step retries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, Final, TypeVar

import torch

from impl import LLMEngine
from impl.block_manager import cdiv
from impl.ngram_proposer import NgramProposer
from impl.scheduler_output import SchedulerOutput
from kvsched.peers.lockstep import Advance, Lockstep
from kvsched.peers.ours import EngineAdapter
from model import LlamaForCausalLM, build_tiny_model
from spec.oracle import Drafter, HashOracle
from spec.types import PreemptionMode, SamplingParams, SchedulerConfig, Semantics
from tests.oracles.metrics import MetricTrace, TraceStep, engine_mismatches
from tests.stateful.coverage import PREFIX_REQUIRED_EVENTS, REQUIRED_EVENTS, VLLM_V0_EVENTS
from tests.stateful.events import ASYNC_EVENTS, SPEC_EVENTS
from tests.stateful.failures import InjectedFault, fail, require
from tests.stateful.sizes import Size, Sizes
from tests.stateful.strategies import WITHOUT_VLLM_V0, engine_configs, profile_configs
from tests.stateful.subject import Note, Side, Subject
from tests.stateful.subjects import OURS
from tests.stateful.subjects.peer import speculative_config

VOCAB = 256  # the tiny model's vocabulary (checked in EngineSide)
T = TypeVar("T")

_MODEL: list[LlamaForCausalLM] = []
#: (prompt, temperature, seed) -> the longest free run (no EOS) computed so far.
_SOLO: dict[tuple[tuple[int, ...], float, int | None], tuple[int, ...]] = {}


def tiny_model() -> LlamaForCausalLM:
    """The tiny Llama in float64, built once per process and shared by every engine."""
    if not _MODEL:
        _MODEL.append(build_tiny_model(seed=0, dtype=torch.float64, device="cpu"))
    return _MODEL[0]


def solo_outputs(prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
    """The request alone in a fresh engine with ample blocks and budget.

    A token depends on the prefix, the temperature, the seed and its output index only
    (the sampler's inputs), not on ``max_tokens`` or EOS, which only end the run: so one
    free run (EOS ignored) per prompt, temperature and seed, as long as the longest
    asked for, serves every request with them, cut at its ``max_tokens`` and after its
    EOS. (Memoising by the whole parameters ran about twice as many solo runs: a
    request's EOS is picked among the outputs of its run without one.)
    """
    key = (prompt, params.temperature, params.seed)
    free = _SOLO.get(key, ())
    if len(free) < params.max_tokens:
        need = len(prompt) + params.max_tokens
        config = SchedulerConfig(
            num_gpu_blocks=cdiv(need, 16) + 1,
            block_size=16,
            max_num_batched_tokens=max(need, 256),
        )
        engine = LLMEngine(config, model=tiny_model())
        run = SamplingParams(
            max_tokens=params.max_tokens,
            ignore_eos=True,
            temperature=params.temperature,
            seed=params.seed,
        )
        (result,) = engine.generate([("solo", list(prompt), run)])
        assert result.num_preemptions == 0
        free = _SOLO[key] = result.output_token_ids
    outputs = free[: params.max_tokens]
    eos = None if params.ignore_eos else params.eos_token_id
    if eos in outputs:
        outputs = outputs[: outputs.index(eos) + 1]
    return outputs


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread: the forwards are tiny, and extra threads only spin (and the
    model is batch-invariant at any thread count, model/plan.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def overwrote_victim_blocks(out: SchedulerOutput, block_size: int) -> bool:
    """Whether a chunk of this step writes into a GPU block that a victim of this step
    gave up (the blocks a failed step's rollback must restore)."""
    given_up = {block for record in out.preempted for block in record.gpu_blocks}
    return any(
        block in given_up
        for seq in out.scheduled
        for block in seq.block_table[cdiv(seq.num_computed, block_size) :]
    )


def metrics_without_time(engine: LLMEngine) -> dict[str, Any]:
    values = asdict(engine.metrics)
    del values["step_time_s"]
    return values


class GreedyRunDrafter:
    """Drafts the tiny model's own greedy continuation of a request's tokens, the draft
    at ``len(tokens) % (k + 2)`` made wrong: as its tokens grow, a request meets every
    verify outcome (no draft accepted, some, every one) and a stop inside an accepted
    run. Prompt lookup on the tiny model does not reach the middle ones: where the
    random model loops, lookup continues the loop and every draft is right; elsewhere
    its first draft is wrong.

    The continuation is the greedy solo run of a prompt ``learn`` was given, where the
    tokens follow it; in float64 greedy decoding is a function of the prefix, so every
    such prompt gives the same one. Where none does (a request sampled at temperature
    > 0 that left its prompt's greedy run), no drafts. One function of the tokens for
    both sides: the spec calls it, the engine its ``propose``.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        #: prompt -> the longest greedy solo run learnt for it (EOS ignored)
        self.runs: dict[tuple[int, ...], tuple[int, ...]] = {}

    def learn(self, prompt: tuple[int, ...], run: tuple[int, ...]) -> None:
        self.runs[prompt] = max(self.runs.get(prompt, ()), run, key=len)

    def continuation(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        for prompt, run in self.runs.items():
            n = len(prompt)
            if tokens[:n] == prompt and run[: len(tokens) - n] == tokens[n:]:
                return run[len(tokens) - n :]
        return ()

    def __call__(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        drafts = list(self.continuation(tokens)[: self.k])
        wrong = len(tokens) % (self.k + 2)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % VOCAB
        return tuple(drafts)

    def propose(self, token_ids: list[int]) -> list[int]:
        return list(self(tuple(token_ids)))


def example_drafters(
    config: SchedulerConfig,
) -> tuple[NgramProposer | GreedyRunDrafter | None, Drafter | None]:
    """The engine's drafter and the spec's for an example with speculative decoding: on
    an odd budget the engine's own prompt lookup and the spec's restatement of it
    (``PromptLookupDrafter``, lookup of 1 to 1-3 tokens from the config, as the other
    machines), else one ``GreedyRunDrafter`` for both (so a shrunk example keeps its
    choice). Without: neither."""
    lookup = speculative_config(config)
    if lookup is None:
        return None, None
    if config.max_num_batched_tokens % 2 == 0:
        greedy = GreedyRunDrafter(lookup.num_speculative_tokens)
        return greedy, greedy
    proposer = NgramProposer(
        num_speculative_tokens=lookup.num_speculative_tokens,
        prompt_lookup_min=lookup.prompt_lookup_min,
        prompt_lookup_max=lookup.prompt_lookup_max,
        max_model_len=lookup.max_model_len,
    )
    return proposer, lookup


class EngineSide(Side):
    def __init__(self, config: SchedulerConfig, note: Note) -> None:
        """The model samples (the oracle goes unused); its tokens are the spec's. Under
        speculative decoding each side drafts with the example's drafter
        (``example_drafters``)."""
        drafter, spec_drafter = example_drafters(config)
        self.greedy = drafter if isinstance(drafter, GreedyRunDrafter) else None
        engine = LLMEngine(config, model=tiny_model(), drafter=drafter)
        assert engine.model.config.vocab_size == VOCAB
        self.engine = engine
        self.config = config
        self.note = note
        # Armed faults: kind -> only in a step that preempts; each fires once.
        self.armed: dict[str, bool] = {}
        self.preemptions_by_mode: Counter[PreemptionMode] = Counter()
        self.num_sampled = 0
        self.metric_trace = MetricTrace(config)
        runner, cache = engine.model_runner, engine.cache_engine
        execute, verify = runner.execute, runner.verify
        swap_out, swap_in = cache.swap_out, cache.swap_in

        def armed(kind: str, preempting: bool) -> bool:
            return kind in self.armed and (preempting or not self.armed[kind])

        def faulty(forward: Callable[[SchedulerOutput], T]) -> Callable[[SchedulerOutput], T]:
            def run(out: SchedulerOutput) -> T:
                if armed("forward", bool(out.preempted)):
                    self.fire("forward")
                tokens = forward(out)
                if armed("forward after KV write", bool(out.preempted)):
                    if overwrote_victim_blocks(out, config.block_size):
                        note("fault: after the forward wrote into blocks a victim gave up")
                    self.fire("forward after KV write")
                return tokens

            return run

        def faulty_swap_out(mapping: Sequence[tuple[int, int]]) -> None:
            if mapping and armed("swap-out copy", True):  # a swap-out always preempts
                self.fire("swap-out copy")
            swap_out(mapping)

        def faulty_swap_in(mapping: Sequence[tuple[int, int]]) -> None:
            swap_in(mapping)  # the copy lands in fresh blocks, then fails
            if mapping and armed("swap-in copy", True):  # never in a preempting step (R7)
                self.fire("swap-in copy")

        runner.execute = faulty(execute)  # type: ignore[method-assign, assignment]
        runner.verify = faulty(verify)  # type: ignore[method-assign, assignment]
        cache.swap_out = faulty_swap_out  # type: ignore[method-assign]
        cache.swap_in = faulty_swap_in  # type: ignore[method-assign]
        oracle = HashOracle(vocab_size=VOCAB)
        lock = Lockstep(
            EngineAdapter(engine), config, oracle, vocab_size=VOCAB, drafter=spec_drafter
        )
        super().__init__(lock, scheduler=engine.scheduler)

    def added(self, prompt: tuple[int, ...], params: SamplingParams) -> None:
        """A greedy request's solo run, ``K`` tokens past ``max_tokens``, for the
        ``GreedyRunDrafter`` (the machine's solo check reads the same memo)."""
        greedy = self.greedy
        if greedy is not None and params.temperature == 0:
            run = replace(params, max_tokens=params.max_tokens + greedy.k, ignore_eos=True)
            greedy.learn(prompt, self.solo(prompt, run))

    def solo_holds(self, params: SamplingParams) -> bool:
        """Not under speculative decoding at temperature > 0: rejection sampling draws
        each token as without drafts, but not the same draw (model/rejection_sampler.py
        tests the distributions)."""
        return not (self.config.num_speculative_tokens and params.temperature > 0)

    def fire(self, kind: str) -> None:
        del self.armed[kind]
        self.note(f"fault: {kind}")
        if self.config.async_scheduling:  # in the worker, found by a later step()
            self.note(ASYNC_FAULT_EVENT)
        raise InjectedFault(kind)

    def arm_fault(self, kind: str, when_preempting: bool) -> None:
        # Async scheduling: armed once the forward in flight has run, so that the fault
        # fires in the next one submitted whatever the worker's timing (the machine's
        # draws must not depend on it).
        self.engine.synchronize()
        self.armed[kind] = when_preempting

    def solo(self, prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
        return solo_outputs(prompt, params)

    def faults_armed(self) -> bool:
        """A fault armed, or (async scheduling) fired in a forward in flight: the next
        step may raise it."""
        engine = self.engine
        engine.synchronize()
        return bool(self.armed) or any(f.exception() is not None for f in engine.forwards)

    def fault_snapshot(self) -> dict[str, object]:
        # Async scheduling: the forward in flight writes K/V meanwhile; read after it.
        self.engine.synchronize()
        snapshot: dict[str, object] = {
            "fault_keeps_metrics": metrics_without_time(self.engine),
            "fault_restores_kv": self.live_kv(),
        }
        if self.config.enable_prefix_caching:
            # A rollback gives reclaimed blocks their keys back, so the failed forward
            # must not have changed what they hold.
            snapshot["fault_restores_cached_kv"] = self.cached_kv()
        return snapshot

    def kv_of(self, on_gpu: bool, slots: list[int]) -> bytes:
        """The K/V of ``slots`` of one pool, as bytes."""
        cache = self.engine.cache_engine
        pool = cache.gpu_cache if on_gpu else cache.cpu_cache
        if pool is None or not slots:
            return b""
        index = torch.tensor(slots, dtype=torch.long)
        return b"".join(
            tensor.view(pool.num_layers, pool.num_slots, -1)
            .index_select(1, index)
            .numpy()
            .tobytes()
            for tensor in (pool.key, pool.value)
        )

    def live_kv(self) -> bytes:
        """The K/V of every live request's computed positions (GPU for running, CPU for
        swapped): a rolled-back step must leave them bit for bit as they were, whatever
        the failed forward wrote into blocks its victims gave up."""
        scheduler = self.engine.scheduler
        bs = self.config.block_size

        def slots(tables: Iterable[tuple[Sequence[int], int]]) -> list[int]:
            return [table[p // bs] * bs + p % bs for table, n in tables for p in range(n)]

        # Under async scheduling a step in flight's positions are computed but not yet
        # written (or being written): only the positions before them are live.
        running = [
            (s.block_table, s.num_computed - s.num_in_flight_tokens) for s in scheduler.running
        ]
        swapped = [(s.cpu_block_table, s.num_computed) for s in scheduler.swapped]
        return self.kv_of(True, slots(running)) + self.kv_of(False, slots(swapped))

    def cached_kv(self) -> bytes:
        """The K/V of every block the prefix cache holds a key for."""
        state = self.engine.observe()
        assert state.prefix_cache is not None
        bs = self.config.block_size
        blocks = sorted(block for _, block in state.prefix_cache.cached)
        return self.kv_of(True, [block * bs + i for block in blocks for i in range(bs)])

    def after_step(self, advance: Advance) -> None:
        mid, plan = advance.mid, advance.plan
        # Async scheduling: a stale output is delivered to a waiting victim.
        by_id = {request.request_id: request for request in (*mid.running, *mid.waiting)}
        delivered: Counter[str] = Counter()  # speculative decoding: a run of tokens
        for sampled in plan.sampled:
            request = by_id[sampled.request_id]
            k = len(request.output_token_ids) + delivered[sampled.request_id]
            delivered[sampled.request_id] += 1
            params = request.request.params
            if not self.solo_holds(params):
                self.note(SAMPLED_WITH_DRAFTS_EVENT)
                continue
            solo = self.solo(request.request.prompt_token_ids, params)
            if not (k < len(solo) and solo[k] == sampled.token_id):
                fail(
                    "sampled_tokens_match_solo",
                    f"step {plan.step}: {sampled.request_id!r} sampled {sampled.token_id} as "
                    f"output {k} ({request.num_preemptions} preemptions); alone: {solo}",
                )
        self.preemptions_by_mode.update(p.mode for p in plan.preempted)
        self.num_sampled += len(plan.sampled)
        metrics = self.engine.metrics
        require(
            metrics.steps == plan.step + 1
            and all(metrics.preemptions[m] == self.preemptions_by_mode[m] for m in PreemptionMode)
            and metrics.generated_tokens == self.num_sampled,
            "metrics_match_plans",
            lambda: (
                f"metrics {metrics} after step {plan.step}, plans preempted "
                f"{dict(self.preemptions_by_mode)} and sampled {self.num_sampled}"
            ),
        )
        self.metric_trace.add(TraceStep(advance.before, mid, plan))

    def check_drained(self) -> None:
        """Every metric against its recomputation from the spec's trace, each failing
        as ``metric_<name>`` (tests/oracles/metrics.py): the figures ``kvsched run``
        reports, under every preemption mode and with caching."""
        for invariant, message in engine_mismatches(self.metric_trace, self.engine.metrics):
            fail(invariant, message)


@dataclass(frozen=True, kw_only=True)
class Engine(Subject):
    def start(self, config: SchedulerConfig, note: Note) -> Side:
        return EngineSide(config, note)


#: Speculative decoding at temperature > 0: the outputs are not compared with the solo
#: run's token for token (the equality is in distribution).
SAMPLED_WITH_DRAFTS_EVENT: Final = "speculative decoding: a token sampled at temperature > 0"

#: Async scheduling: a fault in a forward run by the engine's worker thread, which the
#: next ``step()`` that waits for it must roll back with that step still in flight.
ASYNC_FAULT_EVENT: Final = "fault: in a forward in flight (async scheduling)"

#: Only the engine has K/V to restore: a fault after a forward that wrote into blocks its
#: step's victims gave up (the case ``fault_restores_kv`` exists for).
OVERWRITE_EVENT: Final = "fault: after the forward wrote into blocks a victim gave up"

#: The engine draws every profile but vllm-v0, whose rules only change decisions that
#: the same ``impl.Scheduler`` code makes under the scheduler subject (2,000 examples,
#: every vllm-v0 event required there): a sixth of the engine's 400 examples for it left
#: ``preempt: restart`` and vllm-v1's full-sequence gate unreached.
#: Scheduling decisions of the same ``impl.Scheduler`` code that the engine's ~70
#: vllm-v1 examples reach on some streams and not others (2026-12-03, ci streams 0, 1
#: and 2: the gate held a request back 0, 974 and 0 times; 7 before the long-prefill
#: cap was drawn; a prompt chunked with chunked prefill off 7 and 0 times on streams 0
#: and 2, the adaptive floor 244 and 0); the scheduler subject requires them.
VLLM_V1_STREAM_DEPENDENT: Final = frozenset(
    {
        "vllm-v1/full-sequence-admission: the gate held a request back",
        "vllm-v1/long-prefill-cap: a prompt chunked with chunked prefill off",
        "vllm-v1/long-prefill-cap: the adaptive floor raised the cap",
    }
)

#: nano-vllm decisions of the same ``impl.Scheduler`` code that the engine's ~50 nano-vllm
#: examples reach on some streams and not others (2026-12-04, with speculative decoding
#: drawn: 47 nano-vllm examples, none of the three); the scheduler subject and nano-vllm's
#: own machine require them.
NANO_VLLM_STREAM_DEPENDENT: Final = frozenset(
    {
        "nano-vllm/decode-unbudgeted: a decode step over the token budget",
        "nano-vllm/seq-limit-per-step: more than max_num_seqs running",
        "nano-vllm/victim-next: a victim lifo would not have chosen",
    }
)

#: The speculative examples of ``ENGINE`` are ~30 of 400 (none of the mutation check's
#: 200), too few to reach each verify outcome on every stream (2026-12-07: some drafts
#: accepted 144 times on the ci stream, 0 on seed 1's); ``SPECULATIVE_ENGINE`` draws
#: nothing else and requires them all.
SPECULATIVE_CONFIG_EVENT: Final = "config: speculative decoding"

ENGINE = Engine(
    name="engine",
    machine="EngineDifferential",
    caps=OURS,
    configs=engine_configs(WITHOUT_VLLM_V0, async_scheduling=True, speculative=True),
    sizes=Sizes(
        ci=Size(400, 50),
        dev=Size(15, 25),
        nightly=Size(6_000, 60, targeting=True),
        mutation=Size(200, 30),
    ),
    required=(
        REQUIRED_EVENTS
        | {OVERWRITE_EVENT, ASYNC_FAULT_EVENT, SPECULATIVE_CONFIG_EVENT}
        | ASYNC_EVENTS
    )
    - VLLM_V0_EVENTS
    - VLLM_V1_STREAM_DEPENDENT
    - NANO_VLLM_STREAM_DEPENDENT,
    vocab=VOCAB,
)

#: vllm-v1 with speculative decoding in every example: the engine's verify forward,
#: drafts from ``example_drafters`` (the greedy continuation on even budgets, so that
#: every verify outcome and a stop inside an accepted run come on each stream; prompt
#: lookup on odd ones), greedy outputs checked token for token against runs without
#: drafts, faults in the verify forward rolled back.
SPECULATIVE_ENGINE = Engine(
    name="speculative-engine",
    machine="SpeculativeEngineDifferential",
    caps=OURS,
    configs=profile_configs(Semantics.VLLM_V1, only_speculative=True),
    sizes=Sizes(
        ci=Size(150, 50),
        dev=Size(10, 25),
        nightly=Size(3_000, 60, targeting=True),
        mutation=Size(100, 30),
    ),
    required=SPEC_EVENTS
    | {
        "fault: forward",
        "fault: forward after KV write",
        "fault: in a step that preempted",
        "preempt: recompute",
        "finish: stop",
        "finish: length",
        "vllm-v1/max-model-len: length at max_model_len",
    },
    vocab=VOCAB,
)

#: Prefix caching on, under kvsched and nano-vllm, half the examples each: no vllm-v1,
#: whose caching decisions are the scheduler subject's to check (the same impl.Scheduler
#: code decides here; with a third of the examples nano-vllm's decode-unbudgeted went
#: unreached).
PREFIX_ENGINE_SEMANTICS: Final = (Semantics.KVSCHED, Semantics.NANO_VLLM)

#: A scheduling decision of the same ``impl.Scheduler`` code, required of the prefix
#: scheduler subject (1,000 examples) and of nano-vllm's own machine: with ~75 nano-vllm
#: examples here (a budget below the decodes of a step, with caching on) it is reached
#: on some streams and not others (2026-12-02: 42 times on one, 0 on the next).
DECODE_UNBUDGETED: Final = "nano-vllm/decode-unbudgeted: a decode step over the token budget"

PREFIX_ENGINE = Engine(
    name="prefix-engine",
    machine="PrefixEngineDifferential",
    caps=replace(OURS, swap=False, caching=True),
    configs=engine_configs(PREFIX_ENGINE_SEMANTICS, prefix_caching=True),
    sizes=Sizes(
        ci=Size(150, 40),
        dev=Size(15, 25),
        nightly=Size(2_000, 60, targeting=True),
        mutation=Size(100, 30),
    ),
    required=frozenset(
        e
        for e in PREFIX_REQUIRED_EVENTS | {OVERWRITE_EVENT}
        if not e.startswith(("vllm-v1/", "config: semantics=vllm-v1")) and e != DECODE_UNBUDGETED
    ),
    vocab=VOCAB,
)
