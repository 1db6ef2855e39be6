"""How one step's flat batch maps onto the paged KV cache: built once per step by the runner, read by
every attention layer (and by the key shift of quantized caches).

The flat batch holds decode rows first (q length 1) and prefill rows after."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    num_decode: int
    decode_block_tables: torch.Tensor  # int32 [Bd, max_pages]
    decode_seq_lens: torch.Tensor  # int32 [Bd]
    prefill_block_tables: torch.Tensor  # int32 [Bp, max_pages]
    prefill_cu_q_lens: torch.Tensor  # int32 [Bp + 1]
    prefill_seq_lens: torch.Tensor  # int32 [Bp]
    prefill_max_q_len: int
    prefill_max_seq_len: int
    decode_max_seq_len: int = 0  # host copy of max(decode_seq_lens); 0: read it from the tensor
    # The rows whose hidden states the step reads (the sampled ones: every decode row, the last row
    # of each finished prompt), each its sequence's newest token: a decode batch of their own. With
    # them the model's last layer attends and runs its MLP for these rows alone. None: every row
    # (also what the runner sends when every row samples, as in a step of decoding only).
    sample_rows: torch.Tensor | None = None  # int64 [R], into the flat batch
    sample_block_tables: torch.Tensor | None = None  # int32 [R, max_pages]
    sample_seq_lens: torch.Tensor | None = None  # int32 [R]
    sample_max_seq_len: int = 0

    @property
    def num_prefill_seqs(self) -> int:
        return int(self.prefill_seq_lens.shape[0])
