"""How many tokens each request proposes this step, by a measured rule.

Step time is fitted as a + b * tokens + c * verifying requests over recent steps (least squares):
besides its tokens, a request that verifies costs its own attention call per layer and its share of
the verification's bookkeeping. Proposing costs p seconds per proposed token (measured). A step of B
decoding rows makes B tokens in a + b * B seconds, so a proposed token costs w = (b + p) * B /
(a + b * B) tokens of that rate, and verifying at all v = c * B / (a + b * B). A request keeps its
j-th proposal with probability alpha^j (alpha: its measured per-token acceptance), so the j-th
proposal pays while alpha^j > w: it proposes the largest such j (capped at k), and none unless
the expected kept tokens, alpha + ... + alpha^j, exceed j * w + v. Decoding at large batch is
compute-bound (b * B dominates a), w nears 1 and speculation stops by itself; at batch 1 w is small.
A request that stopped proposing drifts back toward the prior acceptance, so it tries again later."""

from __future__ import annotations

import math

import numpy as np

PRIOR_ALPHA = 0.5
PRIOR_WEIGHT = 2.0  # pseudo-trials of the prior per request
DECAY = 0.9  # per verification: older outcomes weigh less
RECOVER = 0.02  # per step without proposals: share of the way back to the prior
WINDOW = 64  # steps: a step's weight in the cost fit decays by 1 - 1 / WINDOW per later step
MIN_FIT = 8
REFIT = 4  # steps between solves of the fit
RIDGE = 1e-6  # keeps b and c at 0 until steps differ in them


class CostModel:
    """Seconds per step as a + b * tokens + c * verifying requests: decaying least squares (running
    normal equations, O(1) per step)."""

    def __init__(self) -> None:
        self.xtx = np.zeros((3, 3))
        self.xty = np.zeros(3)
        self.count = 0
        self.fit: tuple[float, float, float] | None = None

    def record(self, tokens: int, verifying: int, seconds: float) -> None:
        x = np.array([1.0, tokens, verifying])
        keep = 1.0 - 1.0 / WINDOW
        self.xtx = keep * self.xtx + np.outer(x, x)
        self.xty = keep * self.xty + seconds * x
        self.count += 1
        if self.count >= MIN_FIT and self.count % REFIT == 0:
            ridge = RIDGE * np.diag([0.0, 1.0, 1.0]) * self.xtx[0, 0]
            a, b, c = np.linalg.solve(self.xtx + ridge, self.xty).tolist()
            self.fit = (max(a, 1e-9), max(b, 0.0), max(c, 0.0))

    def costs(self, batch: int, extra_seconds: float) -> tuple[float, float] | None:
        """(w, v): one more token in a step of `batch` rows (plus extra_seconds per token of
        proposing), and a request's verifying at all, in tokens of that step's output. None before
        anything is measured."""
        if self.fit is None:
            return None
        a, b, c = self.fit
        rate = batch / (a + b * batch)
        return (b + extra_seconds) * rate, c * rate


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
        if not self.adaptive:
            return np.full(len(slots), self.k, dtype=np.int64)
        costs = self.cost.costs(batch, self.propose_seconds)
        if costs is None:  # nothing measured yet: speculate, and measure
            return np.full(len(slots), self.k, dtype=np.int64)
        w, v = costs
        if w >= 1.0:
            return np.zeros(len(slots), dtype=np.int64)
        alpha = np.clip(self.alpha(slots), 1e-6, 1 - 1e-6)
        # alpha^j > w  <=>  j < log w / log alpha
        j = np.clip(np.floor(math.log(max(w, 1e-12)) / np.log(alpha)), 0, self.k)
        kept = alpha * (1 - alpha**j) / (1 - alpha)  # expected kept tokens of j proposals
        sizes: np.ndarray = np.where(kept > j * w + v, j, 0).astype(np.int64)
        return sizes

    def off(self, batch: int) -> bool:
        """Whether no request could gain in a step of `batch` decoding rows, not even the one with
        the best acceptance (then every request's estimate drifts toward the prior, as idle does)."""
        costs = self.cost.costs(batch, self.propose_seconds) if self.adaptive else None
        if costs is None:
            return False
        w, v = costs
        alpha = min(float((self.kept / self.trials).max()), 1 - 1e-6)
        if any(alpha * (1 - alpha**j) / (1 - alpha) > j * w + v for j in range(1, self.k + 1)):
            return False
        self.kept += RECOVER * (PRIOR_ALPHA * self.trials - self.kept)
        return True

    def observe(self, slots: np.ndarray, proposed: np.ndarray, kept: np.ndarray) -> None:
        """Outcome of one verification per slot: kept of proposed tokens (a rejection ends a run)."""
        rejected = (kept < proposed).astype(np.float64)
        self.kept[slots] = DECAY * self.kept[slots] + kept
        self.trials[slots] = DECAY * self.trials[slots] + kept + rejected

    def idle(self, slots: np.ndarray) -> None:
        """Slots that proposed nothing this step: their estimate drifts back to the prior."""
        prior = PRIOR_ALPHA * self.trials[slots]
        self.kept[slots] += RECOVER * (prior - self.kept[slots])

    def record_step(self, tokens: int, verifying: int, seconds: float) -> None:
        self.cost.record(tokens, verifying, seconds)

    def record_proposing(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.propose_seconds += 0.1 * (seconds / tokens - self.propose_seconds)
