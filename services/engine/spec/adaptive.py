"""How many tokens each request proposes this step, by a measured rule.

Step time is fitted as a + b * tokens over recent steps (least squares), and a proposed token also
costs what proposing it took (`propose_seconds` per token, measured). A step of B decoding rows
makes B tokens in a + b * B seconds, so one proposed token costs w = (b + c) * B / (a + b * B)
tokens of that rate. A request keeps its j-th proposal with probability alpha^j (alpha: its measured
per-token acceptance), so its j-th proposal pays while alpha^j > w: it proposes the largest such j
(capped at k). Decoding at large batch is compute-bound (b * B dominates a), w nears 1 and
speculation stops by itself; at batch 1, w is small. A request that stopped proposing drifts back
toward the prior acceptance, so it tries again later."""

from __future__ import annotations

import math

import numpy as np

PRIOR_ALPHA = 0.5
PRIOR_WEIGHT = 2.0  # pseudo-trials of the prior per request
DECAY = 0.9  # per verification: older outcomes weigh less
RECOVER = 0.02  # per step without proposals: share of the way back to the prior
WINDOW = 64  # steps in the cost fit
MIN_FIT = 8


class CostModel:
    """Seconds per step as a + b * tokens: least squares over recent steps, each step's weight
    decaying by (1 - 1 / WINDOW) per step after it (running sums: O(1) per step)."""

    def __init__(self) -> None:
        self.sums = [0.0] * 5  # weight, x, y, x^2, x*y
        self.count = 0
        self.fit: tuple[float, float] | None = None

    def record(self, tokens: int, seconds: float) -> None:
        keep = 1.0 - 1.0 / WINDOW
        new = (1.0, tokens, seconds, tokens * tokens, tokens * seconds)
        self.sums = [keep * old + add for old, add in zip(self.sums, new, strict=True)]
        self.count += 1
        w, x, y, xx, xy = self.sums
        var = w * xx - x * x
        if self.count >= MIN_FIT and var > 1e-9 * w * xx:  # needs steps of different sizes
            b = (w * xy - x * y) / var
            a = (y - b * x) / w
            self.fit = (max(a, 1e-9), max(b, 0.0))

    def token_cost(self, batch: int, extra_seconds: float) -> float:
        """w: one more token in a step of `batch` rows (plus extra_seconds per token of proposing),
        in tokens of that step's output. 0 before anything is measured: speculate and measure."""
        if self.fit is None:
            return 0.0
        a, b = self.fit
        return (b + extra_seconds) * batch / (a + b * batch)


class AdaptiveK:
    def __init__(self, k: int, max_num_seqs: int, adaptive: bool = True) -> None:
        self.k, self.adaptive = k, adaptive
        self.cost = CostModel()
        self.kept = np.full(max_num_seqs, PRIOR_ALPHA * PRIOR_WEIGHT)
        self.trials = np.full(max_num_seqs, PRIOR_WEIGHT)
        self.propose_seconds = 0.0  # per proposed token, running mean

    def admit(self, slot: int) -> None:
        self.kept[slot], self.trials[slot] = PRIOR_ALPHA * PRIOR_WEIGHT, PRIOR_WEIGHT

    def alpha(self, slots: np.ndarray) -> np.ndarray:
        return np.asarray(self.kept[slots] / self.trials[slots])

    def sizes(self, slots: np.ndarray, batch: int) -> np.ndarray:
        """Proposal length per request of these slots in a step of `batch` decoding rows."""
        w = self.cost.token_cost(batch, self.propose_seconds) if self.adaptive else 0.0
        alpha = np.clip(self.alpha(slots), 1e-6, 1 - 1e-6)
        if w <= 0.0:
            return np.full(len(slots), self.k, dtype=np.int64)
        if w >= 1.0:
            return np.zeros(len(slots), dtype=np.int64)
        j = np.floor(math.log(w) / np.log(alpha))  # alpha^j > w  <=>  j < log w / log alpha
        sizes: np.ndarray = np.clip(j, 0, self.k).astype(np.int64)
        return sizes

    def observe(self, slots: np.ndarray, proposed: np.ndarray, kept: np.ndarray) -> None:
        """Outcome of one verification per slot: kept of proposed tokens (a rejection ends a run)."""
        rejected = (kept < proposed).astype(np.float64)
        self.kept[slots] = DECAY * self.kept[slots] + kept
        self.trials[slots] = DECAY * self.trials[slots] + kept + rejected

    def idle(self, slots: np.ndarray) -> None:
        """Slots that proposed nothing this step: their estimate drifts back to the prior."""
        prior = PRIOR_ALPHA * self.trials[slots]
        self.kept[slots] += RECOVER * (prior - self.kept[slots])

    def record_step(self, tokens: int, seconds: float) -> None:
        self.cost.record(tokens, seconds)

    def record_proposing(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.propose_seconds += 0.1 * (seconds / tokens - self.propose_seconds)
