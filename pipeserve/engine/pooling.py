"""Embedding requests: the pooled hidden state of a prompt, read out during its prefill.

An embedding request (Sequence.embed) runs its prompt like any prefill, batched with the step's
other rows; the step that computes its last prompt token reads that row out of the last layer (it is
a sample row already) and keeps the final-norm hidden state instead of sampling. Pooling is last
token, L2-normalised, as vLLM pools decoder LLMs by default (--no-embed-normalize: the raw hidden
state). The vectors reach the host in the
step's one readback; the request then finishes and its pages are released (the prefix cache keeps
those it published, as for any request).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeserve.engine.executor.buffers import upload
from pipeserve.engine.sequence import Sequence


@dataclass
class EmbedRows:
    """The step's embedding requests that finish their prompt, and each one's index among the step's
    sample rows."""

    seqs: list[Sequence]
    index: np.ndarray  # int64 [E]

    def pool(self, hidden: torch.Tensor, sample_rows: np.ndarray, every_row: bool,
             normalize: bool = True) -> torch.Tensor:
        """float32 [E, hidden], L2-normalised unless normalize is False. hidden: the rows the model
        read out, in sample-row order, or every row of the batch in order (every_row)."""
        rows = sample_rows[self.index] if every_row else self.index
        picked = hidden.index_select(0, upload(rows, hidden.device)).float()
        return torch.nn.functional.normalize(picked, dim=-1) if normalize else picked

    def store(self, host: np.ndarray) -> None:
        for seq, vector in zip(self.seqs, host, strict=True):
            seq.embedding = vector


def embed_rows(prefill: list[Sequence], prefill_lens: list[int], first: int) -> EmbedRows | None:
    """The prefills whose chunk ends their prompt and that are embedding requests, or None (the usual
    case). first: the sample-row index of the step's first prompt-ending prefill (after the decode
    and verification rows)."""
    seqs, index = [], []
    done = 0
    for seq, n in zip(prefill, prefill_lens, strict=True):
        if seq.num_computed + n != seq.num_tokens:
            continue
        if seq.embed:
            seqs.append(seq)
            index.append(first + done)
        done += 1
    if not seqs:
        return None
    return EmbedRows(seqs, np.asarray(index, dtype=np.int64))
