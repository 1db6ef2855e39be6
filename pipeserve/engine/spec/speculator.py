"""The engine's speculative decoding, one step at a time: before scheduling, size each decoding
request's proposal (adaptive.py) and propose (n-gram lookup or the draft model); after the verified
step, learn from what was kept, roll the draft's cache back to it, and count.

Requests that opt out (`SamplingParams.speculative = False`), and those whose next token depends on
more than the target's distribution at one position (penalties, structured outputs) or that ask for
logprobs, decode normally in the same batch."""

from __future__ import annotations

import time

import numpy as np

from pipeserve.engine.sampler import MIN_TEMPERATURE
from pipeserve.engine.scheduler import ScheduledBatch
from pipeserve.engine.sequence import Sequence, Status

from .adaptive import AdaptiveK
from .draft import DraftModel
from .ngram import NgramProposer
from .verifier import UNREAD, DraftProposals


def speculates(seq: Sequence) -> bool:
    p = seq.params
    return (
        p.speculative
        and not p.constrained
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
    )


class Speculator:
    def __init__(self, *, k: int, max_num_seqs: int, max_model_len: int, adaptive: bool = True,
                 ngram: NgramProposer | None = None, draft: DraftModel | None = None,
                 exact_rows: int = 0) -> None:
        """exact_rows: steps of up to this many decode and verification rows run compiled, one unit
        per row count (the adaptive rule costs them per row count)."""
        assert (ngram is None) != (draft is None), "one proposer"
        self.ngram, self.draft = ngram, draft
        self.max_model_len = max_model_len
        self.adaptive = AdaptiveK(k, max_num_seqs, adaptive, exact_rows)
        self._proposed: list[Sequence] = []
        self._proposing = 0.0  # seconds the last propose took
        self._rows, self._verifying = 0, False  # the step's rows (0: not costed by row count)
        self._resting = False  # the step falls in a rest of the rule: nothing to learn from it
        self.num_draft_tokens = 0  # proposed tokens that were verified
        self.num_accepted_tokens = 0
        self.num_verifications = 0  # (request, step) pairs verified: accepted / this = mean run

    # -- around the scheduler -------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> tuple[dict[Sequence, list[int]], DraftProposals | None]:
        # Inside a rest at this many running requests (decoding ones, unless one is prefilling,
        # which a rest may count too): nothing more. A step may be a tenth of a millisecond.
        if self.adaptive.resting and len(running) == self.adaptive.rest_batch:
            self._resting, self._proposed, self._proposing = self.adaptive.rests(len(running)), [], 0.0
            return {}, None
        start = time.perf_counter()
        proposed = self._propose(running, start)
        self._proposing = time.perf_counter() - start
        return proposed

    def _propose(self, running: list[Sequence],
                 start: float) -> tuple[dict[Sequence, list[int]], DraftProposals | None]:
        decoding = [s for s in running if s.status is Status.RUNNING and s.num_uncomputed == 1]
        self._proposed = []
        # Most steps where speculation does not pay: a rest costs a few attribute reads per step.
        self._resting = bool(decoding) and self.adaptive.rests(len(decoding))
        if not decoding or self._resting or self.adaptive.off(len(decoding)):
            return {}, None
        eligible = [s for s in decoding if speculates(s)]
        if not eligible:
            return {}, None
        slots = np.fromiter((s.slot for s in eligible), np.int64, len(eligible))
        rule = self.adaptive.sizes(slots, len(decoding)).tolist()
        if not any(rule):  # no request gains at this batch size: rest there a few steps
            self.adaptive.rest(slots, len(decoding))
            return {}, None
        # Tokens past max_tokens or the context are never emitted: no use proposing them.
        sizes = [max(0, min(n, s.params.max_tokens - s.num_output - 1, self.max_model_len - s.num_tokens - 1))
                 for s, n in zip(eligible, rule, strict=True)]
        if not all(sizes):
            self.adaptive.idle(slots[np.asarray(sizes) == 0])
        drafts = None
        proposals: dict[Sequence, list[int]] = {}
        if self.ngram is not None:
            for seq, n in zip(eligible, sizes, strict=True):
                proposal = self.ngram.propose(seq.token_ids, n) if n else []
                if proposal:
                    proposals[seq] = proposal
        else:
            # A sampled request draws one token more than it proposes and always verifies, so each
            # of its tokens is decided by rejection sampling whatever the size (acceptance.py).
            assert self.draft is not None
            sampled = np.fromiter((s.params.temperature >= MIN_TEMPERATURE for s in eligible), bool,
                                  len(eligible))
            rounds = np.asarray(sizes) + sampled
            chosen = [s for s, n in zip(eligible, rounds, strict=True) if n > 0]
            # The draws stay on the device (verification reads them): the scheduler needs their count.
            drew, drafts = self.draft.propose(chosen, rounds[rounds > 0])
            for seq, n, extra in zip(eligible, sizes, sampled.tolist(), strict=True):
                count = drew.get(seq, 0)
                if count:
                    proposals[seq] = [UNREAD] * min(n, count - extra)
        self._proposed = list(proposals)
        asked = [i for i, n in enumerate(sizes) if n]
        if asked:
            hit = np.fromiter((eligible[i] in proposals for i in asked), bool, len(asked))
            self.adaptive.record_lookups(slots[asked], hit, sum(map(len, proposals.values())),
                                         time.perf_counter() - start)
        return proposals, drafts

    def observe(self, batch: ScheduledBatch, accepted: list[list[int]] | None, seconds: float) -> None:
        """After the runner (`seconds`), before postprocessing (the requests' token lists are still
        the step's input): learn the runner's cost and each verified request's outcome. A step in
        a rest is left out (the plain steps measured between rests are enough)."""
        if self._resting:
            return
        tokens = batch.num_tokens
        self.adaptive.record_step(tokens, len(batch.verify), seconds)
        # Row counts are costed by the whole step (finish): verifying steps' bookkeeping included.
        self._rows = 0 if batch.prefill else tokens
        self._verifying = bool(batch.verify)
        if not self._verifying and not self._proposed:  # a plain step: nothing more to learn
            return
        verified: dict[Sequence, int] = {}
        if batch.verify:
            assert accepted is not None
            nd = len(batch.decode)
            kept = np.fromiter((len(a) for a in accepted[nd : nd + len(batch.verify)]), np.int64)
            lens = np.fromiter((len(p) for p in batch.proposals), np.int64, len(batch.proposals))
            slots = np.fromiter((s.slot for s in batch.verify), np.int64, len(batch.verify))
            self.adaptive.observe(slots, lens, kept)
            self.num_draft_tokens += int(lens.sum())
            self.num_accepted_tokens += int(kept.sum())
            self.num_verifications += len(batch.verify)
            verified = dict(zip(batch.verify, kept.tolist(), strict=True))
        if self.draft is not None:
            for seq in self._proposed:  # proposals the scheduler dropped kept nothing
                self.draft.rollback(seq, seq.num_tokens + verified.get(seq, 0))
        self._proposed = []

    def finish(self, seconds: float) -> None:
        """The whole engine step took `seconds` (proposing to its updates): a verifying step's row
        count is costed by all of it; a plain step's by all but its proposing (what resting costs)."""
        if self._rows:  # 0 in a rest (observe left it out)
            self.adaptive.record_rows(self._rows, seconds if self._verifying else seconds - self._proposing)
        self._rows = 0

    # -- per request ----------------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        self.adaptive.admit(seq.slot)

    def release(self, seq: Sequence) -> None:
        if self.draft is not None:
            self.draft.release(seq)

    @staticmethod
    def zero_stats() -> dict[str, int]:
        return dict.fromkeys(("spec_draft_tokens", "spec_accepted_tokens", "spec_verifications"), 0)

    def stats(self) -> dict[str, int]:
        return {
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_verifications": self.num_verifications,
        }
