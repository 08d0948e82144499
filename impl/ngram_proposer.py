"""The engine's drafter: prompt lookup, vLLM's speculative ``method: "ngram"``.

The n-gram is the longest suffix of the request's tokens, ``prompt_lookup_min`` to
``prompt_lookup_max`` long, that also occurs earlier, ending before the last token;
its earliest occurrence is used, and the drafts are the tokens that follow it: up to
``num_speculative_tokens``, never past the end of the tokens nor past
``max_model_len``. This is the semantics of vLLM 0.32's
``_find_longest_matched_ngram_and_propose_tokens`` (v1/spec_decode/ngram_proposer.py);
the search here is the C string search of ``bytes.find`` over the tokens as int64s, one
per candidate length, longest first.
"""

from __future__ import annotations

from array import array

_WIDTH = array("q").itemsize


class NgramProposer:
    """Drafts for a request from its own tokens (prompt + outputs)."""

    def __init__(
        self,
        *,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        max_model_len: int | None = None,
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: list[int]) -> list[int]:
        """The drafts that follow the longest earlier match of a suffix of ``token_ids``
        (none if no suffix of the allowed lengths occurs earlier)."""
        total = len(token_ids)
        room = self.num_speculative_tokens
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - total)
        if total < self.prompt_lookup_min or room <= 0:
            return []
        data = array("q", token_ids).tobytes()
        # An occurrence must end before the last token: it lies in tokens[: total - 1].
        haystack = data[: (total - 1) * _WIDTH]
        for n in range(min(self.prompt_lookup_max, total - 1), self.prompt_lookup_min - 1, -1):
            needle = data[(total - n) * _WIDTH :]
            at = haystack.find(needle)
            while at != -1 and at % _WIDTH:  # a match across token boundaries is none
                at = haystack.find(needle, at + 1)
            if at != -1:
                start = at // _WIDTH + n
                return token_ids[start : start + room]
        return []
