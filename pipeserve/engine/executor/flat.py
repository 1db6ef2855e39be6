"""The host-side (numpy) model input of one step, built by the runner and run by a step executor."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DeviceIds:
    """Input ids the host has not read: a draft model's proposals, which stay on the device from
    drafting through verification (the step's one readback brings them back with its results)."""

    rows: np.ndarray  # int64: the rows of the flat batch they fill (their input_ids are placeholders)
    values: torch.Tensor  # int64 [len(rows)], on the step's device


@dataclass(kw_only=True)
class FlatBatch:
    """Every row of the step (decode rows, then verification and prefill chunks' rows), and the rows
    read out of the last layer (sample_rows, with their request slots and lengths)."""

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
    device_ids: DeviceIds | None = None  # rows whose input ids live on the device only

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.size)

    @property
    def every_row_read(self) -> bool:
        """Whether the rows read out are every row, in order."""
        return self.sample_rows.size == self.input_ids.size
