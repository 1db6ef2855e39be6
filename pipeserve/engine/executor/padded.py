"""What the Inductor and CUDA-graph executors share: batch-size buckets, padding a decode step up to
its bucket over a scratch KV page, and the decode-rows forward pass they compile or capture.

A step whose rows are all decode rows (one query token each; a speculative verification chunk's
1 + k rows count, each attending up to its own position) is padded up to the smallest bucket that
holds it. Its inputs are the runner's persistent buffers, refilled in place. Padded rows read and
write only a scratch page reserved for them, and their logits are cut off before the sampler, so
they never touch a request's cache or sampling state. Every layer stores all rows' K/V before any
row attends, so a verification chunk's rows sharing one block table are causal by seq_len alone.

With LoRA adapters (pipeserve/engine/lora) each row's adapter slot is one more staged input (`lora_slots`,
-1 for no adapter and for padded rows): the forward pass hands it to the LoRA layers, which apply it
with fixed shapes (the backend's add_lora_slots), so one compiled or captured bucket serves every mix
of adapters, and swaps, which write the slot table in place, need no recompile.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod

import numpy as np
import torch

from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.lora.rows import LoRAContext
from pipeserve.engine.model.llama import LlamaForCausalLM

from .buffers import StepBuffers
from .flat import FlatBatch

_FORWARD = inspect.unwrap(LlamaForCausalLM.forward)
_LOGITS = inspect.unwrap(LlamaForCausalLM.compute_logits)
# The staged inputs of a padded step, in the order the compiled forward pass takes them.
INPUTS = ("input_ids", "positions", "slot_mapping", "decode_block_tables", "decode_seq_lens")
LORA_INPUT = "lora_slots"  # after them, with LoRA adapters


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below max_num_seqs, then max_num_seqs itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return (*sizes, max_num_seqs)


def select_rows(logits: torch.Tensor, flat: FlatBatch, buffers: StepBuffers) -> torch.Tensor | None:
    """The logits of flat's sample rows out of those [n, V] of every row."""
    if flat.every_row_read:
        return logits
    if flat.sample_rows.size == 0:  # only partial prefill chunks this step
        return None
    # The index lives where the logits do (a CUDA tensor indexed by a CPU one would sync).
    return logits.index_select(0, buffers.host_or_stage("sample_rows", flat.sample_rows))


class PaddedStep(ABC):
    """Buckets up to `top` rows (and the exact row counts below it), padding onto a scratch page."""

    mode = ""  # set by each subclass
    full_width = False  # tables padded to the block table's whole width (a captured graph's shape)

    def __init__(self, *, model: LlamaForCausalLM, pool: KVPool, buffers: StepBuffers, top: int,
                 exact: tuple[int, ...] = (), lora: LoRAContext | None = None) -> None:
        """top: the largest bucket. exact: row counts that get a bucket of their own (a batch-1
        verification step's 1 + j rows: padding them up to a power of two adds whole rows of
        products, and on the CPU MKL's F.linear over 4 rows cost twice its 3). lora: the context of
        the model's LoRA layers, where it has them."""
        self.model, self.pool, self.buffers, self.lora = model, pool, buffers, lora
        sizes = batch_buckets(top)
        self.buckets = tuple(sorted(set(sizes).union(n for n in exact if n < sizes[-1])))
        self.exact = tuple(n for n in exact if n <= self.buckets[-1])
        self.max_rows = self.buckets[-1]
        self.page_size = pool.page_size
        # Padded rows (and warm-up steps) write their K/V here.
        self.scratch_page = pool.reserve_scratch_page()

    def covers(self, flat: FlatBatch) -> bool:
        return 0 < flat.num_decode + flat.num_verify_rows == flat.num_rows <= self.max_rows

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] of a batch of decode rows; the gather width is the tables' page count.
        lora_slots: each row's adapter slot (with LoRA adapters)."""
        empty = block_tables[:0]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode=input_ids.shape[0],
            decode_block_tables=block_tables,
            decode_seq_lens=seq_lens,
            prefill_block_tables=empty,
            prefill_cu_q_lens=seq_lens[:1],
            prefill_seq_lens=seq_lens[:0],
            prefill_max_q_len=0,
            prefill_max_seq_len=0,
            decode_max_seq_len=block_tables.shape[1] * self.page_size,
        )
        if self.lora is not None:  # traced as the graph's input: the LoRA layers read it
            self.lora.fixed = lora_slots
        try:
            # The undecorated methods: Inductor cannot trace an inference_mode context inside the
            # compiled region (views of buffers fail), so the caller enters it outside.
            hidden = _FORWARD(self.model, input_ids, positions, meta, self.pool.layer_views())
        finally:
            if self.lora is not None:  # eager steps after this one read their own index
                self.lora.fixed = None
        logits: torch.Tensor = _LOGITS(self.model, hidden)
        return logits

    def pad(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            tables: np.ndarray) -> tuple[np.ndarray, ...]:
        """The step's host arrays padded to its bucket; tables: its rows of the block table."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        width = tables.shape[1] if self.full_width else self.gather_width(positions)
        ids = np.zeros(size, np.int64)
        pos = np.zeros(size, np.int64)
        slots = np.full(size, self.scratch_page * self.page_size, np.int64)
        table = np.full((size, width), self.scratch_page, np.int32)
        lens = np.ones(size, np.int32)
        ids[:n], pos[:n], slots[:n], lens[:n] = input_ids, positions, slot_mapping, positions + 1
        table[:n] = tables[:, :width]
        return ids, pos, slots, table, lens

    def gather_width(self, positions: np.ndarray) -> int:
        """KV pages a step reads per row: enough for its longest row, at least 2 (a width of 1 would
        be specialized as a constant), at most the table's width."""
        need = int(positions.max()) // self.page_size + 1
        return min(max(need, 2), self.pool.max_pages_per_seq)

    def run(self, flat: FlatBatch) -> torch.Tensor | None:
        n = flat.num_rows
        tables = self.pool.block_table[flat.row_slots]
        arrays = self.pad(flat.input_ids, flat.positions, flat.slot_mapping, tables)
        ids = self.buffers.stage_ids(INPUTS[0], arrays[0], flat.device_ids)
        args = (ids, *(self.buffers.stage(name, a) for name, a in zip(INPUTS[1:], arrays[1:], strict=True)))
        if self.lora is not None:
            args += (self.buffers.stage(LORA_INPUT, self.lora.padded_slots(flat.row_slots, ids.shape[0])),)
        with torch.inference_mode():
            logits = self.execute(args)[:n]
        return select_rows(logits, flat, self.buffers)

    def run_scratch(self, size: int) -> None:
        """One step of `size` rows over the scratch page alone (which no request reads): compiles or
        captures that bucket before serving."""
        zeros = np.zeros(size, np.int64)
        slots = np.full(size, self.scratch_page * self.page_size, np.int64)
        tables = np.full((size, self.pool.max_pages_per_seq), self.scratch_page, np.int32)
        arrays = self.pad(zeros, zeros, slots, tables)
        args = tuple(self.buffers.stage(name, a) for name, a in zip(INPUTS, arrays, strict=True))
        if self.lora is not None:  # no adapter: the same ops, each row's product masked
            args += (self.buffers.stage(LORA_INPUT, np.full(size, -1, np.int32)),)
        with torch.inference_mode():
            self.execute(args)

    @abstractmethod
    def execute(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Logits of the padded bucket whose staged inputs are args (each subclass its own way)."""

    @abstractmethod
    def prepare(self, every_bucket: bool = False) -> None:
        """Compile or capture buckets before the engine serves."""
