"""The lockstep machine on the peers' real schedulers (tests/stateful/subjects/vllm_v1.py,
nano_vllm.py, vllm_v0.py, transformers_cb.py, tokenspeed.py): vLLM V1's, nano-vllm's,
vLLM V0's (in its own environment, swap mode included), transformers' continuous
batching's and TokenSpeed's against the spec under their semantics profiles, every step.
Run like the stateful suite (tests/stateful/harness.py): sized per Hypothesis profile,
coverage asserted under ``ci`` and ``nightly``, the report (examples, steps, events,
known peer bugs met) printed and summarised. A peer that is not installed skips (fails
under ``CI=true``).
"""

from __future__ import annotations

import pytest

from tests.stateful.harness import run_machine
from tests.stateful.machine import machine_for
from tests.stateful.subjects.nano_vllm import NANO_VLLM
from tests.stateful.subjects.tokenspeed import TOKENSPEED
from tests.stateful.subjects.transformers_cb import TRANSFORMERS_CB
from tests.stateful.subjects.vllm_v0 import VLLM_V0
from tests.stateful.subjects.vllm_v1 import VLLM, VLLM_PREFIX

#: A new peer: its subject file (tests/stateful/subjects/) and a line here.
PEER_MACHINES = {
    subject.name: machine_for(subject)
    for subject in (VLLM, VLLM_PREFIX, NANO_VLLM, VLLM_V0, TRANSFORMERS_CB, TOKENSPEED)
}


@pytest.mark.parametrize("name", sorted(PEER_MACHINES))
def test_peer_machine(name: str) -> None:
    run_machine(PEER_MACHINES[name])
