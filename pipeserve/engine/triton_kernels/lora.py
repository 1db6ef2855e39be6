"""Batched LoRA as Punica's shrink/expand pair: y += (x @ A^T_slot) @ B_slot per row, the slot table
a [S, in, N] (A transposed), b [S, N, out] (pipeserve/engine/lora/slots.py; N is the rank times the
sub-projections a fused linear stacks), the rows' index a `LoRARows` (backend/lora_ops.py).

- gathered rows (decode and verification rows, BGMV): one program per row and output tile, each
  reading its own slot: a matrix-vector product, as one row's work is;
- segments (prefill chunks, SGMV): one program per tile of a chunk's rows, all of one slot: tl.dot
  tiles.
The shrink writes x @ A^T in fp32 ([T, N]); the expand adds its product with B into y in place. A
row of slot -1 is skipped (its y untouched). `add_lora_slots` runs every row as a gathered row, its
slot read from the device: the compiled steps' fixed-shape form (a CUDA graph captures its launches).
"""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .common import compute_dtype, dot_precision, pow2

if TYPE_CHECKING:  # the backend package imports these kernels; the rows' type is only named here
    from pipeserve.engine.backend.lora_ops import LoRARows

BLOCK_K = 64  # input features per step of the shrink's loop
BLOCK_OUT = 64  # output features per expand program
BLOCK_M = 16  # segment rows per SGMV program


