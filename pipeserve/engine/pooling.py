"""Embedding requests: the pooled hidden state of a prompt, read out during its prefill.

An embedding request (Sequence.embed) runs its prompt like any prefill, batched with the step's
other rows, and keeps final-norm hidden states instead of sampling. `--pooling` (chosen once, at
start) says which:

- `last` (the default, as vLLM pools decoder LLMs): the step that computes the last prompt token
  reads that row out of the last layer (it is a sample row already).
- `mean`: every prompt row of every chunk is read out too, beside the sample rows (as prompt
  logprobs read theirs), and added on the device into the request's row of a persistent running
  sum (one per request slot; a chunk that starts the prompt, also after a preemption, zeroes it
  first). The step that computes the last prompt token divides the sum by the prompt's length.
  Such requests skip the prefix cache (Sequence.runs_every_prompt_row): a cached row has no hidden
  state to add.

The vectors are L2-normalised (--no-embed-normalize: the raw pooled state) and reach the host in the
step's one readback; the request then finishes and its pages are released (the prefix cache keeps
those it published, as for any request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pipeserve.engine.executor.buffers import upload
from pipeserve.engine.sequence import Sequence

_NO_ROWS = np.zeros(0, np.int64)  # read only


@dataclass
class EmbedRows:
    """One step's embedding rows: the requests that finish their prompt (`seqs`) and each one's
    index among the step's sample rows; with mean pooling also the other prompt rows of every
    embedding chunk (`extra`, flat-batch rows read out after the sample rows and any prompt-logprob
    rows), their slots, and the slots whose running sum starts over."""

    seqs: list[Sequence]
    index: np.ndarray  # int64 [E]
    extra: np.ndarray = field(default_factory=lambda: _NO_ROWS)  # int64 flat-batch rows
    extra_slots: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    fresh: np.ndarray = field(default_factory=lambda: _NO_ROWS)  # slots whose chunk starts the prompt

    def store(self, host: np.ndarray) -> None:
        for seq, vector in zip(self.seqs, host, strict=True):
            seq.embedding = vector


class Pooler:
    """How the engine pools embeddings (`mode`: last | mean; `normalize`), and for mean pooling the
    per-slot running sums: float32 [max_num_seqs, hidden] on the device, allocated once."""

    def __init__(self, mode: str, normalize: bool, max_num_seqs: int, hidden_size: int,
                 device: torch.device) -> None:
        assert mode in ("last", "mean"), mode
        self.mode, self.normalize = mode, normalize
        self.sums = (torch.zeros(max_num_seqs, hidden_size, dtype=torch.float32, device=device)
                     if mode == "mean" else None)

    def rows(self, prefill: list[Sequence], prefill_lens: list[int], first: int, row0: int,
             cu_q_lens: np.ndarray) -> EmbedRows | None:
        """The step's embedding rows, or None (the usual case: no embedding request in the step).
        first: the sample-row index of the step's first prompt-ending prefill (after the decode and
        verification rows); row0 + cu_q_lens[i]: the flat-batch row of prefill i's first token."""
        seqs, index = [], []
        starts, counts, slots, fresh = [], [], [], []
        done = 0
        for i, (seq, n) in enumerate(zip(prefill, prefill_lens, strict=True)):
            ends = seq.num_computed + n == seq.num_tokens
            if seq.embed:
                if ends:
                    seqs.append(seq)
                    index.append(first + done)
                if self.sums is not None:  # the chunk's rows but a finishing one's last (a sample row)
                    starts.append(row0 + int(cu_q_lens[i]))
                    counts.append(n - ends)
                    slots.append(seq.slot)
                    if seq.num_computed == 0:
                        fresh.append(seq.slot)
            done += ends
        if not seqs and not starts:
            return None
        rows = EmbedRows(seqs, np.asarray(index, dtype=np.int64))
        if starts:
            count = np.asarray(counts, dtype=np.int64)
            within = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
            rows.extra = np.repeat(np.asarray(starts, dtype=np.int64), count) + within
            rows.extra_slots = np.repeat(np.asarray(slots, dtype=np.int64), count)
            rows.fresh = np.asarray(fresh, dtype=np.int64)
        return rows

    def pool(self, rows: EmbedRows, hidden: torch.Tensor, sample_rows: np.ndarray, first_extra: int,
             every_row: bool) -> tuple[torch.Tensor, ...]:
        """The finishing requests' vectors, float32 [E, hidden] on the device (() when none finishes;
        mean pooling still adds the step's rows to the sums). hidden: the rows the model read out,
        sample rows first and rows.extra from first_extra on, or every row of the batch in order
        (every_row)."""
        device = hidden.device
        final = sample_rows[rows.index] if every_row else rows.index
        if self.sums is None:
            if not rows.seqs:
                return ()
            picked = hidden.index_select(0, upload(final, device)).float()
        else:
            extra = rows.extra if every_row else first_extra + np.arange(rows.extra.size, dtype=np.int64)
            slots = np.fromiter((s.slot for s in rows.seqs), np.int64, len(rows.seqs))
            lens = np.fromiter((s.prompt_len for s in rows.seqs), np.int64, len(rows.seqs))
            parts = (final, extra, slots, rows.extra_slots, rows.fresh, lens)
            read, into = final.size + extra.size, slots.size + rows.extra_slots.size
            # One upload for all of the step's pooling indices.
            source, target, fresh_t, lens_t = upload(np.concatenate(parts), device).tensor_split(
                [read, read + into, read + into + rows.fresh.size])
            self.sums.index_fill_(0, fresh_t, 0.0)
            self.sums.index_add_(0, target, hidden.index_select(0, source).float())
            if not rows.seqs:
                return ()
            picked = self.sums.index_select(0, target[: slots.size]) / lens_t.to(torch.float32)[:, None]
        return (torch.nn.functional.normalize(picked, dim=-1) if self.normalize else picked,)
