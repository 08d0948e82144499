"""The environment scripts/campaign sets for its workers and replays (tests/campaign).

Plain names only: scripts/campaign reads them without importing pytest or Hypothesis.
"""

from typing import Final

DB: Final = "KVSCHED_CAMPAIGN_DB"  # the database URL
#: Set for a replay: the revision key to read (read only). Unset: this tree's, read-write.
REPLAY: Final = "KVSCHED_CAMPAIGN_REPLAY"
STATS: Final = "KVSCHED_CAMPAIGN_STATS"  # the worker's progress file (tests/campaign/progress.py)
WORKER: Final = "KVSCHED_CAMPAIGN_WORKER"  # its index on this machine
WORKERS: Final = "KVSCHED_CAMPAIGN_WORKERS"  # how many workers this machine runs
SEED: Final = "KVSCHED_CAMPAIGN_SEED"  # the worker's seed: its runs' seeds derive from it
DEADLINE: Final = "KVSCHED_CAMPAIGN_DEADLINE"  # Unix time; absent: run until stopped
SLICE: Final = "KVSCHED_CAMPAIGN_SLICE"  # seconds per machine per turn; absent: automatic
REVISION: Final = "KVSCHED_CAMPAIGN_REVISION"  # the revision key the campaign computed