@triton.jit
def _bgmv_shrink_kernel(x, a, out, slots, K, N, stride_x, stride_as, stride_ak, stride_o,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(slots + t).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if s >= 0:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            av = tl.load(a + s * stride_as + n[:, None] + k[None, :] * stride_ak,
                         mask=(n[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(out + t * stride_o + n, acc, mask=n < N)


@triton.jit
def _bgmv_expand_kernel(xa, b, y, slots, N, OUT, stride_xa, stride_bs, stride_bn, stride_y,
                 BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(slots + t).to(tl.int64)
    if s >= 0:
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        n = tl.arange(0, BLOCK_N)
        xv = tl.load(xa + t * stride_xa + n, mask=n < N, other=0.0)
        bv = tl.load(b + s * stride_bs + n[:, None] * stride_bn + o[None, :],
                     mask=(n[:, None] < N) & (o[None, :] < OUT), other=0.0).to(tl.float32)
        acc = tl.sum(bv * xv[:, None], axis=0)
        ptr = y + t * stride_y + o
        yv = tl.load(ptr, mask=o < OUT, other=0.0).to(tl.float32)
        tl.store(ptr, (yv + acc).to(y.dtype.element_ty), mask=o < OUT)


@triton.jit
def _segment_tile(bounds, seg_slots, BLOCK_M: tl.constexpr):
    """(slot, first row, end) of this program's tile: segment program_id(0), tile program_id(1)."""
    g = tl.program_id(0)
    first = tl.load(bounds + g) + tl.program_id(1) * BLOCK_M
    return tl.load(seg_slots + g).to(tl.int64), first, tl.load(bounds + g + 1)


@triton.jit
def _sgmv_shrink_kernel(x, a, out, bounds, seg_slots, K, N, stride_x, stride_as, stride_ak, stride_o,
                 COMPUTE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    s, first, end = _segment_tile(bounds, seg_slots, BLOCK_M)
    if (s >= 0) & (first < end):
        rows = first + tl.arange(0, BLOCK_M)
        n = tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                         mask=(rows[:, None] < end) & (k[None, :] < K), other=0.0)
            at = tl.load(a + s * stride_as + n[None, :] + k[:, None] * stride_ak,
                         mask=(n[None, :] < N) & (k[:, None] < K), other=0.0)
            acc = tl.dot(xt.to(COMPUTE), at.to(COMPUTE), acc, input_precision=PRECISION)
        tl.store(out + rows[:, None].to(tl.int64) * stride_o + n[None, :], acc,
                 mask=(rows[:, None] < end) & (n[None, :] < N))


@triton.jit
def _sgmv_expand_kernel(xa, b, y, bounds, seg_slots, N, OUT, stride_xa, stride_bs, stride_bn, stride_y,
                 COMPUTE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr):
    s, first, end = _segment_tile(bounds, seg_slots, BLOCK_M)
    if (s >= 0) & (first < end):
        rows = first + tl.arange(0, BLOCK_M)
        n = tl.arange(0, BLOCK_N)
        o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
        xt = tl.load(xa + rows[:, None].to(tl.int64) * stride_xa + n[None, :],
                     mask=(rows[:, None] < end) & (n[None, :] < N), other=0.0)
        bt = tl.load(b + s * stride_bs + n[:, None] * stride_bn + o[None, :],
                     mask=(n[:, None] < N) & (o[None, :] < OUT), other=0.0)
        acc = tl.dot(xt.to(COMPUTE), bt.to(COMPUTE), input_precision=PRECISION)
        ptr = y + rows[:, None].to(tl.int64) * stride_y + o[None, :]
        mask = (rows[:, None] < end) & (o[None, :] < OUT)
        yv = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (yv + acc).to(y.dtype.element_ty), mask=mask)


def _gathered_shrink(x: torch.Tensor, a: torch.Tensor, out: torch.Tensor, slots: torch.Tensor,
                     num_rows: int) -> None:
    """out[t] = x[t] @ a[slots[t]] for rows 0 .. num_rows (BGMV: one program per row)."""
    n = a.shape[2]
    _bgmv_shrink_kernel[(num_rows,)](x, a, out, slots, x.shape[1], n, x.stride(0), a.stride(0), a.stride(1),
                                     out.stride(0), BLOCK_N=pow2(n, 16), BLOCK_K=BLOCK_K)


def _gathered_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                     num_rows: int) -> None:
    """y[t] += xa[t] @ b[slots[t]] for rows 0 .. num_rows, in place (BGMV)."""
    n, d_out = b.shape[1], b.shape[2]
    grid = (num_rows, triton.cdiv(d_out, BLOCK_OUT))
    _bgmv_expand_kernel[grid](xa, b, y, slots, n, d_out, xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
                              BLOCK_N=pow2(n, 16), BLOCK_O=BLOCK_OUT)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """x @ A^T_slot of every LoRA row, fp32 [T, N] (rows of no adapter left unwritten)."""
    t, k_in = x.shape
    n = a.shape[2]
    assert a.stride(2) == 1
    out = torch.empty((t, n), dtype=torch.float32, device=x.device)
    block_n = pow2(n, 16)
    if rows.num_gathered:
        _gathered_shrink(x, a, out, rows.slots, rows.num_gathered)
    if rows.seg_bounds is not None and rows.seg_slots is not None and rows.max_seg_len:
        compute = compute_dtype(x.dtype)
        grid = (rows.seg_slots.shape[0], triton.cdiv(rows.max_seg_len, BLOCK_M))
        _sgmv_shrink_kernel[grid](x, a, out, rows.seg_bounds, rows.seg_slots, k_in, n, x.stride(0),
                                  a.stride(0), a.stride(1), out.stride(0), COMPUTE=compute,
                                  PRECISION=dot_precision(compute), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                                  BLOCK_K=BLOCK_K)
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> None:
    """y += xa @ B_slot, in place, for every LoRA row."""
    n, d_out = b.shape[1], b.shape[2]
    block_n = pow2(n, 16)
    if rows.num_gathered:
        _gathered_expand(y, xa, b, rows.slots, rows.num_gathered)
    if rows.seg_bounds is not None and rows.seg_slots is not None and rows.max_seg_len:
        compute = compute_dtype(y.dtype)
        grid3 = (rows.seg_slots.shape[0], triton.cdiv(rows.max_seg_len, BLOCK_M),
                 triton.cdiv(d_out, BLOCK_OUT))
        _sgmv_expand_kernel[grid3](xa, b, y, rows.seg_bounds, rows.seg_slots, n, d_out, xa.stride(0),
                                   b.stride(0), b.stride(1), y.stride(0), COMPUTE=compute,
                                   PRECISION=dot_precision(compute), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                                   BLOCK_O=BLOCK_OUT)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> None:
    lora_expand(y, lora_shrink(x, a, rows), b, rows)


def add_lora_slots(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """add_lora with every row a gathered row of its own slot, read from slots [T] on the device (-1:
    none, skipped by the kernels): a fixed grid of T programs whatever the slots hold, so a CUDA
    graph captures it once per batch size and replays it with the slots of each step."""
    assert a.stride(2) == 1
    t = x.shape[0]
    out = torch.empty((t, a.shape[2]), dtype=torch.float32, device=x.device)
    _gathered_shrink(x, a, out, slots, t)
    _gathered_expand(y, out, b, slots, t)
