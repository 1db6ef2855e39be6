"""The `predicted` admission policy: admit by the predicted output length (a quantile of the learned
distribution, capped by max_tokens), grow past it from the free pool, and preempt only when the pool
is exhausted.

Two ways to hold the prediction against the pool:
- "peak" (default): each request's predicted size, prompt + predicted output, is accounted over time.
  Sorting the running requests and the candidate by predicted tokens left, the pool must hold, at
  each predicted finish, every request still alive at its size then; admission pauses while that
  peak exceeds the pool (LightLLM's past-future check, fed by our predictor). Reserving whole final
  sizes up front ("reserve") also counts KV a request will only fill late, and that a request
  finishing earlier will have handed back by then; on the mixed Azure trace that slack (11-14% of
  the reserved KV) cost more capacity than optimistic admission loses to preemption.
- "reserve": the pool itself promises prompt + predicted output to each request.
With no history every prediction is max_tokens: "reserve" is then exactly `max`, and "peak" admits
only what would fit if every request ran to its max_tokens.

A preempted request is re-predicted conditioned on the tokens it already has; so is a running
request that outgrows its prediction.

Victim: among the requests admitted after the one that cannot grow, the one with the most predicted
work left (conditional median minus tokens generated; ties: the newest). It would hold and grow its
KV the longest, and putting the longest job last is what shortest-remaining-first does for mean
latency; the requests left running are likely to finish and free pages soon.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Sequence_

import numpy as np

from pipeserve.config import PREDICTOR_MODES
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.kv.predictor import Features, OutputLengthPredictor
from pipeserve.engine.sequence import Sequence

LEARN_FROM = ("stop", "length")  # natural ends; an abort's length is only a lower bound
MODES = PREDICTOR_MODES


class PredictedPolicy:
    name = "predicted"

    def __init__(self, path: str | os.PathLike[str] | None = None, quantile: float = 0.9,
                 predictor: OutputLengthPredictor | None = None, mode: str = "peak",
                 save_every: int = 256) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"predictor quantile must be in (0, 1), got {quantile}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.path, self.quantile, self.mode, self.save_every = path, quantile, mode, save_every
        self.predictor = predictor if predictor is not None else OutputLengthPredictor.load(path)
        self._unsaved = 0

    def predict_output(self, seq: Sequence, q: float) -> int | None:
        """Output tokens the request will have in total, at quantile q given what it has generated;
        None when the predictor has no history for it."""
        p = seq.params
        if p.ignore_eos:
            return p.max_tokens
        out = self.predictor.predict(Features.of(seq), q, above=seq.num_output)
        if out is None:
            return None
        return min(max(out, p.min_tokens, seq.num_output + 1), p.max_tokens)

    def final_tokens(self, seq: Sequence, max_model_len: int) -> int:
        """Predicted prompt + output tokens (seq.predicted_len refreshed once the request outgrows it)."""
        if seq.predicted_len is None or seq.num_output >= seq.predicted_len:
            seq.predicted_len = self.predict_output(seq, self.quantile)
        cap = min(seq.prompt_len + seq.params.max_tokens, max_model_len)
        if seq.predicted_len is None:  # no history: behave as `max`
            return cap
        return min(max(seq.prompt_len + seq.predicted_len, seq.num_tokens), cap)

    def reservation_tokens(self, seq: Sequence, max_model_len: int) -> int:
        seq.predicted_len = None  # (re)admission: predict afresh from what it has now
        final = self.final_tokens(seq, max_model_len)
        return final if self.mode == "reserve" else seq.num_tokens

    def admits(self, seq: Sequence, running: list[Sequence], pool: KVPool, max_model_len: int,
               cached: Sequence_[int] = ()) -> bool:
        if self.mode != "peak" or not running:
            return True
        n = len(running) + 1
        cur = np.empty(n, dtype=np.int64)
        left = np.empty(n, dtype=np.int64)
        for i, s in enumerate((*running, seq)):
            cur[i] = s.num_tokens
            left[i] = self.final_tokens(s, max_model_len) - s.num_tokens
        cur -= pool.page_size * self._shared_elsewhere([*(s.pages for s in running), cached], left)
        order = np.argsort(left, kind="stable")
        cur, left = cur[order], left[order]
        alive = np.arange(n, 0, -1)
        # Tokens held just before the k-th shortest finishes, when requests k.. are all still alive;
        # page rounding adds at most page_size - 1 per request.
        held = np.cumsum(cur[::-1])[::-1] + alive * (left + pool.page_size - 1)
        return int(held.max()) <= pool.num_pages * pool.page_size

    @staticmethod
    def _shared_elsewhere(pages: list[Sequence_[int]], left: np.ndarray) -> np.ndarray:
        """Per request, its pages that a prefix-sharing request finishing later also holds. A shared
        page stays in the pool until its last holder finishes, so only that holder is charged for it."""
        counts = [len(p) for p in pages]
        if not sum(counts):
            return np.zeros(len(pages), dtype=np.int64)
        page = np.concatenate([np.asarray(p, dtype=np.int64) for p in pages])
        owner = np.repeat(np.arange(len(pages)), counts)
        order = np.lexsort((left[owner], page))  # by page, its latest-finishing holder last
        page, owner = page[order], owner[order]
        charged_elsewhere = np.append(page[1:] == page[:-1], False)
        return np.bincount(owner[charged_elsewhere], minlength=len(pages)).astype(np.int64)

    def remaining_work(self, seq: Sequence) -> int:
        out = self.predict_output(seq, 0.5)
        return (seq.params.max_tokens if out is None else out) - seq.num_output

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        return max(reversed(running), key=self.remaining_work)  # max keeps the first: the newest

    def on_finish(self, seq: Sequence) -> None:
        if seq.finish_reason not in LEARN_FROM or seq.num_output < 1:
            return
        self.predictor.update(Features.of(seq), seq.num_output)
        self._unsaved += 1
        if self.path is not None and self._unsaved >= self.save_every:
            self.save()

    def save(self) -> None:
        if self.path is not None:
            self.predictor.save(self.path)
            self._unsaved = 0
