"""A pure stand-in for the model and its two KV pools (no torch), for ``SchedulerDifferential``.

Each cache slot holds ``(arrival, position, token)``: which request's K/V it is, for
which position, of which token. A forward does what the real engine does with the
scheduler's output, in the same order:

1. the swap copies, whole blocks, through the block ids in ``swap_out`` (GPU->CPU)
   and ``swap_in`` (CPU->GPU);
2. per scheduled chunk: *read* the request's context (positions before the chunk)
   through its block table, *write* the chunk's tokens to their slots, and, if the
   chunk reaches the request's last token, sample ``oracle(context + chunk)``.

The sampled token depends only on what was read from the cache, like a real model:
a wrong block id, a block freed while still in use, a swap that copies the wrong
blocks or a lost output all change what is read. A read that finds another
request's slot (with prefix caching: another token or position), or nothing, fails
``kv_contents`` on the spot (naming the slot); two
chunks of one step writing one slot fail ``kv_exclusive``.

A failed forward restores both pools (as the engine restores the blocks its victims
gave up from a snapshot), so an injected fault leaves the toy cache as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from impl.scheduler_output import SchedulerOutput
from impl.sequence import Sequence as Seq
from spec.types import SamplingParams, SchedulerConfig
from tests.stateful.failures import InjectedFault, fail, require

Slot = tuple[int, int, int]  # (arrival, position, token)
Oracle = Callable[[tuple[int, ...]], int]


class ToyModel:
    def __init__(self, config: SchedulerConfig, oracle: Oracle) -> None:
        self.block_size = config.block_size
        self.shared = config.enable_prefix_caching
        self.gpu: list[Slot | None] = [None] * (config.num_gpu_blocks * config.block_size)
        self.cpu: list[Slot | None] = [None] * (config.num_cpu_blocks * config.block_size)
        self.oracle = oracle
        # Armed faults: kind -> only in a step that preempts. Each fires once, at the
        # first step that can hit it; kinds are armed independently.
        self.armed: dict[str, bool] = {}
        self.fired: list[str] = []

    def forward(self, out: SchedulerOutput) -> list[int]:
        return [run[-1] for run in self.verify(out)]

    def verify(self, out: SchedulerOutput) -> list[list[int]]:
        """The forward; each sampling chunk's run: with drafts (speculative decoding)
        the drafts while they equal the oracle's token at their position, then the
        oracle's next token (a greedy model's verify); without, that one token."""
        saved = (self.gpu.copy(), self.cpu.copy())
        try:
            return self._forward(out)
        except BaseException:
            self.gpu, self.cpu = saved
            raise

    def _armed(self, kind: str, out: SchedulerOutput) -> bool:
        if kind not in self.armed:
            return False
        # A swap-in never happens in a step that preempts (R7): that condition is moot.
        needs_preemption = self.armed[kind] and kind != "swap-in copy"
        return bool(out.preempted) or not needs_preemption

    def _fire(self, kind: str) -> None:
        del self.armed[kind]
        self.fired.append(kind)
        raise InjectedFault(kind)

    def _copy(
        self, src: list[Slot | None], dst: list[Slot | None], pairs: Sequence[tuple[int, int]]
    ) -> None:
        bs = self.block_size
        for a, b in pairs:
            dst[b * bs : (b + 1) * bs] = src[a * bs : (a + 1) * bs]

    def _slot(self, seq: Seq, position: int) -> int:
        block = position // self.block_size
        require(
            block < len(seq.block_table),
            "kv_contents",
            lambda: f"{seq!r}: position {position} is beyond its block table {seq.block_table}",
        )
        return seq.block_table[block] * self.block_size + position % self.block_size

    def _forward(self, out: SchedulerOutput) -> list[list[int]]:
        if out.swap_out and self._armed("swap-out copy", out):
            self._fire("swap-out copy")
        self._copy(self.gpu, self.cpu, out.swap_out)
        self._copy(self.cpu, self.gpu, out.swap_in)
        if out.swap_in and self._armed("swap-in copy", out):
            self._fire("swap-in copy")  # after the copy, which landed in fresh blocks
        if self._armed("forward", out):
            self._fire("forward")
        gpu = self.gpu
        written: set[int] = set()
        runs: list[list[int]] = []
        for seq, n in zip(out.scheduled, out.num_scheduled, strict=True):
            start = seq.num_computed
            chunk = out.chunk_token_ids(seq, start, n)  # a placeholder's token from out.pending
            context: list[int] = []
            for position in range(start):
                slot = self._slot(seq, position)
                content = gpu[slot]
                # With prefix caching a hit reads another request's slot: it must hold
                # this position of the same token (an equal prefix, PC2).
                if content is None or (
                    content[1:] != (position, seq.token_ids[position])
                    if self.shared
                    else content[:2] != (seq.arrival, position)
                ):
                    fail(
                        "kv_contents",
                        f"step {out.step}: {seq.request_id!r} (arrival {seq.arrival}) reads "
                        f"position {position} from slot {slot}, which holds {content}",
                    )
                context.append(content[2])
            for position in range(start, start + n):
                slot = self._slot(seq, position)
                if slot in written:
                    fail("kv_exclusive", f"step {out.step}: slot {slot} written twice")
                written.add(slot)
                token = chunk[position - start]
                gpu[slot] = (seq.arrival, position, token)
                context.append(token)
            if seq.samples_at(start + n):
                # Position p scores the token after context[: p + 1]; the chunk's drafts
                # (speculative decoding) are its positions past the request's tokens.
                drafted = start + n - seq.num_tokens if seq.spec_token_ids else 0
                known = len(context) - drafted
                run: list[int] = []
                for draft in context[known:]:
                    if draft != self.oracle(tuple(context[: known + len(run)])):
                        break
                    run.append(draft)
                run.append(self.oracle(tuple(context[: known + len(run)])))
                runs.append(run)
        if self._armed("forward after KV write", out):
            self._fire("forward after KV write")
        return runs


def toy_solo(prompt: tuple[int, ...], params: SamplingParams, oracle: Oracle) -> tuple[int, ...]:
    """A request's outputs alone: the oracle on its own prefix until EOS or max_tokens."""
    outputs: list[int] = []
    eos = None if params.ignore_eos else params.eos_token_id
    while True:
        token = oracle((*prompt, *outputs))
        outputs.append(token)
        if token == eos or len(outputs) >= params.max_tokens:
            return tuple(outputs)
