"""Batched LoRA: y += (x @ A^T_slot) @ B_slot for the rows of a step that use an adapter, each row its
own slot of the slot table (pipeserve/engine/lora/slots.py), rows without one untouched.

A step's rows come in two kinds, as in Punica: gathered rows (decode and verification rows, one
token of a request each, any slot each) and segments (a prefill chunk: many rows of one request,
one slot). `LoRARows` is the step's index of both, built once per step on the host and staged.

This is the torch path (the reference and cpu backends): rows are grouped by slot and each group
padded to the largest (plus one padded row, so every group has a zero row), so a linear layer's
adapters are two batched matmuls whatever the number of adapters (a matmul per slot costs a fixed
overhead each on the CPU; one dense product over every slot, masked, costs the flops of all of
them); the deltas come back to their rows by one gather (a scatter-add, index_add_, is several
times slower on the CPU). The group covers every row of the step unless padding would more than
double the rows (a long prefill chunk beside a few decode rows): then it covers the gathered rows
and each segment is two plain matmuls. The Triton backend runs the same index through its
shrink/expand kernels (triton_kernels/lora.py).

`add_lora_slots` is the fixed-shape form the compiled steps trace (Inductor) or capture (CUDA graphs):
every row reads its own slot from a [T] index in a persistent buffer (-1: none, as padded rows are),
with no grouping, no data-dependent shape and nothing read back to the host. Here each row's A and B
are gathered and multiplied batched (BGMV's work in torch ops; Inductor compiles it into the step):
its cost grows with the rows (at most 64 in a compiled CPU step), not with --max-loras, as one masked
product over every slot's factors would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRARows:
    """One step's rows -> slots. `slots` [T] (-1: no adapter) with rows 0 .. num_gathered gathered
    rows and segments after them: rows `seg_bounds[i]` .. `seg_bounds[i + 1]` of slot `seg_slots[i]`
    (what the Triton kernels read). The torch path's grouping of rows 0 .. group_cover by slot:
    `group_rows` [k * L] row indices of the k groups padded to L each (padding repeats a row),
    `group_mask` [k * L] (0 on padding), `group_slots` (the k slots; `group_first`: they are 0..k-1,
    a view of the table suffices), `group_back` [group_cover] each row's position in the groups (a
    zero padded row for rows of no adapter); `segments` (start, end, slot) the rest. `kinds`: the
    linear kinds some row's adapter targets."""

    slots: torch.Tensor
    num_gathered: int  # rows 0 .. num_gathered are gathered rows; segments cover the rest they name
    group_rows: torch.Tensor | None
    group_mask: torch.Tensor | None
    group_slots: torch.Tensor | None
    group_first: bool
    group_len: int
    segments: list[tuple[int, int, int]]  # (start, end, slot)
    group_back: torch.Tensor | None = None
    group_cover: int = 0
    seg_bounds: torch.Tensor | None = None  # [G + 1] int32, device (Triton)
    seg_slots: torch.Tensor | None = None  # [G] int32, device (Triton)
    max_seg_len: int = 0
    kinds: frozenset[str] = frozenset()
    every_row_one_slot: int = -1  # every row is a gathered row of this one slot (no grouping needed)

    @property
    def num_groups(self) -> int:
        return 0 if self.group_slots is None else int(self.group_slots.shape[0])


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> None:
    """y [T, out] += the LoRA delta of x [T, in] through slot tables a [S, in, N] (each slot's A
    transposed: a batched matmul over a transposed view is several times slower on the CPU) and
    b [S, N, out] (N: the rank, times the sub-projections a fused linear stacks; B scaled by its
    adapter's alpha / r)."""
    if rows.every_row_one_slot >= 0:
        s = rows.every_row_one_slot
        y.addmm_(x @ a[s], b[s])
        return
    k = rows.num_groups
    if k:
        assert rows.group_rows is not None and rows.group_mask is not None and rows.group_slots is not None
        n_rows, length = rows.group_rows.shape[0], rows.group_len
        if rows.group_first:
            a_k, b_k = a[:k], b[:k]
        else:
            a_k, b_k = a.index_select(0, rows.group_slots), b.index_select(0, rows.group_slots)
        xg = x.index_select(0, rows.group_rows).view(k, length, -1)
        xa = torch.bmm(xg, a_k)  # [k, L, N]
        xa.mul_(rows.group_mask.view(k, length, 1))
        assert rows.group_back is not None
        y[: rows.group_cover] += torch.bmm(xa, b_k).view(n_rows, -1).index_select(0, rows.group_back)
    for start, end, s in rows.segments:
        y[start:end].addmm_(x[start:end] @ a[s], b[s])


def add_lora_slots(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """y [T, out] += (x[t] @ a[slots[t]]) @ b[slots[t]] for every row t whose slot is not -1; slots
    [T] int32 on the device. Every row computes the same work whatever the slots hold (a row of slot
    -1 reads slot 0, its product masked to zero), so the shapes and the ops are fixed per T."""
    index = slots.clamp(min=0).long()
    xa = torch.bmm(x.unsqueeze(1), a.index_select(0, index))  # [T, 1, N]
    xa = xa * (slots >= 0).to(xa.dtype).view(-1, 1, 1)
    y += torch.bmm(xa, b.index_select(0, index)).squeeze(1)
