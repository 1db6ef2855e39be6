"""Prompt logprobs: the log-probability of every prompt token given the ones before it (and its top-k
alternatives), computed during prefill.

A prefill row at position q yields the logits of the token at q + 1, so a request that asks
(SamplingParams.prompt_logprobs) has every row of each of its prefill chunks read out of the last
layer, beside the rows the step samples, except the row of its last prompt token, which is the
sampled row (its logits give the first output token). Those extra rows ride the model's existing
row selection (meta.sample_rows: the last layer keeps only the rows whose output is read, each
attending like a decode query after every row's K/V is written), so a step with no such request
costs nothing more. Results land in the request's PromptLogprobs by position, so a prefill that is
recomputed after preemption writes the same values again. The first prompt token has none (NaN).
Requests that ask are never admitted on cached prefix pages: those rows must run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeserve.engine.executor.buffers import upload
from pipeserve.engine.sequence import Sequence


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs by position: [P] logprob of each prompt token (NaN for the
    first), [P, k] its top-k alternatives."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    @classmethod
    def empty(cls, prompt_len: int, k: int) -> PromptLogprobs:
        return cls(np.full(prompt_len, np.nan, np.float32), np.zeros((prompt_len, k), np.int64),
                   np.zeros((prompt_len, k), np.float32))


@dataclass
class PromptRows:
    """The extra rows of one step: flat-batch row, its request's slot, its attention length and the
    prompt token its logits score; segments: (request, first, end) over these rows, per request,
    and the prompt position its first row predicts."""

    rows: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray  # position + 1
    targets: np.ndarray
    segments: list[tuple[Sequence, int, int, int]]


def prompt_rows(prefill: list[Sequence], num_decode: int, cu_q_lens: np.ndarray) -> PromptRows | None:
    """The prefill rows of the step whose logits score a prompt token of a request that asked, or
    None (the usual case: no request in the step asked)."""
    rows, slots, positions, targets = [], [], [], []
    segments: list[tuple[Sequence, int, int, int]] = []
    total = 0
    for i, seq in enumerate(prefill):
        if seq.params.prompt_logprobs is None:
            continue
        start = seq.num_computed  # the chunk's first position (the scheduler advances it after the step)
        count = int(cu_q_lens[i + 1] - cu_q_lens[i])
        end = min(start + count, seq.prompt_len - 1)  # positions whose next token is a prompt token
        if end <= start:
            continue
        q = np.arange(start, end, dtype=np.int64)
        rows.append(num_decode + int(cu_q_lens[i]) + (q - start))
        slots.append(np.full(len(q), seq.slot, np.int64))
        positions.append(q)
        targets.append(np.asarray(seq.token_ids[start + 1 : end + 1], np.int64))
        segments.append((seq, total, total + len(q), start + 1))
        total += len(q)
    if not rows:
        return None
    return PromptRows(np.concatenate(rows), np.concatenate(slots), np.concatenate(positions) + 1,
                      np.concatenate(targets), segments)


Read = Callable[..., list[np.ndarray]]  # device tensors -> host arrays, one readback for them all


@dataclass
class PromptScores:
    """One step's prompt logprobs, still on the device: the step's one readback brings `tensors` to
    the host beside the sampled tokens, then `store` files them into the requests."""

    rows: PromptRows
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # target logprob [E], top-k logprobs, ids

    def store(self, host: list[np.ndarray]) -> None:
        chosen, top_lps_np, top_ids_np = host
        for seq, first, end, position in self.rows.segments:
            store = seq.prompt_logprobs
            if store is None:
                width = seq.params.prompt_logprobs or 0
                store = seq.prompt_logprobs = PromptLogprobs.empty(seq.prompt_len, width)
            span, width = slice(position, position + end - first), store.top_ids.shape[1]
            store.logprobs[span] = chosen[first:end]
            store.top_ids[span] = top_ids_np[first:end, :width]
            store.top_logprobs[span] = top_lps_np[first:end, :width]


def score(logits: torch.Tensor, rows: PromptRows) -> PromptScores:
    """Each extra row's logprob of its target and its top-k (k the largest any request asked for)."""
    k = max(seq.params.prompt_logprobs or 0 for seq, *_ in rows.segments)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = upload(rows.targets, logits.device)
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    return PromptScores(rows, (logprobs.gather(1, targets[:, None])[:, 0], top_lps, top_ids))


def read_out(logits: torch.Tensor, sample_rows: np.ndarray, extra: PromptRows,
             every_row: bool) -> tuple[torch.Tensor, PromptScores]:
    """Score the extra rows out of the logits of the rows the model read out; return the sampled
    rows' logits and the scores. The model returned the rows asked for in that order (sample rows,
    then extra rows, then any rows read for others) or, when together they are every row of the batch,
    all rows in batch order."""
    if every_row:
        device = logits.device
        scores = score(logits.index_select(0, upload(extra.rows, device)), extra)
        return logits.index_select(0, upload(sample_rows, device)), scores
    n = len(sample_rows)
    return logits[:n], score(logits[n : n + len(extra.rows)], extra)
