"""The eager step: the model's ops one by one over the flat batch (any mix of decode rows,
verification rows and prefill chunks). Every other executor falls back to it for the steps it does
not cover."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.model.llama import LlamaForCausalLM

from .base import EAGER
from .buffers import StepBuffers
from .flat import FlatBatch


class EagerStep:
    mode = EAGER

    def __init__(self, *, model: LlamaForCausalLM, pool: KVPool, buffers: StepBuffers, max_rows: int) -> None:
        self.model, self.pool, self.buffers = model, pool, buffers
        self.max_rows = max_rows
        # Tensor parallelism (rank 0): sends each step's model input to the other ranks first.
        self.send_plan: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], None] | None = None

    def prepare(self, every_bucket: bool = False) -> None:
        """Nothing to compile."""

    def covers(self, flat: FlatBatch) -> bool:
        return True

    def metadata(self, flat: FlatBatch) -> AttentionMetadata:
        stage, table = self.buffers.stage, self.pool.block_table
        d_lens = flat.positions[: flat.num_decode] + 1
        max_pages = self.pool.pages_for(int(max(d_lens.max(initial=1), flat.prefill_seq_lens.max(initial=1))))
        p_q = np.diff(flat.prefill_cu_q_lens)
        s_lens = flat.sample_seq_lens
        every_row = flat.every_row_read  # then the rows are 0..T-1
        return AttentionMetadata(
            slot_mapping=stage("slot_mapping", flat.slot_mapping),
            num_decode=flat.num_decode,
            decode_block_tables=stage("decode_block_tables", table[flat.decode_slots, :max_pages]),
            decode_seq_lens=stage("decode_seq_lens", d_lens),
            prefill_block_tables=stage("prefill_block_tables", table[flat.prefill_slots, :max_pages]),
            prefill_cu_q_lens=stage("prefill_cu_q_lens", flat.prefill_cu_q_lens),
            prefill_seq_lens=stage("prefill_seq_lens", flat.prefill_seq_lens),
            prefill_max_q_len=int(p_q.max(initial=0)),
            prefill_max_seq_len=int(flat.prefill_seq_lens.max(initial=0)),
            decode_max_seq_len=int(d_lens.max(initial=0)),
            sample_rows=None if every_row else stage("sample_rows", flat.sample_rows),
            sample_block_tables=None if every_row else stage(
                "sample_block_tables", table[flat.sample_slots, :max_pages]
            ),
            sample_seq_lens=None if every_row else stage("sample_seq_lens", s_lens),
            sample_max_seq_len=int(s_lens.max(initial=0)),
        )

    def run(self, flat: FlatBatch) -> torch.Tensor | None:
        return self.forward(flat)[1]

    def forward(self, flat: FlatBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-norm hidden states of the rows read out (every row, in order, when they are all
        read) and their logits (None: no row is read)."""
        meta = self.metadata(flat)
        input_ids = self.buffers.stage_ids("input_ids", flat.input_ids, flat.device_ids)
        positions = self.buffers.stage("positions", flat.positions)
        if self.send_plan is not None:
            self.send_plan(input_ids, positions, meta)
        hidden = self.model(input_ids, positions, meta, self.pool.layers)  # the rows read out
        if flat.sample_rows.size == 0:  # only partial prefill chunks this step
            return hidden, None
        # One logits pass over every row read out: under tensor parallelism it is a collective that
        # each rank joins once per step, over the same rows.
        return hidden, self.model.compute_logits(hidden)
