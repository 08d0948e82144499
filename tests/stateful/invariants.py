"""The invariants checked after every rule: the real side against the spec, and itself."""

from __future__ import annotations

from hypothesis.stateful import invariant

import impl
import spec
from impl.block_manager import cdiv
from tests.stateful.base import MachineBase, checked
from tests.stateful.failures import InvariantViolation, fail, require


class Invariants(MachineBase):
    @invariant()
    @checked
    def observe_matches_spec(self) -> None:
        if self.ready:
            with self.compared("observe", "observe_matches_spec"):
                self.lock.compare_states()

    @invariant()
    @checked
    def spec_state_valid(self) -> None:
        if self.ready:
            violations = spec.state_violations(self.lock.state)
            require(not violations, "spec_state_valid", "; ".join(violations))

    @invariant()
    @checked
    def kv_within_capacity(self) -> None:
        """No OOM: used <= capacity on both real pools."""
        if self.ready:
            scheduler = self.real_scheduler()
            for name, pool in (("GPU", scheduler.gpu), ("CPU", scheduler.cpu)):
                if not 0 <= pool.num_used_blocks <= pool.num_blocks:
                    fail(
                        "kv_within_capacity",
                        f"{name} uses {pool.num_used_blocks} of {pool.num_blocks} blocks",
                    )

    @invariant()
    @checked
    def blocks_conserved(self) -> None:
        """free + owned == total on both pools, owned counted from the real block tables."""
        if not self.ready:
            return
        scheduler = self.real_scheduler()
        pools = (
            ("GPU", scheduler.gpu, [seq.block_table for seq in scheduler.running]),
            ("CPU", scheduler.cpu, [seq.cpu_block_table for seq in scheduler.swapped]),
        )
        shared = scheduler.config.enable_prefix_caching
        for name, pool, tables in pools:
            owned = [block for table in tables for block in table]
            if any(len(set(table)) != len(table) for table in tables) or (
                len(set(owned)) != len(owned) and not (shared and name == "GPU")
            ):
                fail("blocks_conserved", f"{name} block owned twice: {tables}")
            owned = list(dict.fromkeys(owned))  # PC1: a shared block counts once
            if pool.num_free_blocks + len(owned) != pool.num_blocks:
                fail(
                    "blocks_conserved",
                    f"{name}: free {pool.num_free_blocks} + owned {len(owned)} "
                    f"!= {pool.num_blocks}",
                )
            try:
                pool.check()
            except impl.BlockAllocationError as error:
                raise InvariantViolation("blocks_conserved", f"{name}: {error}") from error
        bs = self.config.block_size
        for seq in scheduler.running:
            if len(seq.block_table) != cdiv(seq.num_computed, bs):
                fail(
                    "blocks_conserved",
                    f"{seq!r} has {len(seq.block_table)} GPU blocks for {seq.num_computed} tokens",
                )

    @invariant()
    @checked
    def real_self_check(self) -> None:
        if self.ready:
            try:
                self.real_scheduler().check_invariants()
            except AssertionError as error:
                raise InvariantViolation("real_self_check", repr(error)) from error


#: The names of the invariants (they show up in a printed failing program).
INVARIANT_NAMES: frozenset[str] = frozenset(
    name for name in vars(Invariants) if not name.startswith("_")
)
