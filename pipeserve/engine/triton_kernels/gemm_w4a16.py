"""Weight-only 4-bit GEMM (W4A16): fp16/bf16 activations times 4-bit weights dequantized in the inner
loop, group-wise along K (group 128). Two code books:
- int4: asymmetric, w = (q - zero) * scale, zero in [0, 15] per group and output channel (AWQ/GPTQ).
- nf4: w = NF4[q] * absmax, the 16 normal-float levels of QLoRA looked up in a table.
Packing and levels: pipeserve/engine/quantization/formats.py (qweight int32 [K // 8, N], scales [K // group,
N] in the activation dtype, zeros uint8 [K // group, N])."""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pipeserve.engine.quantization.formats import NF4_LEVELS

from .common import (
    compute_dtype,
    dot_precision,
    gemm_autotune,
    gemm_grid,
    gemm_output,
    gemm_store,
    gemm_tile,
    m_bucket,
    split_k_for,
)

SHAPES = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 64, 4, 5), (32, 64, 128, 4, 4),
          (32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3),
          (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
          # 32-deep K tiles: the only ones a 32-wide quantization group admits.
          (16, 64, 32, 4, 5), (32, 128, 32, 4, 4), (64, 128, 32, 4, 4), (128, 128, 32, 8, 3)]
MIN_GROUP = min(s[2] for s in SHAPES)


def tiles_in_group(configs: list[triton.Config], named_args: dict[str, Any],
                   **kwargs: Any) -> list[triton.Config]:
    """Only K tiles that lie in one quantization group (the kernel reads one scale per tile): a tile
    deeper than the group would apply the first group's scale to the next one."""
    group = kwargs.get("QGROUP", named_args.get("QGROUP"))
    return [c for c in configs if group % c.kwargs["BLOCK_K"] == 0]


@triton.jit
def _w4a16_kernel(a_ptr, qw_ptr, scale_ptr, zero_ptr, lut_ptr, c_ptr, M, N, K, M_BUCKET, stride_am, stride_qw,
                  stride_s, stride_cm, QGROUP: tl.constexpr, NF4: tl.constexpr, COMPUTE: tl.constexpr,
                  PRECISION: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # BLOCK_K divides QGROUP and QGROUP divides K: a K-tile lies in one quantization group, unmasked.
    rm, rn, pid_k = gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    rm_safe = (rm % M).to(tl.int64)
    rn_safe = rn % N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        a = tl.load(a_ptr + rm_safe[:, None] * stride_am + (k0 + rk)[None, :])
        # Packed words [BLOCK_K / 8, BLOCK_N] loaded once, unpacked in registers (word r, nibble i: k=8r+i).
        words = tl.load(qw_ptr + (k0 // 8 + rw)[:, None] * stride_qw + rn_safe[None, :])
        codes = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        g = k0 // QGROUP
        scale = tl.load(scale_ptr + g * stride_s + rn_safe).to(tl.float32)
        if NF4:
            w = tl.load(lut_ptr + codes) * scale[None, :]
        else:
            zero = tl.load(zero_ptr + g * stride_s + rn_safe).to(tl.float32)
            w = (codes.to(tl.float32) - zero[None, :]) * scale[None, :]
        acc = tl.dot(a.to(COMPUTE), w.to(COMPUTE), acc, input_precision=PRECISION)
    gemm_store(c_ptr, acc, rm, rn, M, N, stride_cm, SPLIT_K)


_kernel = gemm_autotune(SHAPES, key=["NF4", "QGROUP"], prune=tiles_in_group)(_w4a16_kernel)
_luts: dict[torch.device, torch.Tensor] = {}


def nf4_lut(device: torch.device) -> torch.Tensor:
    """The 16 NF4 levels as an fp32 table on `device`, built once per device."""
    if device not in _luts:
        _luts[device] = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    return _luts[device]


def w4a16_gemm(
    a: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """a [M, K] (fp16/bf16/fp32) x 4-bit W [N, K] -> [M, N] in a's dtype. zeros given: int4 with zero
    points; zeros None: nf4 (scales are the group absmax)."""
    m, k = a.shape
    n = qweight.shape[1]
    group = k // scales.shape[0]
    assert qweight.shape[0] * 8 == k and group * scales.shape[0] == k and a.stride(1) == 1
    assert group % MIN_GROUP == 0, f"4-bit groups must be multiples of {MIN_GROUP} along K, got {group}"
    assert zeros is None or zeros.stride() == scales.stride()
    split_k = split_k_for(m, n, k, a.device) if split_k is None else split_k
    compute = compute_dtype(a.dtype)
    c = gemm_output(m, n, a.dtype, split_k, a.device)
    if m:
        _kernel[gemm_grid](
            a, qweight, scales, zeros, nf4_lut(a.device), c, m, n, k, m_bucket(m),
            a.stride(0), qweight.stride(0), scales.stride(0), c.stride(0),
            QGROUP=group, NF4=zeros is None, COMPUTE=compute, PRECISION=dot_precision(compute),
            SPLIT_K=split_k,
        )  # fmt: skip
    return c.to(a.dtype) if split_k > 1 else c
