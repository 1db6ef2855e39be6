"""N-gram prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
sequence's longest suffix (between `min_n` and `max_n` tokens) in its prompt and output. Free to
compute and deterministic, so verification keeps exactly the tokens decoding would emit."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to k tokens continuing token_ids (prompt + output so far), or [] with no match."""
        tokens = np.asarray(token_ids)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = tokens[size - n :]
            # Windows starting before the suffix itself, so at least one token follows each.
            windows = sliding_window_view(tokens[: size - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                proposal: list[int] = tokens[start : start + k].tolist()
                return proposal
        return []
