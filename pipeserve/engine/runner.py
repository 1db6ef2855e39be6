"""Turns a scheduled batch into the flat model input, runs the model and samples on the device.

Batch metadata is built with vectorised numpy from the persistent block table and copied into
persistent device buffers (pinned staging on CUDA, non-blocking). The only intended host-device
sync per step is fetching the sampled token ids, which the next step needs anyway. Structured-output
bitmasks are filled on another thread while the model runs (pipeserve/engine/structured.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from pipeserve.engine.compiled_step import CompiledDecode
from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.engine.prompt_logprobs import prompt_rows, read_out
from pipeserve.engine.sampler import Sampler
from pipeserve.engine.scheduler import ScheduledBatch
from pipeserve.engine.sequence import Sequence
from pipeserve.engine.spec.verifier import DraftProposals, Verifier
from pipeserve.engine.structured import StructuredOutputs


@dataclass
class StepResult:
    tokens: list[int]  # one per sampled request, in ScheduledBatch.sampling() order
    logprobs: np.ndarray | None = None  # [B] float32, sampled token
    top_ids: np.ndarray | None = None  # [B, K]
    top_logprobs: np.ndarray | None = None
    accepted: list[list[int]] | None = None  # per sampled request: kept proposals, before its token


@dataclass
class FlatBatch:
    """Host-side (numpy) model input of one step."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    row_slots: np.ndarray  # each row's request slot
    num_decode: int
    decode_slots: np.ndarray
    prefill_slots: np.ndarray
    prefill_cu_q_lens: np.ndarray
    prefill_seq_lens: np.ndarray
    sample_rows: np.ndarray
    sample_slots: np.ndarray
    sample_seq_lens: np.ndarray
    num_verify_rows: int = 0  # sample rows num_decode .. num_decode + this are verification rows
    sample_offsets: np.ndarray | None = None  # with verification: each sample row's output index


