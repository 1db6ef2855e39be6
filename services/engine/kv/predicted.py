"""The `predicted` admission policy: reserve prompt + a quantile of the predicted output length
(capped by max_tokens), learned online from finished requests.

A request that outgrows its reservation grows page by page from the pool's unpromised pages; only
when none are left is someone preempted. Reservations never exceed the pool (the pool refuses
promises it cannot keep), so admission pauses while they fill it. A re-admitted request (after
preemption) reserves the quantile conditioned on the tokens it already has.

Victim: among the requests admitted after the one that cannot grow, the one with the most predicted
work left (conditional median minus tokens generated; ties: the newest). It is the request that
would hold and grow its KV the longest, and putting the longest job last is what shortest-remaining
-first does for mean latency; the requests left running are likely to finish and free pages soon.
"""

from __future__ import annotations

import os

from services.engine.kv.predictor import Features, OutputLengthPredictor
from services.engine.sequence import Sequence

LEARN_FROM = ("stop", "length")  # natural ends; an abort's length is only a lower bound


class PredictedPolicy:
    name = "predicted"

    def __init__(self, path: str | os.PathLike[str] | None = None, quantile: float = 0.9,
                 predictor: OutputLengthPredictor | None = None, save_every: int = 256) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"predictor quantile must be in (0, 1), got {quantile}")
        self.path, self.quantile, self.save_every = path, quantile, save_every
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

    def reservation_tokens(self, seq: Sequence, max_model_len: int) -> int:
        cap = min(seq.prompt_len + seq.params.max_tokens, max_model_len)
        seq.predicted_len = self.predict_output(seq, self.quantile)
        if seq.predicted_len is None:  # no history: behave as `max`
            return cap
        return min(max(seq.prompt_len + seq.predicted_len, seq.num_tokens), cap)

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
