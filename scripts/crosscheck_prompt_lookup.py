"""Cross-check ``spec.oracle.PromptLookupDrafter`` against vLLM's own n-gram proposer.

vLLM's ``_find_longest_matched_ngram_and_propose_tokens`` (v1/spec_decode/ngram_proposer.py)
is compiled with numba, which the peers' install leaves out; in a virtual environment
that has it (``pip install numba``)::

    python scripts/crosscheck_prompt_lookup.py --cases 20000

draws random token sequences over small vocabularies (so n-grams repeat) and random
``prompt_lookup_min/max``, ``num_speculative_tokens`` and ``max_model_len``, and counts
the cases where the two propose different drafts. Exploration, not a test.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import (
    _find_longest_matched_ngram_and_propose_tokens as vllm_propose,
)

from spec.oracle import PromptLookupDrafter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    mismatches = 0
    for _ in range(args.cases):
        vocab = rng.choice([2, 3, 4, 8])
        tokens = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 40)))
        low = rng.randint(1, 4)
        high = rng.randint(low, 6)
        k = rng.randint(1, 5)
        max_model_len = rng.randint(len(tokens), len(tokens) + 6)
        ours = PromptLookupDrafter(k, low, high, max_model_len)(tokens)
        theirs = vllm_propose(np.array(tokens, dtype=np.int32), low, high, max_model_len, k)
        if ours != tuple(int(t) for t in theirs):
            mismatches += 1
            print("differ:", tokens, low, high, k, max_model_len, ours, tuple(theirs))
    print(f"{args.cases} cases, {mismatches} with different drafts")


if __name__ == "__main__":
    main()