_NO_ROWS = np.zeros(0, np.int64)  # read only
_NO_CHUNKS = np.zeros(1, np.int64)  # cumulative query lengths of no prefill chunks


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        sampler: Sampler,
        device: torch.device,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        structured: StructuredOutputs | None,
        spec_tokens: int = 0,
        compiled: CompiledDecode | None = None,
    ):
        self.model, self.pool, self.sampler, self.device = model, pool, sampler, device
        self.structured = structured
        self.compiled = compiled  # decode-only steps, when set
        self.page_size = pool.page_size
        pin = device.type == "cuda"
        max_tokens = max_num_batched_tokens + max_num_seqs
        # A compiled step runs each verification row as a decode row of its own.
        decode_rows = max_num_seqs * (1 + spec_tokens)

        def buf(n: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros(n, *shape, dtype=dtype, device=device)

        # Persistent device buffers, refilled in place every step.
        self.buf = {
            "input_ids": buf(max_tokens, torch.int64),
            "positions": buf(max_tokens, torch.int64),
            "slot_mapping": buf(max_tokens, torch.int64),
            "decode_block_tables": buf(decode_rows, torch.int32, pool.max_pages_per_seq),
            "prefill_block_tables": buf(max_num_seqs, torch.int32, pool.max_pages_per_seq),
            "decode_seq_lens": buf(decode_rows, torch.int32),
            "prefill_seq_lens": buf(max_num_seqs, torch.int32),
            "prefill_cu_q_lens": buf(max_num_seqs + 1, torch.int32),
            # Rows read out of the last layer: up to every row of the step (prompt logprobs read
            # every prompt row; a verifying request samples at each of its 1 + k rows).
            "sample_rows": buf(max_tokens, torch.int64),
            "sample_slots": buf(max_tokens, torch.int64),
            "sample_block_tables": buf(max_tokens, torch.int32, pool.max_pages_per_seq),
            "sample_seq_lens": buf(max_tokens, torch.int32),
        }
        if spec_tokens:
            self.buf["sample_offsets"] = buf(max_tokens, torch.int64)
        self.verifier = Verifier(sampler, device)
        # Pinned host staging for asynchronous uploads; on the CPU the buffers are written directly.
        self.staging = (
            None
            if device.type == "cpu"
            else {k: torch.zeros_like(v, device="cpu", pin_memory=pin) for k, v in self.buf.items()}
        )

    def _stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Copy a host array into the persistent device buffer `name`; return the filled prefix,
        contiguous in the array's shape."""
        n = array.size
        dev = self.buf[name].view(-1)[:n].view(array.shape)
        if self.staging is None:  # host memory already: write in place
            dev.numpy()[...] = array
            return dev
        host = self.staging[name].view(-1)[:n].view(array.shape)
        host.numpy()[...] = array
        dev.copy_(host, non_blocking=True)
        return dev

    def warm_up(self, every_bucket: bool = False) -> None:
        """Compile the default decode buckets (with those of a batch-1 verification step), or every
        one (when decode steps are compiled)."""
        if self.compiled is not None:
            self.compiled.warm_up(self._stage, every_bucket)

    # -- metadata -------------------------------------------------------------------------------
    def build(self, batch: ScheduledBatch) -> FlatBatch:
        table, size = self.pool.block_table, self.page_size
        nd = len(batch.decode)
        d_slots = np.fromiter((s.slot for s in batch.decode), np.int64, nd)
        d_pos = np.fromiter((s.num_computed for s in batch.decode), np.int64, nd)
        d_ids = np.fromiter((s.token_ids[-1] for s in batch.decode), np.int64, nd)
        if not batch.verify and not batch.prefill:  # decode rows only: most steps, a few numpy ops
            slot_mapping = table[d_slots, d_pos // size].astype(np.int64) * size + d_pos % size
            return FlatBatch(d_ids, d_pos, slot_mapping, d_slots, nd, d_slots, _NO_ROWS, _NO_CHUNKS, _NO_ROWS,
                             np.arange(nd), d_slots, d_pos + 1)

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
                (
                    t
                    for s, p in zip(batch.verify, batch.proposals, strict=True)
                    for t in (s.token_ids[-1], *p)
                ),
                (
                    t
                    for s, a, n in zip(batch.prefill, p_start[nv:], p_lens[nv:], strict=True)
                    for t in s.token_ids[a : a + n]
                ),
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
        if nv:  # the output index of each verification row past its request's next one
            offsets = np.zeros(sample_rows.size, dtype=np.int64)
            offsets[nd : nd + nvr] = np.arange(nvr) - cu[:nv][p_rows_req[:nvr]]
        return FlatBatch(
            np.concatenate([d_ids, p_ids]),
            positions,
            slot_mapping,
            row_slots,
            nd,
            d_slots,
            p_slots,
            cu,
            done,
            sample_rows,
            sample_slots,
            sample_seq_lens,
            nvr,
            offsets,
        )

    def metadata(self, flat: FlatBatch) -> AttentionMetadata:
        table = self.pool.block_table
        d_lens = flat.positions[: flat.num_decode] + 1
        max_pages = self.pool.pages_for(int(max(d_lens.max(initial=1), flat.prefill_seq_lens.max(initial=1))))
        p_q = np.diff(flat.prefill_cu_q_lens)
        s_lens = flat.sample_seq_lens
        every_row = flat.sample_rows.size == flat.positions.size  # then the rows are 0..T-1
        return AttentionMetadata(
            slot_mapping=self._stage("slot_mapping", flat.slot_mapping),
            num_decode=flat.num_decode,
            decode_block_tables=self._stage("decode_block_tables", table[flat.decode_slots, :max_pages]),
            decode_seq_lens=self._stage("decode_seq_lens", d_lens),
            prefill_block_tables=self._stage("prefill_block_tables", table[flat.prefill_slots, :max_pages]),
            prefill_cu_q_lens=self._stage("prefill_cu_q_lens", flat.prefill_cu_q_lens),
            prefill_seq_lens=self._stage("prefill_seq_lens", flat.prefill_seq_lens),
            prefill_max_q_len=int(p_q.max(initial=0)),
            prefill_max_seq_len=int(flat.prefill_seq_lens.max(initial=0)),
            decode_max_seq_len=int(d_lens.max(initial=0)),
            sample_rows=None if every_row else self._stage("sample_rows", flat.sample_rows),
            sample_block_tables=None if every_row else self._stage(
                "sample_block_tables", table[flat.sample_slots, :max_pages]
            ),
            sample_seq_lens=None if every_row else self._stage("sample_seq_lens", s_lens),
            sample_max_seq_len=int(s_lens.max(initial=0)),
        )

    # -- the step -------------------------------------------------------------------------------
    def forward(self, batch: ScheduledBatch) -> tuple[FlatBatch, torch.Tensor | None]:
        """The batch's model input and the logits [R, V] of its sampled rows (None: no row samples)."""
        flat = self.build(batch)
        if self.structured is not None:  # bitmask rows fill while the model runs
            self.structured.begin(flat.sample_slots)
        # Prompt logprobs (the target model's runner: the draft's has no structured state) read
        # their rows out too.
        extra = None
        if self.structured is not None and batch.prefill:
            # The chunks are the verification rows, then the prefills: skip the former's offsets.
            extra = prompt_rows(batch.prefill, flat.num_decode, flat.prefill_cu_q_lens[len(batch.verify):])
        rows, compiled = flat.input_ids.size, self.compiled
        if compiled is not None and extra is None and compiled.covers(flat.num_decode + flat.num_verify_rows,
                                                                      rows):
            # Each row runs as a decode row of its own, attending up to its own position: decode and
            # verification rows, and (native steps) prefill chunks' rows, whose K/V every layer
            # stores before any row attends.
            logits = compiled.run(flat.input_ids, flat.positions, flat.slot_mapping,
                                  self.pool.block_table[flat.row_slots], self._stage)
            if flat.sample_rows.size == rows:  # every row samples, in row order
                return flat, logits
            if flat.sample_rows.size == 0:  # only partial prefill chunks this step
                return flat, None
            return flat, logits.index_select(0, torch.from_numpy(flat.sample_rows))
        read = flat if extra is None else replace(
            flat,
            sample_rows=np.concatenate([flat.sample_rows, extra.rows]),
            sample_slots=np.concatenate([flat.sample_slots, extra.slots]),
            sample_seq_lens=np.concatenate([flat.sample_seq_lens, extra.seq_lens]),
        )
        meta = self.metadata(read)
        input_ids = self._stage("input_ids", flat.input_ids)
        positions = self._stage("positions", flat.positions)
        hidden = self.model(input_ids, positions, meta, self.pool.layers)  # the rows read out
        if read.sample_rows.size == 0:  # only partial prefill chunks this step
            return flat, None
        # One logits pass over every row read out: under tensor parallelism it is a collective that
        # each worker joins once per step, over the same rows.
        logits = self.model.compute_logits(hidden)
        if extra is not None:
            every_row = read.sample_rows.size == flat.positions.size
            logits = read_out(logits, flat.sample_rows, extra, every_row)
        if flat.sample_rows.size == 0:  # prompt rows only
            return flat, None
        return flat, logits

    def run(self, batch: ScheduledBatch, drafts: DraftProposals | None = None) -> StepResult:
        """drafts: the draft model's distributions behind batch.proposals (sampled proposals are
        verified by rejection sampling; without them, proposals are kept while they match)."""
        structured = self.structured
        assert structured is not None, "the draft's runner only runs forward passes"
        flat, logits = self.forward(batch)
        if logits is None:
            return StepResult([])
        # The sampler runs eager: on the CPU it reads the host array as it is.
        slots_t = (torch.from_numpy(flat.sample_slots) if self.staging is None
                   else self._stage("sample_slots", flat.sample_slots))
        if flat.sample_offsets is not None:
            offsets = (flat.sample_offsets, self._stage("sample_offsets", flat.sample_offsets))
            out = self.sampler.sample(logits, flat.sample_slots, slots_t, structured.mask(), offsets)
            verified = self.verifier.verify(batch, flat.num_decode, flat.sample_slots, logits, out.tokens,
                                            offsets, drafts)
            row_tokens = verified.row_tokens
            result = StepResult(verified.tokens, accepted=verified.accepted)
            self.sampler.advance(verified.slots, torch.as_tensor(verified.slots, device=self.device),
                                 torch.as_tensor(verified.emitted, device=self.device))
            if out.logprobs is not None:  # requests with logprobs never verify: one row each
                keep = torch.as_tensor(verified.seq_rows, device=self.device)
                assert out.top_ids is not None and out.top_logprobs is not None
                out.logprobs, out.top_ids = out.logprobs[keep], out.top_ids[keep]
                out.top_logprobs = out.top_logprobs[keep]
        else:
            out = self.sampler.sample(logits, flat.sample_slots, slots_t, structured.mask())
            row_tokens = out.tokens.tolist()  # the one intended sync of the step
            result = StepResult(row_tokens)
        structured.advance(row_tokens)
        if out.logprobs is not None:
            assert out.top_ids is not None and out.top_logprobs is not None
            result.logprobs = out.logprobs.cpu().numpy()
            result.top_ids = out.top_ids.cpu().numpy()
            result.top_logprobs = out.top_logprobs.cpu().numpy()
        return result

    # -- per-request state ------------------------------------------------------------------
    def admit(self, seq: Sequence, stop_ids: list[int]) -> None:
        self.sampler.set_request(
            seq.slot, seq.params, seq.token_ids[: seq.prompt_len], seq.output_ids, stop_ids
        )
        if seq.params.constrained:
            assert self.structured is not None
            self.structured.admit(seq)

    def release(self, seq: Sequence) -> None:
        self.sampler.free(seq.slot)
        if self.structured is not None:
            self.structured.release(seq)
