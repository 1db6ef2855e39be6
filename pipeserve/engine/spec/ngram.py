"""N-gram prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
sequence's longest suffix (between `min_n` and `max_n` tokens) in its prompt and output. Free to
compute and deterministic, so verification keeps exactly the tokens decoding would emit."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens continuing token_ids (prompt + output so far), or [] with no match."""
        tokens = np.asarray(token_ids)
        size = len(tokens)
        # Candidate ends of an earlier match: positions holding the newest token (not the newest
        # itself); each round keeps those whose match extends one token further back.
        ends = np.flatnonzero(tokens[: size - 1] == tokens[-1])
        best = ends if self.min_n <= 1 else ends[:0]
        for n in range(2, min(self.max_n, size - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[size - n]]
            if not ends.size:
                break
            if n >= self.min_n:
                best = ends
        if not best.size:
            return []
        start = int(best[-1]) + 1  # the latest of the longest matches
        proposal: list[int] = tokens[start : start + k].tolist()
        return proposal
