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
A request that stopped proposing drifts back toward the prior acceptance, so it tries again later.

Small steps whose rows all run compiled (one compiled unit per row count, executor/) are not
linear in their rows: on the CPU a matrix product of 3 rows costs what 1 row does and one of 4 about
twice that. Their cost is measured per row count instead (the whole engine step's time), and when
every verifying request's rows fit there, one proposal size for the step is chosen outright: the
one with the most expected tokens per second. A row count not measured yet is taken to cost what the most
expensive smaller one measured does (costs grow with rows), so each is tried once. An n-gram lookup
finds nothing on many steps: a step then costs a plain step plus the lookup, and gains nothing, so
the expected gain and cost of proposing are weighed by each request's measured hit rate."""

from __future__ import annotations

import math

import numpy as np

PRIOR_ALPHA = 0.5
PRIOR_WEIGHT = 2.0  # pseudo-trials of the prior per request
PRIOR_HIT = 0.5  # hit rates drift back to this while resting (so requests try again)
DECAY = 0.9  # per verification: older outcomes weigh less
RECOVER = 0.02  # per step without proposals: share of the way back to the prior
HIT_RECOVER = 0.002  # the same for the hit rate: a failed lookup costs more than a rejected token
HOLD = 8  # steps the rule rests at a batch size after finding that no request there gains
MAX_HOLD = 64  # consecutive rests at one batch size double, up to this many steps, or
REST_SECONDS = 0.05  # this long in plain steps, when more: a decision's host work (lookups, the
# rule, a trial verification) is a fixed cost, a small share of a rest only if the rest is long
# enough in time, and a step may be a tenth of a millisecond
WINDOW = 64  # steps: a step's weight in the cost fit decays by 1 - 1 / WINDOW per later step
MIN_FIT = 8
REFIT = 16  # steps between solves of the fit
RIDGE = 1e-6  # keeps b and c at 0 until steps differ in them
ROWS_DECAY = 0.1  # per measurement of a row count: the weight of the newest
ROWS_CLIP = 1.25  # a measurement above this many times its row count's mean counts as this


class CostModel:
    """Seconds per step as a + b * tokens + c * verifying requests: decaying least squares (running
    normal equations), refitted when read and REFIT steps came since. Recording is a list append
    and a few float operations: it runs on every step outside the rule's rests."""

    def __init__(self, exact_rows: int = 0) -> None:
        """exact_rows: steps of up to this many rows, all decode or verification rows, are costed
        per row count (they run compiled); 0: none."""
        self.xtx = np.zeros((3, 3))
        self.xty = np.zeros(3)
        self.count = 0
        self._pending: list[tuple[float, int, int, float]] = []  # (1, tokens, verifying, seconds)
        self._fit: tuple[float, float, float] | None = None
        # Plain lists: a float operation on a list item costs a fraction of one on a numpy scalar.
        self.by_rows = [0.0] * (exact_rows + 1)  # seconds, decaying mean; 0: not measured
        self.rows_seen = [0] * (exact_rows + 1)

    def record_rows(self, rows: int, seconds: float) -> None:
        """A step of `rows` decode and verification rows (no prefill) took `seconds` in all."""
        if 0 < rows < len(self.by_rows):
            # A row count's first step may have compiled its unit: it is left out.
            seen = self.rows_seen[rows] = self.rows_seen[rows] + 1
            mean = self.by_rows[rows]
            if seen == 2:
                self.by_rows[rows] = seconds
            elif seen > 2:
                # A step the host stalled in (another process on the core, a collection) counts as
                # at most ROWS_CLIP times the mean: rare row counts would otherwise carry it long.
                self.by_rows[rows] = mean + ROWS_DECAY * (min(seconds, ROWS_CLIP * mean) - mean)

    def record(self, tokens: int, verifying: int, seconds: float) -> None:
        """A step of `tokens` rows, `verifying` requests verifying, whose model pass and sampling
        took `seconds` (proposing has its own per-token term)."""
        self._pending.append((1.0, tokens, verifying, seconds))
        self.count += 1
        if len(self._pending) >= WINDOW * 4:  # nobody read the fit for a while: bound the list
            self._fold()

    @property
    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c), None before MIN_FIT steps. Folding the pending steps in is one batch of array
        work every REFIT steps, and only when the rule looks (a resting rule never does)."""
        if len(self._pending) >= REFIT:
            self._fold()
        return self._fit

    def _fold(self) -> None:
        steps = np.array(self._pending)
        self._pending.clear()
        x, y = steps[:, :3], steps[:, 3]
        keep = 1.0 - 1.0 / WINDOW
        weights = keep ** np.arange(len(steps) - 1, -1, -1)  # the newest step weighs 1
        self.xtx = keep ** len(steps) * self.xtx + (x.T * weights) @ x
        self.xty = keep ** len(steps) * self.xty + (x.T * weights) @ y
        if self.count >= MIN_FIT:
            ridge = RIDGE * np.diag([0.0, 1.0, 1.0]) * self.xtx[0, 0]
            a, b, c = np.linalg.solve(self.xtx + ridge, self.xty).tolist()
            self._fit = (max(a, 1e-9), max(b, 0.0), max(c, 0.0))

    def costs(self, batch: int, extra_seconds: float) -> tuple[float, float] | None:
        """(w, v): one more token in a step of `batch` rows (plus extra_seconds per token of
        proposing), and a request's verifying at all, in tokens of that step's output. None before
        anything is measured."""
        fit = self.fit
        if fit is None:
            return None
        a, b, c = fit
        rate = batch / (a + b * batch)
        return (b + extra_seconds) * rate, c * rate

    def exact(self, rows: int) -> bool:
        return rows < len(self.by_rows)

    def exact_mask(self, rows: np.ndarray) -> np.ndarray:
        inside: np.ndarray = rows < len(self.by_rows)
        return inside

    def plain_seconds(self, batch: int) -> float | None:
        """Seconds of a plain step of `batch` decoding rows: its row count's measurement, else the
        fit; None before either."""
        if batch < len(self.by_rows) and self.by_rows[batch] > 0:
            return self.by_rows[batch]
        fit = self.fit
        return None if fit is None else fit[0] + fit[1] * batch

    def seconds_by_rows(self, rows: np.ndarray) -> np.ndarray:
        """Measured seconds of compiled steps of these row counts (each < len(by_rows)); one not
        measured yet: the most any smaller count measured (0 when none did: try it)."""
        by_rows = np.asarray(self.by_rows)
        floor = np.maximum.accumulate(by_rows)
        measured: np.ndarray = np.where(by_rows[rows] > 0, by_rows[rows], floor[rows])
        return measured


class AdaptiveK:
    def __init__(self, k: int, max_num_seqs: int, adaptive: bool = True, exact_rows: int = 0) -> None:
        """exact_rows: as CostModel's."""
        self.k, self.adaptive = k, adaptive
        self.cost = CostModel(exact_rows)
        self.kept = np.full(max_num_seqs, PRIOR_ALPHA * PRIOR_WEIGHT)
        self.trials = np.full(max_num_seqs, PRIOR_WEIGHT)
        self.hits = np.full(max_num_seqs, PRIOR_HIT * PRIOR_WEIGHT)  # lookups that found a proposal
        self.asks = np.full(max_num_seqs, PRIOR_WEIGHT)
        self.propose_seconds = 0.0  # per proposed token, running mean
        self.miss_seconds = 0.0  # a lookup that found nothing, running mean
        self.hit_rate = 1.0  # of every request's lookups, running mean: a new request's prior
        self.resting, self.rest_batch = 0, 0  # steps left of a rest, at that batch size
        self.steps = 0  # steps begun (rests())
        self.rest_steps = 0  # the length of the last rest; 0 once a proposal was kept since
        self._best: dict[tuple[int, int], tuple[int, int]] = {}  # (batch, requests): (size, epoch)

    def admit(self, slot: int) -> None:
        self.kept[slot], self.trials[slot] = PRIOR_ALPHA * PRIOR_WEIGHT, PRIOR_WEIGHT
        self.hits[slot], self.asks[slot] = self.hit_rate * PRIOR_WEIGHT, PRIOR_WEIGHT

    def alpha(self, slots: np.ndarray) -> np.ndarray:
        return np.asarray(self.kept[slots] / self.trials[slots])

    def sizes(self, slots: np.ndarray, batch: int) -> np.ndarray:
        """Proposal length per request of these slots in a step of `batch` decoding rows."""
        if not self.adaptive:
            return np.full(len(slots), self.k, dtype=np.int64)
        costs = self.cost.costs(batch, self.propose_seconds)
        if costs is None:  # nothing measured yet: speculate, and measure
            return np.full(len(slots), self.k, dtype=np.int64)
        if self.cost.exact(batch + len(slots)):
            # Decided once every REFIT steps (a step's host work stays small).
            key, epoch = (batch, len(slots)), self.steps // REFIT
            size, decided = self._best.get(key, (0, -1))
            if decided != epoch:
                hit = float((self.hits[slots] / self.asks[slots]).mean())
                size = self.best_size(np.clip(self.alpha(slots), 1e-6, 1 - 1e-6), batch, hit)
                self._best[key] = (size, epoch)
            return np.full(len(slots), size, dtype=np.int64)
        alpha = np.clip(self.alpha(slots), 1e-6, 1 - 1e-6)
        w, v = costs
        if w >= 1.0:
            return np.zeros(len(slots), dtype=np.int64)
        # alpha^j > w  <=>  j < log w / log alpha
        j = np.clip(np.floor(math.log(max(w, 1e-12)) / np.log(alpha)), 0, self.k)
        kept = alpha * (1 - alpha**j) / (1 - alpha)  # expected kept tokens of j proposals
        sizes: np.ndarray = np.where(kept > j * w + v, j, 0).astype(np.int64)
        return sizes

    def off(self, batch: int) -> bool:
        """Whether no request could gain in a step of `batch` decoding rows, not even the one with
        the best acceptance (then every request's estimate drifts toward the prior, as idle does).
        Then the rule rests (rests())."""
        costs = self.cost.costs(batch, self.propose_seconds) if self.adaptive else None
        if costs is None:
            return False
        if self.cost.exact(batch + 1):  # sizes decides, as cheaply
            return False
        w, v = costs
        alpha = min(float((self.kept / self.trials).max()), 1 - 1e-6)
        if any(alpha * (1 - alpha**j) / (1 - alpha) > j * w + v for j in range(1, self.k + 1)):
            return False
        self.rest(np.arange(self.kept.size), batch)
        return True

    def rests(self, batch: int) -> bool:
        """A step of `batch` decoding rows begins: whether it falls in a rest, where there is
        nothing to decide, propose or learn from. After finding that no request gains at a batch
        size, the next steps at that size rest (HOLD of them, doubling with each rest in a row up to
        MAX_HOLD; the drift of those steps applied at once): a step's host work stays small."""
        self.steps += 1
        if self.resting:
            if batch == self.rest_batch:
                self.resting -= 1
                return True
            self.resting = 0
        return False

    def best_size(self, alpha: np.ndarray, batch: int, hit: float) -> int:
        """The one proposal size j (0..k) for requests of acceptance alpha [n] in a step of `batch`
        decoding rows that makes the most expected tokens per second, from the per-row-count costs
        (batch + n * k rows may exceed them: larger sizes are left out). hit: the share of steps
        whose lookups find proposals; the others cost a plain step and the failed lookup."""
        sizes = np.arange(self.k + 1)
        rows = batch + alpha.size * sizes
        inside = self.cost.exact_mask(rows)
        sizes, rows = sizes[inside], rows[inside]
        kept = (alpha[None, :] * (1 - alpha[None, :] ** sizes[:, None]) / (1 - alpha[None, :])).sum(1)
        seconds = self.cost.seconds_by_rows(rows)
        if not seconds.all():  # a row count never measured: try it
            return int(sizes[np.argmin(seconds)])
        # Size 0 is a plain step (rows == batch), without lookups.
        expected = np.where(sizes > 0, hit * seconds + (1 - hit) * (seconds[0] + self.miss_seconds), seconds)
        return int(sizes[np.argmax((batch + hit * kept) / expected)])

    def observe(self, slots: np.ndarray, proposed: np.ndarray, kept: np.ndarray) -> None:
        """Outcome of one verification per slot: kept of proposed tokens (a rejection ends a run)."""
        rejected = (kept < proposed).astype(np.float64)
        if kept.any():  # speculation paid somewhere: rests start short again
            self.rest_steps = 0
        self.kept[slots] = DECAY * self.kept[slots] + kept
        self.trials[slots] = DECAY * self.trials[slots] + kept + rejected

    def idle(self, slots: np.ndarray, steps: int = 1) -> None:
        """Slots that proposed nothing this step (for `steps` steps): their estimate drifts back to
        the prior."""
        share = 1 - (1 - RECOVER) ** steps
        self.kept[slots] += share * (PRIOR_ALPHA * self.trials[slots] - self.kept[slots])
        share = 1 - (1 - HIT_RECOVER) ** steps
        self.hits[slots] += share * (PRIOR_HIT * self.asks[slots] - self.hits[slots])

    def rest(self, slots: np.ndarray, batch: int) -> None:
        """No request of these slots gains at `batch` decoding rows: rests(batch) holds for the next
        steps (HOLD, or twice the last rest's when it was at this batch size too, up to MAX_HOLD
        steps or REST_SECONDS of plain steps, the longer), and the slots drift as over those idle
        steps."""
        again = batch == self.rest_batch and self.rest_steps > 0
        plain = self.cost.plain_seconds(batch)
        longest = MAX_HOLD if not plain else max(MAX_HOLD, int(REST_SECONDS / plain))
        steps = min(2 * self.rest_steps, longest) if again else HOLD
        self.idle(slots, steps)
        # The engine's hit rate recovers ten times slower still: it is every new request's prior.
        self.hit_rate += (1 - (1 - HIT_RECOVER / 10) ** steps) * (PRIOR_HIT - self.hit_rate)
        self.resting, self.rest_batch, self.rest_steps = steps - 1, batch, steps

    def record_step(self, tokens: int, verifying: int, seconds: float) -> None:
        self.cost.record(tokens, verifying, seconds)

    def record_rows(self, rows: int, seconds: float) -> None:
        self.cost.record_rows(rows, seconds)

    def record_lookups(self, slots: np.ndarray, hit: np.ndarray, tokens: int, seconds: float) -> None:
        """Proposing for these slots took `seconds` and proposed `tokens` tokens; hit [n] bool: the
        slots that got a proposal."""
        self.hits[slots] = DECAY * self.hits[slots] + hit
        self.asks[slots] = DECAY * self.asks[slots] + 1
        self.hit_rate += 0.05 * (float(hit.mean()) - self.hit_rate)
        if tokens:
            self.propose_seconds += 0.1 * (seconds / tokens - self.propose_seconds)
        else:
            self.miss_seconds += 0.1 * (seconds - self.miss_seconds)
