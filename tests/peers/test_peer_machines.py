"""The peer machines (tests/peers/machine.py): vLLM V1's and nano-vllm's real schedulers
against the spec under their semantics profiles, every step, on the suite's rules.

Run like the stateful suite (tests/stateful/harness.py): sized per Hypothesis profile
(tests/stateful/profiles.py), coverage asserted under ``ci`` and ``nightly``, the
report (examples, steps, events, known peer bugs met) printed and summarised.
"""

from __future__ import annotations

from hypothesis import settings

from tests.peers.conftest import require_peer
from tests.peers.machine import (
    REQUIRED_NANO,
    REQUIRED_VLLM,
    REQUIRED_VLLM_PREFIX,
    PeerMachine,
    PrefixPeerMachine,
)
from tests.stateful.harness import run_differential
from tests.stateful.profiles import SUPPRESSED


@settings(deadline=None, suppress_health_check=SUPPRESSED)
class VllmMachine(PeerMachine):
    NAME = "VllmMachine"
    PEER = "vllm"


@settings(deadline=None, suppress_health_check=SUPPRESSED)
class VllmPrefixMachine(PrefixPeerMachine):
    NAME = "VllmPrefixMachine"
    PEER = "vllm"


@settings(deadline=None, suppress_health_check=SUPPRESSED)
class NanoVllmMachine(PrefixPeerMachine):
    NAME = "NanoVllmMachine"
    PEER = "nano-vllm"


def test_vllm_machine() -> None:
    require_peer("vllm")
    run_differential(VllmMachine, REQUIRED_VLLM)


def test_vllm_prefix_machine() -> None:
    require_peer("vllm")
    run_differential(VllmPrefixMachine, REQUIRED_VLLM_PREFIX)


def test_nano_vllm_machine() -> None:
    require_peer("nano-vllm")
    run_differential(NanoVllmMachine, REQUIRED_NANO)
