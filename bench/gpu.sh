#!/usr/bin/env bash
# Every benchmark on the GPU (about 8 minutes on one recent GPU); output in bench-gpu.txt.
# Usage: bench/gpu.sh [extra run_all arguments, e.g. --quick]
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python -m bench.run_all --device cuda "$@" 2>&1 | tee "${OUT:-.}/bench-gpu.txt"
