"""Random lockstep runs of a peer against the spec, first divergences tallied by field.

The numbers in docs/peers.md ("how it was checked") come from this script::

    python scripts/explore_peers.py vllm --runs 300
    python scripts/explore_peers.py vllm --runs 300 --seed 1000 --fit
    python scripts/explore_peers.py vllm --runs 300 --seed 2000 --fit --policy priority
    python scripts/explore_peers.py nano-vllm --runs 300
    python scripts/explore_peers.py nano-vllm --runs 400 --seed 3000 --fit --no-chunking
    python scripts/explore_peers.py nano-vllm --runs 300 --seed 8000 --shared-prefix
    python scripts/explore_peers.py vllm --runs 300 --seed 8000 --shared-prefix
    python scripts/explore_peers.py vllm --runs 1000 --seed 30000 --long-prefill
    python scripts/explore_peers.py vllm --runs 1000 --seed 40000 --async-scheduling --aborts 0.1
    python scripts/explore_peers.py vllm --runs 1000 --seed 50000 --speculative 4

Each run draws a small workload and config (block sizes 1-16, or 2-16 for nano-vllm;
tight to roomy pools; budgets from ``max_num_seqs`` to 48; ``max_num_seqs`` 1-6; EOS or
``ignore_eos``; arrivals over steps 0-6). For nano-vllm every prompt starts with its own
token, so its prefix cache cannot hit (docs/peers.md, N7), unless ``--shared-prefix``.
``--fit``: every request fits
alone (the spec's R4 accepts it) and chunked prefill is on unless ``--no-chunking``.
With ``--save DIR`` the first workload of each divergence kind is written there, and its
``kvsched conform`` command printed. This is exploration, not a test: the pinned
reproductions are tests/peers/test_peers.py.

``--shared-prefix`` turns prefix caching on on both sides (every profile may) and draws
4 more requests whose prompts share prefixes (``shared_prompts``: system prompts cut
anywhere or at whole blocks, prompts sent again, next turns); pools are tighter half
the time, so cached blocks are reclaimed and preempted requests come back to their own
freed blocks. Agreeing runs report the tokens their admissions hit (counted on the
spec's plans; not with ``--aborts``), and every run the prefix-cache events of the steps
both sides agreed on (``prefix_events``, nano-vllm's cache rules included).

``--speculative K`` (vllm-v1): n-gram speculative decoding with 1 to ``K`` drafts a step
(vllm-v1/spec-*), drawn last, and at most the budget and the long-prefill threshold less
one (the config refuses more: a padded decode must fit the budget and not be cut; a
budget or threshold of 1 leaves no drafts); the drafts are prompt lookup of 1-3 tokens
(vLLM's own proposer's rules) on half the runs and the oracle's own tokens, right up to
a random point, on the others, the same on both sides.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import random
import re
import time
from pathlib import Path

import spec
from kvsched.errors import DrainError
from kvsched.peers import (
    PEERS,
    PROFILES,
    PeerUnsupportedError,
    common_eos,
    make_peer,
    peer_python,
)
from kvsched.peers.known import classify
from kvsched.peers.lockstep import Diverged, Divergence, Lockstep, LockstepReport, run_workload
from kvsched.peers.ours import SchedulerAdapter
from kvsched.peers.protocol import SchedulerUnderTest
from kvsched.peers.remote import PeerProcess, RemotePeer
from kvsched.workload import WorkloadRequest
from spec.oracle import Drafter, HashOracle, OracleDrafter, PromptLookupDrafter
from spec.types import (
    ConfigError,
    InvalidRequestError,
    PreemptionMode,
    SamplingParams,
    SchedulerConfig,
    Semantics,
)
from tests.stateful.events import ASYNC_ABORT_EVENT, prefix_events, profile_events

ORACLE_VOCAB = 8
ORACLE = HashOracle(vocab_size=ORACLE_VOCAB)


def shared_prompts(
    rng: random.Random, num_requests: int, max_prompt: int, block_size: int
) -> list[list[int]]:
    """Prompts that share prefixes: 1-3 system prompts of 1-24 tokens, each request one of
    them cut anywhere (at a whole number of blocks three times in ten) plus a suffix of
    its own; one in five is an earlier prompt again, and one in five an earlier prompt
    followed by what the oracle answers it (the next turn of a chat, whose blocks a decode
    may have filled and keyed already)."""
    systems = [
        [rng.randrange(1, 200) for _ in range(rng.randint(1, 24))] for _ in range(rng.randint(1, 3))
    ]
    prompts: list[list[int]] = []
    for _ in range(num_requests):
        roll = rng.random()
        if prompts and roll < 0.2:
            prompt = list(rng.choice(prompts))
        elif prompts and roll < 0.4:
            prompt = list(rng.choice(prompts))
            for _ in range(rng.randint(1, 8)):
                prompt.append(ORACLE(tuple(prompt)))
        else:
            system = rng.choice(systems)
            cut = rng.randint(0, len(system))
            if rng.random() < 0.3 and len(system) >= block_size:
                cut = len(system) // block_size * block_size
            prompt = system[:cut]
            prompt += [rng.randrange(1, 200) for _ in range(rng.randint(0, max_prompt))]
            prompt = prompt or [rng.randrange(1, 200)]
        prompts.append(prompt)
    return prompts


def draw(
    rng: random.Random,
    peer: str,
    *,
    fit: bool,
    chunking: bool,
    policy: str,
    semantics: Semantics,
    shared_prefix: bool = False,
    long_prefill: bool = False,
    async_scheduling: bool = False,
    speculative: int = 0,
) -> tuple[SchedulerConfig, list[WorkloadRequest]]:
    nano = peer == "nano-vllm" or semantics is Semantics.NANO_VLLM
    v0 = peer == "vllm-v0" or semantics is Semantics.VLLM_V0
    tf = peer == "transformers" or semantics is Semantics.TRANSFORMERS
    tsd = peer == "tokenspeed" or semantics is Semantics.TOKENSPEED
    block_size = rng.choice(
        [4, 5, 8, 16] if tf else [2, 3, 4, 8, 16] if nano else [1, 2, 3, 4, 8, 16]
    )
    max_prompt, max_tokens = rng.randint(1, 24), rng.randint(1, 16)
    max_num_seqs = rng.randint(1, 6)
    budget = rng.randint(max_num_seqs, 48)
    eos = rng.choice([None, 3])
    workload: list[WorkloadRequest] = []
    # Drawn only here, so the other modes keep their runs (docs/peers.md's seeds).
    num_requests = rng.randint(1, 8) + (4 if shared_prefix else 0)
    shared = shared_prompts(rng, num_requests, max_prompt, block_size) if shared_prefix else []
    for i in range(num_requests):
        if shared_prefix:
            prompt = shared[i]
        else:
            prompt = [rng.randrange(1, 200) for _ in range(rng.randint(1, max_prompt))]
        if (nano or tsd) and not shared_prefix:
            # Distinct first tokens: no prefix-cache hit (nano-vllm), no page that
            # TokenSpeed de-duplicates when it publishes a prompt's pages (TS7).
            prompt[0] = 200 + i
        params = SamplingParams(
            max_tokens=rng.randint(1, max_tokens),
            eos_token_id=eos,
            ignore_eos=rng.random() < 0.3,
            priority=rng.randint(0, 2) if policy == "priority" else 0,
        )
        workload.append(
            WorkloadRequest(
                request_id=f"r{i}",
                prompt=tuple(prompt),
                params=params,
                arrival_step=rng.randint(0, 6),
            )
        )
    need = max(-(-(len(r.prompt) + r.params.max_tokens) // block_size) for r in workload)
    blocks = max(1, need + rng.randint(-1, 3)) if rng.random() < 0.7 else need * 3
    if shared_prefix and rng.random() < 0.5:
        blocks = max(1, need // 2 + rng.randint(0, need))  # tight: reclaims, preemptions
    chunked = rng.random() < 0.8
    if fit:
        blocks, chunked = max(blocks, need), True
        if nano:  # no chunked prefill: a recompute re-prefills P + M - 1 in one step (R4)
            budget = max(budget, *(len(r.prompt) + r.params.max_tokens - 1 for r in workload))
    mode, cpu_blocks, model_len = PreemptionMode.RECOMPUTE, 0, None
    if v0:
        if rng.random() < 0.2:  # vllm-v0/watermark: 1 of 100-104 one-token blocks stays free
            block_size, blocks, budget = 1, rng.randint(100, 104), max(budget, 100)
        if rng.random() < 0.5:  # swap, into a CPU pool from none to twice the GPU's
            mode, cpu_blocks = PreemptionMode.SWAP, rng.randint(0, 2 * blocks)
        if rng.random() < 0.3:  # vllm-v0/max-model-len below the profile's largest
            usable = (blocks - blocks // 100) * block_size
            model_len = rng.randint(1, min(budget, usable))
    if tsd:
        chunked = True
    if tf:  # always chunked; CPU offload (swap) half the time, into a pool of 0-2x the GPU's
        chunked = True
        if rng.random() < 0.5:
            mode, cpu_blocks = PreemptionMode.SWAP, rng.randint(0, 2 * blocks)
    config = SchedulerConfig(
        num_gpu_blocks=blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked and chunking and semantics not in UNCHUNKED,
        policy=policy,
        semantics=semantics,
        enable_prefix_caching=shared_prefix,
        preemption_mode=mode,
        num_cpu_blocks=cpu_blocks,
        max_model_len=model_len if semantics is Semantics.VLLM_V0 else None,
    )
    if long_prefill:  # vllm-v1/long-prefill-cap, at most the default max_model_len
        top = blocks * block_size
        if not config.enable_chunked_prefill:
            top = min(top, budget)
        config = dataclasses.replace(
            config,
            long_prefill_token_threshold=rng.randint(1, max(1, min(16, top))),
            long_prefill_token_threshold_adaptive=rng.random() < 0.5,
        )
    if async_scheduling:  # vllm-v1/async-*: after every other draw, so the runs are the same
        config = dataclasses.replace(config, async_scheduling=True)
    if speculative:  # vllm-v1/spec-*: last too; a padded decode must fit, and not be cut
        drafts = min(rng.randint(1, speculative), config.max_num_batched_tokens - 1)
        if config.long_prefill_token_threshold:
            drafts = min(drafts, config.long_prefill_token_threshold - 1)
        config = dataclasses.replace(config, num_speculative_tokens=drafts)
    return config, workload


def drafters(
    rng: random.Random, config: SchedulerConfig
) -> tuple[PromptLookupDrafter | None, Drafter | None]:
    """The run's n-gram ``speculative_config`` and who proposes its drafts (None: prompt
    lookup, vLLM's proposer's rules) under speculative decoding; (None, None) without."""
    k = config.num_speculative_tokens
    if not k:
        return None, None
    lookup = PromptLookupDrafter(k, 1, rng.randint(1, 3), max_model_len=config.max_model_len)
    if rng.random() < 0.5:
        return lookup, None
    return lookup, OracleDrafter(ORACLE, k, rng.randint(0, k + 1))


#: The profiles without chunked prefill (nano-vllm's has none; vllm-v0 does not model V0's).
UNCHUNKED = (Semantics.NANO_VLLM, Semantics.VLLM_V0)


def hit_tokens(config: SchedulerConfig, workload: list[WorkloadRequest]) -> int:
    """The tokens the admissions of a run hit, on the spec's plans (for an agreeing run,
    the peer's too: lockstep compared every chunk's start)."""
    oracle = HashOracle(vocab_size=ORACLE_VOCAB)
    state = spec.init_state(config)
    pending = sorted(workload, key=lambda r: r.arrival_step)
    hits = 0
    while pending or spec.has_unfinished_requests(state):
        while pending and pending[0].arrival_step <= state.num_steps:
            r = pending.pop(0)
            with contextlib.suppress(InvalidRequestError):
                state = spec.add_request(state, r.request_id, r.prompt, r.params)
        waiting = {r.request_id for r in state.waiting}
        state, plan = spec.step(state, oracle)
        hits += sum(c.start for c in plan.scheduled if c.request_id in waiting)
    return hits


def run_with_aborts(
    peer: SchedulerUnderTest,
    config: SchedulerConfig,
    workload: list[WorkloadRequest],
    rng: random.Random,
    p_abort: float,
    *,
    events: set[str] | None = None,
    distinct_readds: bool = False,
    drafter: Drafter | None = None,
) -> LockstepReport:
    """Like ``run_workload``, plus: before each step, with probability ``p_abort``, abort
    a random live request (waiting, running or preempted) not aborted before, and
    re-add its id later (its prompt's first token 250, or with ``distinct_readds`` 250 +
    the number of aborts so far, so that no two share a first page). ``events`` collects
    the prefix-cache events of the steps both sides agreed on (tests/stateful/events.py's
    ``prefix_events``)."""
    lock = Lockstep(peer, config, ORACLE, drafter=drafter)
    pending = sorted(workload, key=lambda r: r.arrival_step)
    aborted: set[str] = set()
    victim_blocks: dict[int, frozenset[int]] = {}
    finished_prompts: set[tuple[int, ...]] = set()
    divergence: Divergence | None = None
    try:
        while pending or lock.unfinished():
            while pending and pending[0].arrival_step <= lock.steps:
                r = pending.pop(0)
                lock.add(r.request_id, r.prompt, r.params)
            # Each id is aborted once: aborting re-added requests again and again can
            # keep a run from ever draining (one live request, aborted every few steps).
            live = [
                r
                for q in (lock.state.waiting, lock.state.running)
                for r in q
                if r.request_id not in aborted
            ]
            if live and rng.random() < p_abort:
                victim = rng.choice(live)
                aborted.add(victim.request_id)
                if events is not None and victim.num_in_flight_tokens:
                    events.add(ASYNC_ABORT_EVENT)
                lock.abort(victim.request_id)
                pending.append(
                    WorkloadRequest(
                        request_id=victim.request_id,
                        prompt=(
                            250 + len(aborted) * distinct_readds,
                            *victim.request.prompt_token_ids[1:],
                        ),
                        params=victim.request.params,
                        arrival_step=lock.steps + 2,
                    )
                )
                lock.compare_states()
            if lock.steps > 500:
                # Both sides agreed at every step: aborts re-add requests, which are
                # arrivals, and a steady stream of them can starve decodes (nano-vllm's
                # prefill-first steps). Tallied, not a divergence.
                raise DrainError("no drain within 500 steps (agreed at every step)")
            before = lock.state
            plan = lock.step()
            if events is not None:
                mid = spec.schedule(before)[0]
                events.update(profile_events(before, mid, plan))
                events.update(
                    prefix_events(
                        before,
                        mid,
                        plan,
                        lock.state,
                        victim_blocks=victim_blocks,
                        prompts_sent_before=finished_prompts,
                    )
                )
                prompts = {
                    r.request_id: r.request.prompt_token_ids for r in (*mid.running, *mid.waiting)
                }
                finished_prompts.update(prompts[f.request_id] for f in plan.finished)
        lock.finish()
    except Diverged as e:
        divergence = e.divergence
    except DrainError as e:
        divergence = Divergence(lock.steps, str(e), None, None)
    return LockstepReport(lock.steps, len(workload), lock.rejected, lock.preemptions, divergence)


def command(peer: str, path: Path, c: SchedulerConfig) -> str:
    return (
        f"kvsched conform --engine {peer} {path} --num-gpu-blocks {c.num_gpu_blocks} "
        f"--block-size {c.block_size} --max-num-batched-tokens {c.max_num_batched_tokens} "
        f"--max-num-seqs {c.max_num_seqs} --policy {c.policy}"
        + ("" if c.enable_chunked_prefill else " --no-enable-chunked-prefill")
        + f" --semantics {c.semantics}"
        + (" --enable-prefix-caching" if c.enable_prefix_caching else " --no-enable-prefix-caching")
        + f" --preemption-mode {c.preemption_mode} --num-cpu-blocks {c.num_cpu_blocks}"
        + f" --oracle-vocab {ORACLE_VOCAB}"
        + (
            f" --long-prefill-token-threshold {c.long_prefill_token_threshold}"
            if c.long_prefill_token_threshold
            else ""
        )
        + (
            " --long-prefill-token-threshold-adaptive"
            if c.long_prefill_token_threshold_adaptive
            else ""
        )
        + (" --async-scheduling" if c.async_scheduling else " --no-async-scheduling")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peer", choices=[*PEERS, "kvsched"], help="kvsched: our impl.Scheduler")
    parser.add_argument(
        "--peer-python",
        default=None,
        help="the peer's environment (default: its own from install_peers --venv, else here)",
    )
    parser.add_argument(
        "--semantics",
        choices=[s.value for s in Semantics],
        default=None,
        help="the spec's profile (default: the peer's own)",
    )
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--no-chunking", action="store_true")
    parser.add_argument("--policy", default="lifo")
    parser.add_argument("--save", type=Path)
    parser.add_argument(
        "--aborts", type=float, default=0.0, help="abort probability per step (re-adds the id)"
    )
    parser.add_argument(
        "--shared-prefix",
        action="store_true",
        help="prefix caching on, prompts that share prefixes (shared_prompts)",
    )
    parser.add_argument(
        "--long-prefill",
        action="store_true",
        help="vllm-v1: a long_prefill_token_threshold of 1-16, adaptive half the time",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vllm-v1: async scheduling on (vLLM's AsyncScheduler and batch queue)",
    )
    parser.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="vllm-v1: n-gram speculative decoding, 1 to K drafts a step",
    )
    args = parser.parse_args()
    kinds: collections.Counter[str] = collections.Counter()
    runs_with: collections.Counter[str] = collections.Counter()  # runs that met each event
    examples: dict[str, str] = {}
    agree = steps = hits = 0
    started = time.perf_counter()
    semantics = PROFILES[args.peer] if args.semantics is None else Semantics(args.semantics)
    # A peer in another environment: one server process for every run (its import once).
    python = None if args.peer == "kvsched" else peer_python(args.peer, args.peer_python)
    process = None if python is None else PeerProcess(python, args.peer)
    version = None if process is None or process.installed is None else process.installed[1]
    for k in range(args.runs):
        rng = random.Random(args.seed + k)
        peer: SchedulerUnderTest
        try:
            config, workload = draw(
                rng,
                args.peer,
                fit=args.fit,
                chunking=not args.no_chunking,
                policy=args.policy,
                semantics=semantics,
                shared_prefix=args.shared_prefix,
                long_prefill=args.long_prefill,
                async_scheduling=args.async_scheduling,
                speculative=args.speculative,
            )
            speculative, drafter = drafters(rng, config)
            eos = common_eos(r.params for r in workload) if args.peer == "nano-vllm" else None
            if args.peer == "kvsched":
                peer = SchedulerAdapter(config)
            elif process is not None:
                peer = process.peer(config, eos_token_id=eos)
            else:
                peer = make_peer(
                    args.peer, config, eos_token_id=eos, speculative=speculative, drafter=drafter
                )
        except (PeerUnsupportedError, ConfigError) as e:
            kinds[f"unsupported: {e}"] += 1
            continue
        # Events are counted on the same loop (the profile's rules: vllm-v0's, nano-vllm's).
        if (
            args.aborts
            or args.shared_prefix
            or args.long_prefill
            or args.async_scheduling
            or args.speculative
            or semantics is Semantics.VLLM_V0
        ):
            events: set[str] = set()
            report = run_with_aborts(
                peer,
                config,
                workload,
                rng,
                args.aborts,
                events=events,
                distinct_readds=args.peer == "tokenspeed" and not args.shared_prefix,
                drafter=drafter or speculative,
            )
            runs_with.update(events)
        else:
            report = run_workload(peer, config, workload, ORACLE)
        if isinstance(peer, RemotePeer):
            peer.close()
        steps += report.steps
        if report.divergence is None:
            agree += 1
            if config.enable_prefix_caching and not args.aborts:  # the replay has no aborts
                hits += hit_tokens(config, workload)
            continue
        kind = re.sub(r"\[\d+\]", "[i]", re.sub(r"\('r\d+'\)", "(...)", report.divergence.field))
        bug = classify(args.peer, report.divergence, version=version)
        if bug is not None:
            kind = f"known peer bug {bug.id}: {kind}"
        kinds[kind] += 1
        if kind not in examples:
            example = f"seed {args.seed + k}: {report.divergence}"
            if args.save is not None:
                args.save.mkdir(parents=True, exist_ok=True)
                path = args.save / f"{args.peer}-{args.seed + k}.jsonl"
                path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in workload))
                example += "\n    " + command(args.peer, path, config)
            examples[kind] = example
    seconds = time.perf_counter() - started
    where = "" if process is None else f" ({process.installed} in {process.python})"
    print(
        f"{args.peer}{where} under {semantics}: {args.runs} runs, {agree} agree, {steps} "
        f"steps, {seconds:.0f} s" + (f", {hits} tokens hit in agreeing runs" if hits else "")
    )
    for kind, count in kinds.most_common():
        print(f"{count:5d}  {kind}")
        print(f"       e.g. {examples.get(kind, '')}")
    for event, count in sorted(runs_with.items()):
        print(f"{count:5d}  runs with: {event}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
