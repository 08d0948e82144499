"""Planted bugs for CrossHair: realistic mistakes inside the spec's transitions.

CrossHair is measured here like a test suite: each entry of ``PLANTED`` is a bug one
could really write in a transition (a phase of ``schedule``, ``complete_step``,
``abort_request``, ``add_request``), applied as a one-place text edit to a *copy* of
``spec/`` in a temporary folder; ``scripts/crosshair_check --stage planted`` runs
CrossHair on the copy, on the function that holds the bug, with the CI budget, and
counts the bug as found when CrossHair reports a counterexample (an ``error`` line)
in that copy. The score (k/N found) is printed; a bug not found fails the check.

Each edit must match the spec's source exactly once, so a change to the spec that
moves the code under a planted bug makes the stage fail loudly (fix the entry)
instead of planting nothing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PlantedBug:
    name: str
    where: str  # the area the issue asks to cover (phase A-D, admission, abort, ...)
    bug: str  # what the mistake is, in words
    file: str  # under spec/
    old: str  # the exact source text replaced (once)
    new: str
    target: str  # the function CrossHair analyses (dotted, as ``crosshair check`` takes it)


PLANTED: tuple[PlantedBug, ...] = (
    # --- phase A: running requests and preemption ------------------------------------
    PlantedBug(
        name="A-blocks-not-taken",
        where="phase A",
        bug="a scheduled chunk's new blocks are not taken from the free count",
        file="scheduler.py",
        old="                budget -= n\n            free -= need\n",
        new="                budget -= n\n",
        target="spec.scheduler.schedule_running",
    ),
    PlantedBug(
        name="A-chunk-ignores-budget",
        where="phase A",
        bug="a running request's chunk is its whole remainder, not capped by the budget",
        file="scheduler.py",
        old=(
            "        n = remaining if unbudgeted else "
            "running_chunk(remaining, budget, draft.long_prefill_cap)\n"
        ),
        new="        n = remaining\n",
        target="spec.scheduler.schedule_running",
    ),
    PlantedBug(
        name="A-preempt-frees-after-reset",
        where="preemption",
        bug="a victim's GPU blocks are counted after preempt() reset its computed count",
        file="scheduler.py",
        old=(
            "        free += table_blocks(held, victim.num_computed_tokens, "
            "victim.num_blocks_ahead, bs)\n"
        ),
        new=(
            "        free += table_blocks(after.num_computed_tokens, after.num_computed_tokens, "
            "after.num_blocks_ahead, bs)\n"
        ),
        target="spec.scheduler.release_victim",
    ),
    PlantedBug(
        name="A-victim-to-waiting-tail",
        where="preemption",
        bug="a recomputed victim goes to the tail of waiting instead of the front",
        file="scheduler.py",
        old="            waiting=(*reversed(to_waiting), *state.waiting),\n",
        new="            waiting=(*state.waiting, *to_waiting),\n",
        target="spec.scheduler.schedule_running",
    ),
    PlantedBug(
        name="A-self-victim-goes-on",
        where="preemption",
        bug="phase A goes on after preempting the very request that needed blocks",
        file="scheduler.py",
        old=(
            "            if victim is request:\n"
            "                phase_over = True\n"
            "                break\n"
        ),
        new="",
        target="spec.scheduler.schedule_running",
    ),
    PlantedBug(
        name="A-victim-is-the-requester",
        where="victim choice",
        bug="the request that needs blocks preempts itself, not the newest candidate (lifo)",
        file="scheduler.py",
        old="            k = profile_victim(config, policy, tuple(running), i)\n",
        new="            k = i\n",
        target="spec.scheduler.schedule_running",
    ),
    PlantedBug(
        name="A-swap-out-cpu-not-taken",
        where="swap-out",
        bug="a swapped-out victim's CPU blocks are not taken from the CPU free count",
        file="scheduler.py",
        old=(
            "    if mode is PreemptionMode.SWAP:\n"
            "        free_cpu -= blocks_held(after.num_computed_tokens, bs)\n"
        ),
        new="",
        target="spec.scheduler.release_victim",
    ),
    PlantedBug(
        name="A-shared-block-freed",
        where="preemption (prefix caching)",
        bug="a victim's blocks that another running request shares are freed too (PC6)",
        file="scheduler.py",
        old="        cache = release_blocks(config, cache, victim.block_ids, holders(others))\n",
        new="        cache = release_blocks(config, cache, victim.block_ids, {})\n",
        target="spec.scheduler.release_victim",
    ),
    # --- phase B: swapping in ----------------------------------------------------------
    PlantedBug(
        name="B-swap-in-cpu-not-freed",
        where="swap-in",
        bug="a swapped-in request's CPU blocks are not given back",
        file="scheduler.py",
        old="        free_cpu += blocks_held(computed, bs)\n",
        new="",
        target="spec.scheduler.swap_in_requests",
    ),
    PlantedBug(
        name="B-swap-in-chunk-blocks-only",
        where="swap-in",
        bug="a swap-in takes GPU blocks for its chunk only, not for the prefix copied back",
        file="scheduler.py",
        old="        gpu_blocks = blocks_held(computed + n, bs)\n",
        new="        gpu_blocks = blocks_held(n, bs)\n",
        target="spec.scheduler.swap_in_requests",
    ),
    PlantedBug(
        name="B-swap-in-ignores-max-num-seqs",
        where="swap-in",
        bug="swap-in does not stop at max_num_seqs running requests",
        file="scheduler.py",
        old="        if len(moved) >= room or budget == 0:\n",
        new="        if budget == 0:\n",
        target="spec.scheduler.swap_in_requests",
    ),
    # --- phase C: admission --------------------------------------------------------------
    PlantedBug(
        name="C-admit-blocks-rounded-down",
        where="admission arithmetic",
        bug="an admitted chunk takes floor(n / bs) blocks instead of cdiv(n, bs)",
        file="scheduler.py",
        old="        gpu_blocks = cdiv(start + n, bs) - len(hit)\n",
        new="        gpu_blocks = (start + n) // bs - len(hit)\n",
        target="spec.scheduler.admit_waiting",
    ),
    PlantedBug(
        name="C-admit-free-off-by-one",
        where="admission arithmetic",
        bug="the free-block check admits a chunk needing one block more than is free",
        file="scheduler.py",
        old="    if n > budget or blocks_held(start + n, config.block_size) - num_hit > free:\n",
        new=(
            "    if n > budget or blocks_held(start + n, config.block_size) - num_hit > free + 1:\n"
        ),
        target="spec.scheduler.prefill_fit",
    ),
    PlantedBug(
        name="C-admit-unchunked-over-budget",
        where="admission arithmetic",
        bug="with chunked prefill off, a prefill larger than the budget left is admitted",
        file="scheduler.py",
        old="    if n > budget or blocks_held(start + n, config.block_size) - num_hit > free:\n",
        new="    if blocks_held(start + n, config.block_size) - num_hit > free:\n",
        target="spec.scheduler.prefill_fit",
    ),
    PlantedBug(
        name="C-admitted-stays-waiting",
        where="admission",
        bug="an admitted request is not removed from waiting",
        file="scheduler.py",
        old="        waiting=tuple(r for r in state.waiting if r.request_id not in admitted),\n",
        new="        waiting=state.waiting,\n",
        target="spec.scheduler.admit_waiting",
    ),
    PlantedBug(
        name="C-admit-skips-unfit",
        where="admission",
        bug="a waiting request that does not fit is skipped, not a stop (head-of-line)",
        file="scheduler.py",
        old="            break\n        gpu_blocks = cdiv(start + n, bs) - len(hit)\n",
        new="            continue\n        gpu_blocks = cdiv(start + n, bs) - len(hit)\n",
        target="spec.scheduler.admit_waiting",
    ),
    PlantedBug(
        name="C-admit-while-swapped",
        where="admission",
        bug="new requests are admitted while swapped requests wait to come back",
        file="scheduler.py",
        old="    if draft.preempted or state.swapped or not state.waiting:\n",
        new="    if draft.preempted or not state.waiting:\n",
        target="spec.scheduler.admit_waiting",
    ),
    # --- phase D: sampling and finishing ---------------------------------------------------
    PlantedBug(
        name="D-finish-frees-before-chunk",
        where="finish",
        bug="a finished request frees the blocks it held before this step's chunk",
        file="scheduler.py",
        old="            freed += gpu_blocks_owned(config, request, end)\n",
        new="            freed += gpu_blocks_owned(config, request, request.num_computed_tokens)\n",
        target="spec.scheduler.complete_verified_step",
    ),
    PlantedBug(
        name="D-length-off-by-one",
        where="finish",
        bug="the length check counts the outputs before the new token (finishes one late)",
        file="scheduler.py",
        old="        len(outputs),\n    )\n",
        new="        len(request.output_token_ids),\n    )\n",
        target="spec.scheduler.complete_verified_step",
    ),
    PlantedBug(
        name="D-sampled-not-advanced",
        where="phase D",
        bug="a request that sampled keeps its old computed count",
        file="scheduler.py",
        old=(
            "                output_token_ids=outputs,\n"
            "                num_computed_tokens=computed,\n"
        ),
        new=(
            "                output_token_ids=outputs,\n"
            "                num_computed_tokens=request.num_computed_tokens,\n"
        ),
        target="spec.scheduler.complete_verified_step",
    ),
    PlantedBug(
        name="D-eos-dropped",
        where="finish",
        bug="a request that stops on EOS is reported without the EOS token",
        file="scheduler.py",
        old="        output_token_ids=outputs,\n        finish_reason=reason,\n",
        new=(
            "        output_token_ids=outputs if reason is FinishReason.LENGTH "
            "else request.output_token_ids,\n        finish_reason=reason,\n"
        ),
        target="spec.scheduler.complete_verified_step",
    ),
    # --- abort, in each queue, and add -----------------------------------------------------
    PlantedBug(
        name="X-abort-running-wrong-pool",
        where="abort (running)",
        bug="aborting a running request gives back its CPU count (0) instead of its GPU blocks",
        file="lifecycle.py",
        old="            num_free_gpu_blocks=state.num_free_gpu_blocks + gpu,\n",
        new="            num_free_gpu_blocks=state.num_free_gpu_blocks + cpu,\n",
        target="spec.lifecycle.abort_request",
    ),
    PlantedBug(
        name="X-abort-swapped-frees-gpu",
        where="abort (swapped)",
        bug="aborting a swapped request frees GPU blocks instead of its CPU blocks",
        file="lifecycle.py",
        old="            num_free_cpu_blocks=state.num_free_cpu_blocks + cpu,\n",
        new="            num_free_gpu_blocks=state.num_free_gpu_blocks + cpu,\n",
        target="spec.lifecycle.abort_request",
    ),
    PlantedBug(
        name="X-abort-waiting-drops-outputs",
        where="abort (waiting)",
        bug="an aborted waiting request is reported with no outputs (a recomputed one has some)",
        file="lifecycle.py",
        old='    if queue == "waiting":\n        request = state.waiting[index]\n',
        new=(
            '    if queue == "waiting":\n        request = replace(state.waiting[index], '
            "output_token_ids=())\n"
        ),
        target="spec.lifecycle.abort_request",
    ),
    PlantedBug(
        name="X-abort-waiting-kept",
        where="abort (waiting)",
        bug="an aborted waiting request stays in waiting",
        file="lifecycle.py",
        old="        new_state = replace(state, waiting=_without(state.waiting, index))\n",
        new="        new_state = state\n",
        target="spec.lifecycle.abort_request",
    ),
    PlantedBug(
        name="R-arrival-not-advanced",
        where="add_request",
        bug="an accepted request does not advance next_arrival (two requests share one)",
        file="lifecycle.py",
        old="        next_arrival=state.next_arrival + 1,\n",
        new="        next_arrival=state.next_arrival,\n",
        target="spec.lifecycle.add_request",
    ),
    # --- the peer profiles' rules (issue 25: paths under vllm-v1 and nano-vllm) --------
    PlantedBug(
        name="V-full-sequence-gate-off-by-one",
        where="admission gate (vllm-v1)",
        bug="vllm-v1/full-sequence-admission admits a sequence one block over the free ones",
        file="profiles.py",
        old="- num_hit + num_evictable <= free\n",
        new="- num_hit + num_evictable <= free + 1\n",
        target="spec.profiles.full_sequence_fits",
    ),
    PlantedBug(
        name="N-len-seq-gate-ignores-budget",
        where="admission gate (nano-vllm)",
        bug="nano-vllm/admission-tests-len-seq tests the blocks but not the budget left",
        file="profiles.py",
        old="    return request.num_tokens <= budget and cdiv(",
        new="    return cdiv(",
        target="spec.profiles.whole_sequence_admissible",
    ),
    PlantedBug(
        name="N-victim-last-not-next",
        where="victim choice (nano-vllm)",
        bug="nano-vllm/victim-next takes the last running request (lifo) instead of the next",
        file="scheduler.py",
        old="        return i + next_victim(len(running) - i)\n",
        new="        return len(running) - 1\n",
        target="spec.scheduler.profile_victim",
    ),
    PlantedBug(
        name="V-priority-victim-among-candidates",
        where="victim choice (vllm-v1)",
        bug="vllm-v1/priority-victim-any-running picks among running[i:] only, not all running",
        file="scheduler.py",
        old="        return priority_victim(running)\n",
        new="        return i + priority_victim(running[i:])\n",
        target="spec.scheduler.profile_victim",
    ),
    PlantedBug(
        name="V-async-placeholder-kept",
        where="async scheduling (vllm-v1)",
        bug="vllm-v1/async-commit: applying a sampled token leaves its placeholder",
        file="pipeline.py",
        old="        num_output_placeholders=request.num_output_placeholders - (not stale),\n",
        new="        num_output_placeholders=request.num_output_placeholders,\n",
        target="spec.pipeline.complete_async_step",
    ),
    PlantedBug(
        name="S-bonus-counted-accepted",
        where="speculative decoding (vllm-v1)",
        bug="vllm-v1/spec-verify: a run's last token counts as an accepted draft whatever it "
        "is, the bonus token too (the acceptance figures run over 100 %)",
        file="speculative.py",
        old="    if len(run) <= len(drafts) and run[-1] == drafts[len(run) - 1]:\n",
        new="    if len(run) <= len(drafts) + 1:\n",
        target="spec.speculative.num_accepted",
    ),
    PlantedBug(
        name="V-long-prefill-cap-ignored-running",
        where="phase A (vllm-v1)",
        bug="vllm-v1/long-prefill-cap: a running request's chunk is cut by the budget only",
        file="scheduler.py",
        old="    return min(capped(remaining, cap), budget)\n",
        new="    return min(remaining, budget)\n",
        target="spec.scheduler.running_chunk",
    ),
    PlantedBug(
        name="V-long-prefill-cap-ignored-waiting",
        where="admission (vllm-v1)",
        bug="vllm-v1/long-prefill-cap: a waiting request's chunk is cut by the budget only",
        file="scheduler.py",
        old="    remaining = capped(request.num_tokens - start, cap)\n",
        new="    remaining = request.num_tokens - start\n",
        target="spec.scheduler.prefill_fit",
    ),
    PlantedBug(
        name="V-long-prefill-cap-for-a-lone-request",
        where="chunk cap (vllm-v1)",
        bug="vllm-v1/long-prefill-cap cuts the chunk of a request running or waiting alone",
        file="profiles.py",
        old="    if threshold == 0 or count <= 1:\n",
        new="    if threshold == 0 or count < 1:\n",
        target="spec.profiles.long_prefill_cap",
    ),
    # --- the prefix cache (issue 25: key chaining, whole-prompt hits, ref counts) -------
    PlantedBug(
        name="PC-key-not-chained",
        where="block keys (caching)",
        bug="a block's key is its own tokens, not its whole prefix (PC2: keys chain)",
        file="prefix_cache.py",
        old="    return tokens[: (index + 1) * block_size]\n",
        new="    return tokens[index * block_size : (index + 1) * block_size]\n",
        target="spec.prefix_cache.block_key",
    ),
    PlantedBug(
        name="PC-whole-prompt-hit",
        where="cache hits (caching)",
        bug="a block-aligned prompt may hit whole, leaving no token to compute (PC3)",
        file="prefix_cache.py",
        old="    return (num_tokens - 1) // block_size\n",
        new="    return num_tokens // block_size\n",
        target="spec.prefix_cache.max_hit_blocks",
    ),
    # --- transitions over a prefix-cache pool (issue 25: symbolic states with caching on)
    PlantedBug(
        name="C-hit-evictable-not-counted",
        where="admission (caching)",
        bug="PC4: the hit blocks that sit in the free queue are not counted as taken",
        file="scheduler.py",
        old="        room = max(free - evictable - reserve, 0)\n",
        new="        room = max(free - reserve, 0)\n",
        target="spec.scheduler.admit_waiting",
    ),
    # --- the profiles added since (issue 25: vllm-v0, transformers, tokenspeed) ----------
    PlantedBug(
        name="V0-last-block-not-touched",
        where="growth gate (vllm-v0)",
        bug="vllm-v0/append-touches-last-block counts only the new blocks, not the last one",
        file="profiles.py",
        old="        return cdiv(computed + num_tokens, bs) - computed // bs\n",
        new="        return cdiv(computed + num_tokens, bs) - cdiv(computed, bs)\n",
        target="spec.profiles.blocks_to_run",
    ),
    PlantedBug(
        name="V0-admits-first-while-swapped",
        where="phase order (vllm-v0)",
        bug="vllm-v0/prefill-first admits first even while requests are swapped",
        file="profiles.py",
        old="(config.semantics is Semantics.VLLM_V0 and not state.swapped)",
        new="(config.semantics is Semantics.VLLM_V0)",
        target="spec.profiles.admits_first",
    ),
    PlantedBug(
        name="T-walk-blocks-not-taken",
        where="walk (transformers)",
        bug="a scheduled candidate's blocks are not taken from the free count",
        file="offload.py",
        old="        free -= need\n",
        new="",
        target="spec.offload.schedule_offloading",
    ),
    PlantedBug(
        name="T-swap-in-cpu-kept",
        where="swap-in (transformers)",
        bug="a swapped-in request's CPU blocks are not given back after the offloads",
        file="offload.py",
        old="        mid = replace(mid, num_free_cpu_blocks=mid.num_free_cpu_blocks + back)\n",
        new="        mid = replace(mid, num_free_cpu_blocks=mid.num_free_cpu_blocks)\n",
        target="spec.offload.schedule_offloading",
    ),
    PlantedBug(
        name="TS-reserve-one-over",
        where="admission gate (tokenspeed)",
        bug="tokenspeed/reserve-generation admits a reserve one block over the free ones",
        file="reserve.py",
        old="        if need > free:  # TS5: skipped\n",
        new="        if need > free + 1:  # TS5: skipped\n",
        target="spec.reserve.schedule_reserving",
    ),
    PlantedBug(
        name="TS-decodes-beside-prefill",
        where="plan kind (tokenspeed)",
        bug="tokenspeed/prefill-first: decodes are scheduled beside a prefill",
        file="reserve.py",
        old="    if not chunks:  # TS3: a decode plan\n",
        new="    if True:  # TS3: a decode plan\n",
        target="spec.reserve.schedule_reserving",
    ),
    PlantedBug(
        name="PC-refcount-off-by-one",
        where="preemption (caching)",
        bug="a released block is freed while one other request still holds it (PC6)",
        file="prefix_cache.py",
        old="    freed = [block for block in reversed(block_ids) if not others.get(block, 0)]\n",
        new="    freed = [block for block in reversed(block_ids) if others.get(block, 0) <= 1]\n",
        target="spec.scheduler.release_victim",
    ),
)


def plant(bug: PlantedBug, into: Path) -> Path:
    """Copy ``spec/`` into ``into/spec`` with ``bug`` applied; return the edited file.

    ``into`` also gets a copy of ``impl/`` and ``model/`` and a link to ``tests/`` (the
    plugin and the driver), so CrossHair
    run with ``into`` as its working directory and ``PYTHONPATH`` imports the copy:
    both ``python -m`` and CrossHair put the working directory first on ``sys.path``.
    ``ValueError`` if the edit does not match the source exactly once.
    """
    copy = into / "spec"
    shutil.copytree(ROOT / "spec", copy, ignore=shutil.ignore_patterns("__pycache__"))
    # Copied, not linked: ``spec/_clash.py`` fails the import unless ``impl`` and
    # ``model`` resolve to folders beside the copy's ``spec``.
    for package in ("impl", "model"):
        shutil.copytree(
            ROOT / package, into / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    (into / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    path = copy / bug.file
    source = path.read_text()
    count = source.count(bug.old)
    if count != 1:
        raise ValueError(f"{bug.name}: the edit matches spec/{bug.file} {count} times, not once")
    path.write_text(source.replace(bug.old, bug.new))
    return path
