"""Turns a scheduled batch into the flat model input, runs it through the step executor and samples
on the device.

Batch metadata is built with vectorised numpy from the persistent block table and copied into
persistent device buffers (executor/buffers.py). One blocking readback per step: the sampled tokens,
with their logprobs (and the speculative verification's results) in the same wait. Structured-output
bitmasks are filled on another thread while the model runs (pipeserve/engine/structured.py).

ForwardRunner runs forward passes (the draft model's runner); ModelRunner adds sampling,
verification, prompt logprobs and structured outputs (the target model's).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from pipeserve.engine.backend import Backend
from pipeserve.engine.executor import (
    DeviceIds,
    EagerStep,
    FlatBatch,
    StepBuffers,
    StepExecutor,
    StepPlan,
    select_executor,
)
from pipeserve.engine.executor.base import EAGER
from pipeserve.engine.executor.buffers import upload
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.lora.rows import LoRAContext, buffer_shapes
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.engine.pooling import EmbedRows, Pooler
from pipeserve.engine.prompt_logprobs import PromptRows, PromptScores, prompt_rows, read_out
from pipeserve.engine.sampler import SampleOutput, Sampler
from pipeserve.engine.scheduler import ScheduledBatch
from pipeserve.engine.sequence import PENDING, Sequence
from pipeserve.engine.spec.verifier import DraftProposals, Verifier
from pipeserve.engine.structured import StructuredOutputs


@dataclass
class StepResult:
    tokens: list[int]  # one per sampled request, in ScheduledBatch.sampling() order
    logprobs: np.ndarray | None = None  # [B] float32, sampled token
    top_ids: np.ndarray | None = None  # [B, K]
    top_logprobs: np.ndarray | None = None
    accepted: list[list[int]] | None = None  # per sampled request: kept proposals, before its token


class LaunchedStep:
    """A step on the device; `result()` reads what it sampled (the step's one readback) the first time."""

    def __init__(self, finish: Callable[[], StepResult], tokens: torch.Tensor | None = None,
                 slots: np.ndarray | None = None) -> None:
        """tokens: the sampled token of each sample row, on the device, and slots their requests'
        slots (None: the step read back as it ran)."""
        self.tokens, self.slots = tokens, slots
        self._finish: Callable[[], StepResult] | None = finish
        self._result: StepResult | None = None

    @classmethod
    def done(cls, result: StepResult) -> LaunchedStep:
        return cls(lambda: result)

    def result(self) -> StepResult:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        assert self._result is not None
        return self._result


_NO_ROWS = np.zeros(0, np.int64)  # read only
_NO_CHUNKS = np.zeros(1, np.int64)  # cumulative query lengths of no prefill chunks


class ForwardRunner:
    """A model's forward passes: flat batch in, logits of its sample rows out."""

    def __init__(self, *, model: LlamaForCausalLM, pool: KVPool, backend: Backend, device: torch.device,
                 max_num_seqs: int, max_num_batched_tokens: int, plan: StepPlan, role: str = "model",
                 lora: LoRAContext | None = None) -> None:
        """plan: how steps run (the executor is chosen from it and the backend); role names the
        model in the log line of that choice; lora: the adapters' step index, filled every step."""
        self.model, self.pool, self.device = model, pool, device
        self.page_size = pool.page_size
        decode_rows = plan.max_rows  # a compiled step runs each verification row as a decode row
        max_tokens = max(max_num_batched_tokens + max_num_seqs, decode_rows)
        pages = pool.max_pages_per_seq
        i32, i64 = torch.int32, torch.int64
        self.buffers = StepBuffers(device=device, shapes={
            "input_ids": (i64, (max_tokens,)),
            "positions": (i64, (max_tokens,)),
            "slot_mapping": (i64, (max_tokens,)),
            "decode_block_tables": (i32, (decode_rows, pages)),
            "prefill_block_tables": (i32, (max_num_seqs, pages)),
            "decode_seq_lens": (i32, (decode_rows,)),
            "prefill_seq_lens": (i32, (max_num_seqs,)),
            "prefill_cu_q_lens": (i32, (max_num_seqs + 1,)),
            # Rows read out of the last layer: up to every row of the step (prompt logprobs read
            # every prompt row; a verifying request samples at each of its 1 + k rows).
            "sample_rows": (i64, (max_tokens,)),
            "sample_slots": (i64, (max_tokens,)),
            "sample_block_tables": (i32, (max_tokens, pages)),
            "sample_seq_lens": (i32, (max_tokens,)),
            "sample_offsets": (i64, (max_tokens,)),
            "patch_rows": (i64, (max_tokens,)),  # rows whose input ids are on the device (proposals)
            "patch_src": (i64, (max_tokens,)),  # where in the step in flight's tokens (overlapped steps)
            **(buffer_shapes(max_tokens, max_num_seqs, lora.table.num_slots) if lora else {}),
        })
        self.lora = lora
        self.eager = EagerStep(model=model, pool=pool, buffers=self.buffers, max_rows=max_tokens)
        self.executor: StepExecutor = select_executor(plan, backend=backend, model=model, pool=pool,
                                                      buffers=self.buffers, device=device, role=role,
                                                      lora=lora)

    @property
    def exact_rows(self) -> int:
        """Steps of up to this many rows run as one unit each (0: every step eager)."""
        return 0 if self.executor.mode == EAGER else self.executor.max_rows

    def warm_up(self, every_bucket: bool = False) -> None:
        """Compile or capture what the executor runs before the engine serves (every_bucket: all of
        its buckets, also those Inductor would compile on first use)."""
        self.executor.prepare(every_bucket)

    # -- metadata -------------------------------------------------------------------------------
    def build(self, batch: ScheduledBatch, drafts: DraftProposals | None = None) -> FlatBatch:
        """drafts: where the verification rows' proposals are (on the device: their input ids are
        copied from there, the host holds placeholders)."""
        table, size = self.pool.block_table, self.page_size
        nd = len(batch.decode)
        d_slots = np.fromiter((s.slot for s in batch.decode), np.int64, nd)
        d_pos = np.fromiter((s.num_computed for s in batch.decode), np.int64, nd)
        d_ids = np.fromiter((s.token_ids[-1] for s in batch.decode), np.int64, nd)
        if not batch.verify and not batch.prefill:  # decode rows only: most steps, a few numpy ops
            slot_mapping = table[d_slots, d_pos // size].astype(np.int64) * size + d_pos % size
            return FlatBatch(input_ids=d_ids, positions=d_pos, slot_mapping=slot_mapping, row_slots=d_slots,
                             num_decode=nd, decode_slots=d_slots, prefill_slots=_NO_ROWS,
                             prefill_cu_q_lens=_NO_CHUNKS, prefill_seq_lens=_NO_ROWS,
                             sample_rows=np.arange(nd), sample_slots=d_slots, sample_seq_lens=d_pos + 1)

        # Verification rows are chunks against the cache, like prefill chunks, and go first there.
        nv = len(batch.verify)
        chunks = batch.verify + batch.prefill
        v_lens = np.fromiter((1 + len(p) for p in batch.proposals), np.int64, nv)
        p_slots = np.fromiter((s.slot for s in chunks), np.int64, len(chunks))
        p_lens = np.concatenate([v_lens, np.asarray(batch.prefill_lens, dtype=np.int64)])
        p_start = np.fromiter((s.num_computed for s in chunks), np.int64, len(chunks))
        cu = np.zeros(len(p_lens) + 1, dtype=np.int64)
        np.cumsum(p_lens, out=cu[1:])
        total_p = int(cu[-1])
        # Positions of every prefill row: start of its request + offset within its chunk.
        p_rows_req = np.repeat(np.arange(len(p_lens)), p_lens)
        p_pos = p_start[p_rows_req] + (np.arange(total_p) - cu[:-1][p_rows_req])
        p_ids = np.fromiter(
            itertools.chain(
                (t for s, p in zip(batch.verify, batch.proposals, strict=True)
                 for t in (s.token_ids[-1], *p)),
                (t for s, a, n in zip(batch.prefill, p_start[nv:], p_lens[nv:], strict=True)
                 for t in s.token_ids[a : a + n]),
            ),
            np.int64,
            total_p,
        )
        positions = np.concatenate([d_pos, p_pos])
        row_slots = np.concatenate([d_slots, p_slots[p_rows_req]])
        slot_mapping = table[row_slots, positions // size].astype(np.int64) * size + positions % size

        done = p_start + p_lens
        p_samples = done == np.fromiter((s.num_tokens for s in chunks), np.int64, len(chunks))
        p_samples[:nv] = False  # every verification row samples, listed on its own
        nvr = int(cu[nv])
        sample_rows = np.concatenate([np.arange(nd + nvr), nd + cu[1:][p_samples] - 1])
        sample_slots = np.concatenate([d_slots, p_slots[p_rows_req[:nvr]], p_slots[p_samples]])
        sample_seq_lens = np.concatenate([d_pos + 1, p_pos[:nvr] + 1, done[p_samples]])
        offsets = None
        device_ids = None
        if nv:  # the output index of each verification row past its request's next one
            offsets = np.zeros(sample_rows.size, dtype=np.int64)
            offsets[nd : nd + nvr] = np.arange(nvr) - cu[:nv][p_rows_req[:nvr]]
            if drafts is not None:  # each request's rows after its newest token: its proposals
                is_proposal = offsets[nd : nd + nvr] > 0
                device_ids = DeviceIds(nd + np.flatnonzero(is_proposal),
                                       drafts.proposed(batch.verify, v_lens - 1))
        return FlatBatch(input_ids=np.concatenate([d_ids, p_ids]), positions=positions,
                         slot_mapping=slot_mapping, row_slots=row_slots, num_decode=nd, decode_slots=d_slots,
                         prefill_slots=p_slots,
                         prefill_cu_q_lens=cu, prefill_seq_lens=done, sample_rows=sample_rows,
                         sample_slots=sample_slots, sample_seq_lens=sample_seq_lens, num_verify_rows=nvr,
                         sample_offsets=offsets, device_ids=device_ids)

    # -- the forward pass -------------------------------------------------------------------------
    def logits(self, flat: FlatBatch) -> torch.Tensor | None:
        """Logits [R, V] of flat's sample rows (None: no row samples)."""
        self.buffers.begin()
        executor = self.executor if self.executor.covers(flat) else self.eager
        if executor.mode == EAGER:  # the native and compiled steps read each row's adapter slot themselves
            self._index_lora(flat)
        return executor.run(flat)

    def _index_lora(self, flat: FlatBatch) -> None:
        """The step's row -> adapter slot index, for the LoRA layers (once per step)."""
        if self.lora is None:
            return
        cu = flat.prefill_cu_q_lens
        chunks = int(np.searchsorted(cu, flat.num_verify_rows))  # verification chunks come first
        self.lora.prepare(row_slots=flat.row_slots, chunk_bounds=flat.num_decode + cu[chunks:],
                          sample_rows=None if flat.every_row_read else flat.sample_rows,
                          stage=self.buffers.stage)

    def forward(self, batch: ScheduledBatch,
                device_ids: DeviceIds | None = None) -> tuple[FlatBatch, torch.Tensor | None]:
        """The batch's model input and the logits [R, V] of its sample rows (None: no row samples).
        device_ids: rows whose input ids are on the device (the host's are placeholders)."""
        flat = replace(self.build(batch), device_ids=device_ids)
        return flat, self.logits(flat)


class ModelRunner(ForwardRunner):
    """The target model's runner: its steps sample (with structured outputs, prompt logprobs and
    speculative verification)."""

    def __init__(self, *, model: LlamaForCausalLM, pool: KVPool, backend: Backend, device: torch.device,
                 max_num_seqs: int, max_num_batched_tokens: int, plan: StepPlan, sampler: Sampler,
                 structured: StructuredOutputs, pooler: Pooler, lora: LoRAContext | None = None) -> None:
        """pooler: how embedding requests' vectors are pooled (pooling.py)."""
        super().__init__(model=model, pool=pool, backend=backend, device=device, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, plan=plan, lora=lora)
        self.sampler, self.structured, self.pooler = sampler, structured, pooler
        self.verifier = Verifier(sampler, device)

    def read_rows(self, flat: FlatBatch, extra: PromptRows | None, embeds: EmbedRows | None
                  ) -> tuple[torch.Tensor | None, PromptScores | None, tuple[torch.Tensor, ...]]:
        """Such steps run eager. The sample rows' logits (None: no row samples); the prompt rows
        `extra`, read out too and scored on the way; the embedding requests' rows (`embeds`: among
        the sample rows, and with mean pooling every prompt row, read out after extra's) pooled.
        Scores and vectors stay on the device for the step's one readback."""
        self.buffers.begin()
        scored_rows = _NO_ROWS if extra is None else extra.rows
        more = [r for r in (scored_rows, _NO_ROWS if embeds is None else embeds.extra) if r.size]
        read = flat
        if more:
            rows = np.concatenate(more)
            read = replace(flat, sample_rows=np.concatenate([flat.sample_rows, rows]),
                           sample_slots=np.concatenate([flat.sample_slots, flat.row_slots[rows]]),
                           sample_seq_lens=np.concatenate([flat.sample_seq_lens, flat.positions[rows] + 1]))
        self._index_lora(read)
        hidden, logits = self.eager.forward(read)
        assert logits is not None  # extra or embeds has rows
        every_row = read.every_row_read
        pooled = () if embeds is None else self.pooler.pool(
            embeds, hidden, flat.sample_rows, flat.sample_rows.size + scored_rows.size, every_row)
        scores = None
        if extra is not None:
            logits, scores = read_out(logits, flat.sample_rows, extra, every_row)
        elif read is not flat:
            logits = (logits.index_select(0, upload(flat.sample_rows, logits.device)) if every_row
                      else logits[: flat.sample_rows.size])
        return (logits if flat.sample_rows.size else None), scores, pooled

    def run(self, batch: ScheduledBatch, drafts: DraftProposals | None = None) -> StepResult:
        """drafts: the draft model's distributions behind batch.proposals (sampled proposals are
        verified by rejection sampling; without them, proposals are kept while they match)."""
        return self.launch(batch, drafts).result()

    def launch(self, batch: ScheduledBatch, drafts: DraftProposals | None = None,
               after: LaunchedStep | None = None) -> LaunchedStep:
        """Start the step; its results come with `result()` on the returned step. A step that samples
        without verifying leaves its one readback for then, so the host may schedule and launch the
        next step first; the others read back here. after: the step still in flight, whose tokens
        are the input ids of the decode rows holding a PENDING token."""
        flat = self.build(batch, drafts)
        if after is not None:
            assert flat.device_ids is None, "decode rows from the device beside a draft's proposals"
            flat = replace(flat, device_ids=self._continuing(flat, after))
        self.structured.begin(flat.sample_slots)  # bitmask rows fill while the model runs
        # The chunks are the verification rows, then the prefills: skip the former's offsets.
        extra = (prompt_rows(batch.prefill, flat.num_decode, flat.prefill_cu_q_lens[len(batch.verify):])
                 if batch.prefill else None)
        embeds = (self.pooler.rows(batch.prefill, batch.prefill_lens, flat.num_decode + flat.num_verify_rows,
                                   flat.num_decode, flat.prefill_cu_q_lens[len(batch.verify):])
                  if batch.prefill else None)
        scores: PromptScores | None = None
        pooled: tuple[torch.Tensor, ...] = ()
        if extra is None and embeds is None:
            logits = self.logits(flat)
        else:
            logits, scores, pooled = self.read_rows(flat, extra, embeds)
        if logits is None:
            if scores is not None:  # prompt chunks only: the scores are the step's one readback
                scores.store(self.buffers.read(*scores.tensors))
            return LaunchedStep.done(StepResult([]))
        scored = () if scores is None else scores.tensors
        # The sampler runs eager: on the CPU it reads the host array as it is.
        slots_t = self.buffers.host_or_stage("sample_slots", flat.sample_slots)
        mask = self.structured.mask()
        if flat.sample_offsets is None:
            out = self.sampler.sample(logits, flat.sample_slots, slots_t, mask)
            logprobs = self._logprobs(out)
            # The step's one readback: tokens, their logprobs, the prompt rows' scores, the vectors.
            pending = self.buffers.read_later(out.tokens, *logprobs, *scored, *pooled)

            def finish() -> StepResult:
                return self._sampled(pending.wait(), len(logprobs), len(pooled), scores, embeds)

            return LaunchedStep(finish, out.tokens, flat.sample_slots)
        offsets = (flat.sample_offsets, self.buffers.stage("sample_offsets", flat.sample_offsets))
        out = self.sampler.sample(logits, flat.sample_slots, slots_t, mask, offsets)
        logprobs = self._logprobs(out)
        proposed = None if flat.device_ids is None else flat.device_ids.values
        verified, host = self.verifier.verify(batch, flat.num_decode, flat.sample_slots, logits,
                                              out.tokens, offsets, drafts, self.buffers.read,
                                              logprobs + scored + pooled, proposed)
        host, host_pooled = host[: len(host) - len(pooled)], host[len(host) - len(pooled):]
        result = StepResult(verified.tokens, accepted=verified.accepted)
        self.sampler.advance(verified.slots, upload(verified.slots, self.device),
                             upload(verified.emitted, self.device))
        # Requests with logprobs never verify (one row each): their rows, in request order.
        host_logprobs = [a[verified.seq_rows] for a in host[: len(logprobs)]]
        self._store(result, verified.row_tokens, host_logprobs, host[len(logprobs):], host_pooled, scores,
                    embeds)
        return LaunchedStep.done(result)

    def _continuing(self, flat: FlatBatch, after: LaunchedStep) -> DeviceIds | None:
        """The decode rows whose input id is a PENDING token: the token `after` sampled for the same
        request slot (on the device; nothing waits)."""
        rows = np.flatnonzero(flat.input_ids[: flat.num_decode] == PENDING)
        if not rows.size:
            return None
        assert after.tokens is not None and after.slots is not None, "a PENDING token from a step read back"
        slots = flat.decode_slots[rows]
        if rows.size == after.slots.size and np.array_equal(slots, after.slots):  # the same rows: most steps
            return DeviceIds(rows, after.tokens)
        order = np.argsort(after.slots)
        src = order[np.searchsorted(after.slots, slots, sorter=order)]
        assert np.array_equal(after.slots[src], slots), "a PENDING token with no row in the step in flight"
        return DeviceIds(rows, after.tokens.index_select(0, self.buffers.host_or_stage("patch_src", src)))

    def _sampled(self, host: list[np.ndarray], num_logprobs: int, num_pooled: int,
                 scores: PromptScores | None, embeds: EmbedRows | None) -> StepResult:
        """A sampling step's result from its readback: [tokens, *logprobs, *scores, *pooled]."""
        tokens, rest = host[0], host[1:]
        rest, host_pooled = rest[: len(rest) - num_pooled], rest[len(rest) - num_pooled:]
        row_tokens = tokens.tolist()
        result = StepResult(row_tokens)
        self._store(result, row_tokens, rest[:num_logprobs], rest[num_logprobs:], host_pooled, scores, embeds)
        return result

    def _store(self, result: StepResult, row_tokens: list[int], host_logprobs: list[np.ndarray],
               host_scores: list[np.ndarray], host_pooled: list[np.ndarray], scores: PromptScores | None,
               embeds: EmbedRows | None) -> None:
        """Hand the readback's parts to their owners: prompt scores, pooled vectors, the grammars
        (each constrained row's token), the result's logprobs."""
        if scores is not None:
            scores.store(host_scores)
        if host_pooled:
            assert embeds is not None
            embeds.store(host_pooled[0])
        self.structured.advance(row_tokens)
        if host_logprobs:
            result.logprobs, result.top_ids, result.top_logprobs = host_logprobs

    @staticmethod
    def _logprobs(out: SampleOutput) -> tuple[torch.Tensor, ...]:
        """The sampled rows' logprobs, top ids and top logprobs; () when no row asked for them."""
        if out.logprobs is None:
            return ()
        assert out.top_ids is not None and out.top_logprobs is not None
        return out.logprobs, out.top_ids, out.top_logprobs

    # -- per-request state ------------------------------------------------------------------
    def admit(self, seq: Sequence, stop_ids: list[int]) -> None:
        self.sampler.set_request(seq.slot, seq.params, seq.token_ids[: seq.prompt_len], seq.output_ids,
                                 stop_ids)
        if seq.params.constrained:
            self.structured.admit(seq)

    def release(self, seq: Sequence) -> None:
        self.sampler.free(seq.slot)
        self.structured.release(seq)
