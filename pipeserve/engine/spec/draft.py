"""A draft model: a small checkpoint sharing the target's tokenizer, run by the same engine with its
own KV pool, proposing k tokens per speculating request autoregressively (one batched forward pass
per proposed token).

Its cache follows the target's accepted tokens through a shadow Sequence per request slot, which
holds the draft's pages and how many of the request's tokens the draft has computed. Before
proposing, the shadow catches up on the request's new tokens (a chunk against its cache, like a
prefill chunk); after verification its computed length falls back to the tokens the target kept,
so K/V written for rejected proposals is overwritten later.

Proposals never wait for the device: each round's draws feed the next round's input ids on the
device, the target's verification rows take them from there, and the host reads them with the
verified tokens in the step's one readback. Until then a shadow holds placeholders (UNREAD) for
the tokens it drew; the next catch-up replaces them with the request's real tokens."""

from __future__ import annotations

import numpy as np
import torch

from pipeserve.engine.executor import DeviceIds
from pipeserve.engine.executor.buffers import upload
from pipeserve.engine.runner import ForwardRunner
from pipeserve.engine.sampler import Sampler, race
from pipeserve.engine.scheduler import ScheduledBatch
from pipeserve.engine.sequence import Sequence, Status

from .verifier import DRAFT_SALT, UNREAD, DraftProposals


class DraftModel:
    def __init__(self, *, runner: ForwardRunner, sampler: Sampler, max_num_batched_tokens: int) -> None:
        """runner: the draft model's forward passes (its own pool; its rounds of one token per
        request run on its step executor), warmed up by the caller."""
        self.runner, self.pool, self.sampler = runner, runner.pool, sampler
        self.model, self.device = runner.model, runner.device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.shadows: dict[int, Sequence] = {}  # by the target request's slot
        # By slot: where the shadow's placeholders may start (the request's length when it drew).
        self.unread_from: dict[int, int] = {}

    def _shadow(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.slot)
        if shadow is None:
            shadow = Sequence(seq.rid, [], 0, seq.params, 0.0, status=Status.RUNNING, slot=seq.slot)
            self.shadows[seq.slot] = shadow
        # The draft's computed prefix agrees with the request (kept proposals included); refresh the
        # tokens after it, and the placeholders of the proposals the request has kept since.
        start = min(self.unread_from.pop(seq.slot, shadow.num_computed), shadow.num_computed)
        del shadow.token_ids[start:]
        shadow.token_ids.extend(seq.token_ids[start:])
        self.unread_from[seq.slot] = seq.num_tokens
        return shadow

    def propose(self, seqs: list[Sequence], rounds: np.ndarray) -> tuple[dict[Sequence, int], DraftProposals]:
        """Draw rounds[i] tokens for seqs[i] (each decoding: its newest token uncomputed by the
        target); the caller proposes a prefix of them. Returns how many each drew (fewer where the
        draft pool ran out of pages; none where the draft cache cannot catch up in this step's token
        budget) and the draws, on the device."""
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch()
        active: list[tuple[int, Sequence]] = []
        for i, seq in enumerate(seqs):
            shadow = self._shadow(seq)
            lag = shadow.num_uncomputed
            chunk = min(lag, budget)
            if chunk == 0 or not self.pool.grow(shadow, shadow.num_computed + chunk):
                continue
            budget -= chunk
            if chunk == 1:
                batch.decode.append(shadow)
            else:
                batch.prefill.append(shadow)
                batch.prefill_lens.append(chunk)
            if chunk == lag:
                active.append((i, shadow))
        r = max(int(rounds.max(initial=0)), 1)
        # Distributions are kept for sampled requests only: greedy ones verify by matching.
        greedy = self.sampler.is_greedy(np.fromiter((s.slot for s in seqs), np.int64, len(seqs)))
        q_row = np.cumsum(~greedy) - 1  # row in q of each sampled request
        q = torch.zeros(int((~greedy).sum()), r, self.sampler.vocab_size, device=self.device)
        drawn = torch.zeros(len(seqs), r, dtype=torch.int64, device=self.device)  # row i: seqs[i]'s
        counts: dict[Sequence, int] = {}
        inputs = None  # the round's input ids on the device (after the first: the last round's draws)
        for j in range(r):
            if not batch.num_tokens:
                break
            order = batch.sampling()  # the active shadows whose chunk reaches their newest token
            _, logits = self.runner.forward(batch, inputs)
            for shadow, n in zip(batch.prefill, batch.prefill_lens, strict=True):
                shadow.num_computed += n
            for shadow in batch.decode:
                shadow.num_computed += 1
            if logits is None or not order:
                break
            index = {id(s): i for i, s in active}
            idx_np = np.fromiter((index[id(s)] for s in order), np.int64, len(order))
            slots = np.fromiter((s.slot for s in order), np.int64, len(order))
            slots_t = upload(slots, self.device)
            steps = self.sampler.generated[slots_t] + j
            logw = self.sampler.processed_logits(logits, slots, slots_t, steps)
            # The target's processing of the draft's logits; greedy rows take the argmax.
            drawn_j = torch.where(self.sampler.greedy[slots_t], logw.argmax(-1),
                                  race(logw, self.sampler.noise(slots_t, steps, DRAFT_SALT)))
            drawn[upload(idx_np, self.device), j] = drawn_j
            keep = ~greedy[idx_np]
            if keep.any():
                sel = upload(np.flatnonzero(keep), self.device)
                rows_q = upload(q_row[idx_np[keep]], self.device)
                q[rows_q, j] = torch.softmax(logw.index_select(0, sel), dim=-1)
            for s, i in zip(order, idx_np.tolist(), strict=True):
                counts[seqs[i]] = counts.get(seqs[i], 0) + 1
                s.token_ids.append(UNREAD)  # its value is drawn_j's, on the device
            # The next round: shadows that draw another token and have room for it, each fed its
            # draw of this round.
            batch = ScheduledBatch()
            still = []
            for i, s in active:
                if rounds[i] > j + 1 and self.pool.grow(s, s.num_computed + 1):
                    batch.decode.append(s)
                    still.append((i, s))
            active = still
            if still:
                at = {id(s): row for row, s in enumerate(order)}
                prev = np.fromiter((at[id(s)] for _, s in still), np.int64, len(still))
                inputs = DeviceIds(np.arange(len(still)), drawn_j.index_select(0, upload(prev, self.device)))
        rows = {seq: i for i, seq in enumerate(seqs)}
        q_rows = {seq: int(q_row[i]) for i, seq in enumerate(seqs) if not greedy[i]}
        return counts, DraftProposals(rows, drawn, q_rows, q)

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """After verification: the draft's K/V is valid for the request's first num_valid tokens."""
        shadow = self.shadows.get(seq.slot)
        if shadow is not None and shadow.num_computed > num_valid:
            shadow.num_computed = num_valid
            self.pool.shrink(shadow, num_valid)

    def release(self, seq: Sequence) -> None:
        self.unread_from.pop(seq.slot, None)
        shadow = self.shadows.pop(seq.slot, None)
        if shadow is not None:
            self.pool.release(shadow)
