"""One step's verification on the device and the host: the target has sampled every row of the
batch (each verification row at its own output index); this keeps the proposals `acceptance.py` accepts
and lays out what each request emits. One readback per step, as without speculation."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeserve.engine.executor.buffers import upload
from pipeserve.engine.prompt_logprobs import Read
from pipeserve.engine.sampler import Sampler
from pipeserve.engine.sequence import Sequence

from .acceptance import accept_matching, rejection_sample

if TYPE_CHECKING:
    from pipeserve.engine.scheduler import ScheduledBatch

# Salts of the seed's independent streams: the draft's proposals and the acceptance test.
DRAFT_SALT = 0x5DEECE66D
ACCEPT_SALT = 0x2545F4914F6CDD1D
# A proposal the host has not read (ScheduledBatch.proposals of a draft model): its value is on the
# device, in DraftProposals.tokens, until the step's one readback.
UNREAD = -1


@dataclass
class DraftProposals:
    """What a draft model drew this step, left on the device: each drafting request's row of tokens
    [M, R] and each sampled request's row of q [S, R, V], the probabilities they were drawn from. A
    sampled request has one draft token more than it proposed (rejection_sample decides its last row
    with it); greedy requests verify by matching their proposals, read back with the step's result."""

    rows: dict[Sequence, int]  # request -> its row of tokens
    tokens: torch.Tensor
    q_rows: dict[Sequence, int]  # sampled request -> its row of q
    q: torch.Tensor

    def proposed(self, seqs: list[Sequence], lens: np.ndarray) -> torch.Tensor:
        """The first lens[i] tokens of seqs[i], concatenated, on the device (nothing waits)."""
        width = self.tokens.shape[1]
        starts = np.fromiter((self.rows[s] * width for s in seqs), np.int64, len(seqs))
        cu = np.cumsum(lens) - lens  # each request's first entry in the result
        index = np.repeat(starts - cu, lens) + np.arange(int(lens.sum()))
        return self.tokens.view(-1).index_select(0, upload(index, self.tokens.device))


@dataclass
class Verified:
    row_tokens: list[int]  # the target's sample at every sample row
    tokens: list[int]  # per sampled request (ScheduledBatch.sampling order): its last emitted token
    accepted: list[list[int]]  # per sampled request: the kept proposals before that token
    seq_rows: np.ndarray  # per sampled request: the sample row of its last emitted token
    slots: np.ndarray  # int64, per emitted token of the step: its slot (Sampler.advance)
    emitted: np.ndarray  # int64, those tokens


