"""The lockstep machine on the peers' real schedulers (tests/stateful/subjects/vllm_v1.py,
nano_vllm.py): vLLM V1's and nano-vllm's against the spec under their semantics profiles,
every step. Run like the stateful suite (tests/stateful/harness.py): sized per Hypothesis
profile, coverage asserted under ``ci`` and ``nightly``, the report (examples, steps,
events, known peer bugs met) printed and summarised. A peer that is not installed skips
(fails under ``CI=true``).
"""

from __future__ import annotations

import pytest

from tests.stateful.harness import run_machine
from tests.stateful.machine import machine_for
from tests.stateful.subjects.nano_vllm import NANO_VLLM
from tests.stateful.subjects.vllm_v1 import VLLM, VLLM_PREFIX

#: A new peer: its subject file (tests/stateful/subjects/) and a line here.
PEER_MACHINES = {subject.name: machine_for(subject) for subject in (VLLM, VLLM_PREFIX, NANO_VLLM)}


@pytest.mark.parametrize("name", sorted(PEER_MACHINES))
def test_peer_machine(name: str) -> None:
    run_machine(PEER_MACHINES[name])
