"""The step's row -> slot index, built once per step from the flat batch with numpy (no loop over
requests) and staged into the runner's persistent buffers: every LoRA linear layer of the step reads
it. Rows: the step's (`full`) and, when the last layer keeps only the rows read out, those (`sample`:
its o_proj and MLP run over them alone)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pipeserve.engine.backend.lora_ops import LoRARows
from pipeserve.engine.parallel.step_plan import AdapterIndex

from .manager import LoRAManager
from .slots import SlotTable

Stage = Callable[[str, np.ndarray], torch.Tensor]


def buffer_shapes(max_tokens: int, max_num_seqs: int,
                  max_loras: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The buffers' dtypes and largest shapes: a group index pads each of up to max_loras groups to
    the largest, at most every row."""
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    groups = (max_tokens + 1) * max_loras
    return {
        "lora_slots": (i32, (max_tokens,)),
        "lora_group_rows": (i64, (groups,)),
        "lora_group_mask": (f32, (groups,)),
        "lora_group_back": (i64, (max_tokens,)),
        "lora_seg_bounds": (i32, (max_num_seqs + 1,)),
        "lora_seg_slots": (i32, (max_num_seqs,)),
        "lora_sample_slots": (i32, (max_tokens,)),
        "lora_sample_group_rows": (i64, (groups,)),
        "lora_sample_group_mask": (f32, (groups,)),
        "lora_sample_group_back": (i64, (max_tokens,)),
    }


def _groups(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray] | None:
    """Rows 0 .. slots.size grouped by slot, each group padded to the largest plus one (padding
    repeats the group's first row, masked): (row index [k * L], mask [k * L], the k slots, L, each
    row's position in the groups: a padded one, whose delta is zero, for rows of no adapter); None
    when no row has an adapter."""
    rows = np.flatnonzero(slots >= 0)
    if not rows.size:
        return None
    order = np.argsort(slots[rows], kind="stable")
    rows = rows[order]
    groups, first, counts = np.unique(slots[rows], return_index=True, return_counts=True)
    k, length = groups.size, int(counts.max()) + 1
    group_of = np.repeat(np.arange(k), counts)
    dest = group_of * length + (np.arange(rows.size) - first[group_of])
    index = np.repeat(rows[first], length)
    index[dest] = rows
    mask = np.zeros(k * length, np.float32)
    mask[dest] = 1.0
    back = np.full(slots.size, length - 1, np.int64)  # group 0's last row: always padding
    back[rows] = dest
    return index, mask, groups, length, back


class LoRAContext:
    """What the LoRA linear layers of one model read during a step: an eager step's index (set by
    `prepare` on the engine's rank, `index` on the other tensor-parallel ranks, which have no manager),
    or while a compiled step traces or captures its forward pass the persistent buffer of its rows'
    slots (`fixed`: every layer then adds each row's adapter by the backend's fixed-shape
    add_lora_slots, whatever the slots hold)."""

    def __init__(self, table: SlotTable, manager: LoRAManager | None = None) -> None:
        self.table, self.manager = table, manager
        self.full: LoRARows | None = None
        self.sample: LoRARows | None = None
        self.sampled = False  # the last layer keeps only the rows read out (its o_proj and MLP)
        self.step: AdapterIndex | None = None  # the last step's index (None: no row had an adapter)
        self.fixed: torch.Tensor | None = None  # int32 [bucket]: the compiled step's rows' slots

    def rows(self, last: bool) -> LoRARows | None:
        return self.sample if last and self.sampled else self.full

    def padded_slots(self, row_slots: np.ndarray, size: int) -> np.ndarray:
        """A compiled step's rows' adapter slots (row_slots: their request slots), padded to its
        bucket of `size` rows with -1 (no adapter): int32 [size]."""
        assert self.manager is not None
        out = np.full(size, -1, np.int32)
        out[: row_slots.size] = self.manager.request_slots[row_slots]
        return out

    def prepare(self, *, row_slots: np.ndarray, chunk_bounds: np.ndarray, sample_rows: np.ndarray | None,
                stage: Stage) -> None:
        """The step's index. row_slots: each row's request slot; chunk_bounds [C + 1]: the prefill
        chunks' absolute row bounds, the gathered rows (decode, verification) before them; sample_rows:
        the rows the last layer keeps (None: every row)."""
        assert self.manager is not None
        lora = self.manager.request_slots[row_slots]
        self.step = AdapterIndex(lora, chunk_bounds, sample_rows) if (lora >= 0).any() else None
        self.index(self.step, stage)

    def index(self, step: AdapterIndex | None, stage: Stage) -> None:
        """The step's index from each row's adapter slot (None: no row has an adapter)."""
        self.sampled = step is not None and step.sample_rows is not None
        self.full = self.sample = None
        if step is None:
            return
        lora, bounds, sample_rows = step.slots, step.chunk_bounds, step.sample_rows
        kinds = frozenset().union(*(self.table.kinds[s] for s in np.unique(lora[lora >= 0])))
        # A chunk's rows are one request's: its slot is its first row's.
        self.full = self._rows(lora, int(bounds[0]), bounds, lora[bounds[:-1]], kinds, stage, "")
        if sample_rows is not None:
            sample = lora[sample_rows]
            if (sample >= 0).any():
                self.sample = self._rows(sample, sample.size, bounds[:1], bounds[:0], kinds, stage, "sample_")

    @staticmethod
    def _rows(lora: np.ndarray, num_gathered: int, bounds: np.ndarray, seg_slots: np.ndarray,
              kinds: frozenset[str], stage: Stage, prefix: str) -> LoRARows:
        slots = stage(f"lora_{prefix}slots", lora.astype(np.int32))
        one = int(lora[0])
        every = one if one >= 0 and bool((lora == one).all()) else -1
        # The torch path groups every row when padding at most doubles them, else the gathered rows
        # (and runs each segment on its own).
        cover = lora.size
        used = lora[lora >= 0]
        if used.size and (np.bincount(used).max() + 1) * np.unique(used).size > 2 * lora.size:
            cover = num_gathered
        groups = _groups(lora[:cover]) if every < 0 else None
        group_rows = group_mask = group_slots = group_back = None
        group_first, length = False, 0
        if groups is not None:
            index, mask, slot_ids, length, back = groups
            group_rows = stage(f"lora_{prefix}group_rows", index)
            group_mask = stage(f"lora_{prefix}group_mask", mask)
            group_back = stage(f"lora_{prefix}group_back", back)
            group_first = bool((slot_ids == np.arange(slot_ids.size)).all())
            group_slots = torch.from_numpy(slot_ids).to(slots.device)  # k ints: used only when not 0..k-1
        use = seg_slots >= 0
        if cover == lora.size or every >= 0:
            use[:] = False
        segments = [(int(a), int(b), int(s)) for a, b, s in zip(bounds[:-1][use], bounds[1:][use],
                                                                 seg_slots[use], strict=True)]
        seg_bounds = seg_slots_t = None
        max_len = 0
        if seg_slots.size and not prefix:
            seg_bounds = stage("lora_seg_bounds", bounds.astype(np.int32))
            seg_slots_t = stage("lora_seg_slots", seg_slots.astype(np.int32))
            max_len = int(np.diff(bounds).max())
        return LoRARows(slots=slots, num_gathered=num_gathered, group_rows=group_rows, group_mask=group_mask,
                        group_slots=group_slots, group_first=group_first, group_len=length, segments=segments,
                        group_back=group_back, group_cover=cover,
                        seg_bounds=seg_bounds, seg_slots=seg_slots_t, max_seg_len=max_len, kinds=kinds,
                        every_row_one_slot=every)