class Verifier:
    def __init__(self, sampler: Sampler, device: torch.device) -> None:
        self.sampler, self.device = sampler, device

    def verify(
        self,
        batch: ScheduledBatch,
        num_decode: int,
        sample_slots: np.ndarray,
        logits: torch.Tensor,
        row_tokens: torch.Tensor,
        offsets: tuple[np.ndarray, torch.Tensor],
        drafts: DraftProposals | None,
        read: Read,
        also: tuple[torch.Tensor, ...] = (),
        proposed: torch.Tensor | None = None,
    ) -> tuple[Verified, list[np.ndarray]]:
        """What each request emits; read: the step's one readback, which brings the tensors `also`
        (the sampled rows' logprobs) to the host in the same wait, returned beside it. proposed: the
        draft model's proposals (batch.proposals' values, flat, on the device), read in that wait."""
        nd, nv = num_decode, len(batch.verify)
        lens = np.fromiter((len(p) for p in batch.proposals), np.int64, nv)
        k = int(lens.max())
        cu = np.zeros(nv + 1, dtype=np.int64)
        np.cumsum(lens + 1, out=cu[1:])
        # [nv, k + 1] sample rows of each request's verification rows; padding repeats its last.
        rows = nd + cu[:-1, None] + np.minimum(np.arange(k + 1)[None, :], lens[:, None])
        valid = np.arange(k)[None, :] < lens[:, None]
        proposals = np.full((nv, k), -1, dtype=np.int64)
        if proposed is None:  # known on the host (n-gram lookup)
            flat_proposals = itertools.chain.from_iterable(batch.proposals)
            proposals[valid] = np.fromiter(flat_proposals, np.int64, int(lens.sum()))
        v_slots = sample_slots[rows[:, 0]]

        sampled = np.zeros(0, dtype=np.int64)  # requests verified by rejection sampling
        sync = [row_tokens]
        if drafts is not None:
            sampled = np.flatnonzero(~self.sampler.is_greedy(v_slots))
        if sampled.size:
            assert drafts is not None
            q_rows = np.fromiter((drafts.q_rows[batch.verify[i]] for i in sampled), np.int64, sampled.size)
            d_rows = np.fromiter((drafts.rows[batch.verify[i]] for i in sampled), np.int64, sampled.size)
            pad = max(0, k + 1 - drafts.q.shape[1])  # a greedy request proposed the most: no extra row
            q = torch.nn.functional.pad(drafts.q[upload(q_rows, self.device)], (0, 0, 0, pad))[:, : k + 1]
            d = torch.nn.functional.pad(drafts.tokens[upload(d_rows, self.device)], (0, pad))[:, : k + 1]
            sync += self._rejection(logits, rows[sampled], lens[sampled], d, v_slots[sampled], q)
        if proposed is not None:
            sync.append(proposed)
        # The step's one readback.
        flat_sync, *also_host = read(torch.cat([t.reshape(-1) for t in sync]), *also)
        host = flat_sync.astype(np.int64)
        num_rows = row_tokens.shape[0]
        if proposed is not None:  # the draft's proposals, read last
            proposals[valid] = host[host.size - proposed.shape[0] :]
        targets = host[:num_rows][rows]
        kept = accept_matching(targets, proposals, lens)
        emitted_v = [targets[i, : kept[i] + 1] for i in range(nv)]
        if sampled.size:
            n = sampled.size
            rej_tokens = host[num_rows : num_rows + n * (k + 1)].reshape(n, k + 1)
            rej_counts = host[num_rows + n * (k + 1) : num_rows + n * (k + 2)]
            for j, i in enumerate(sampled):
                emitted_v[i] = rej_tokens[j, : rej_counts[j]]
                kept[i] = rej_counts[j] - 1

        row_list = host[:num_rows].tolist()
        p_rows = np.arange(nd + int(cu[-1]), num_rows)
        counts = np.concatenate([np.ones(nd, np.int64), kept + 1, np.ones(p_rows.size, np.int64)])
        slots = np.repeat(np.concatenate([sample_slots[:nd], v_slots, sample_slots[p_rows]]), counts)
        emitted = np.concatenate([host[:nd], *emitted_v, host[p_rows]]) if nv else host[:num_rows]
        tokens = row_list[:nd] + [int(e[-1]) for e in emitted_v] + [row_list[r] for r in p_rows]
        accepted = [[] for _ in range(nd)] + [e[:-1].tolist() for e in emitted_v]
        accepted += [[] for _ in range(p_rows.size)]
        seq_rows = np.concatenate([np.arange(nd), rows[np.arange(nv), kept], p_rows])
        return Verified(row_list, tokens, accepted, seq_rows, slots, emitted.astype(np.int64)), also_host

    def _rejection(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        lens: np.ndarray,
        draft: torch.Tensor,
        slots: np.ndarray,
        q: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Rejection sampling of the draft's samples draft [n, k + 1] (drawn from q [n, k + 1, V]):
        [tokens [n, k + 1], emitted [n]]."""
        n, k1 = rows.shape
        dev, sampler = self.device, self.sampler
        slots_t = upload(np.repeat(slots, k1), dev)
        steps = (sampler.generated[upload(slots, dev)][:, None]
                 + torch.arange(k1, device=dev)[None, :]).reshape(-1)
        flat_rows = upload(rows.reshape(-1), dev)
        p_logw = sampler.processed_logits(logits.index_select(0, flat_rows), np.repeat(slots, k1), slots_t,
                                          steps)
        u_race = sampler.noise(slots_t, steps)
        u_accept = sampler.noise(slots_t, steps, ACCEPT_SALT)[:, 0]
        v = p_logw.shape[-1]
        tokens, emitted = rejection_sample(p_logw.view(n, k1, v), q, draft, upload(lens, dev),
                                           u_accept.view(n, k1), u_race.view(n, k1, v))
        return [tokens, emitted]
