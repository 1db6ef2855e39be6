"""Weight-only 4-bit GEMM (W4A16): fp16/bf16 activations times 4-bit weights dequantized in the inner
loop, group-wise along K (group 128). Two code books:
- int4: asymmetric, w = (q - zero) * scale, zero in [0, 15] per group and output channel (AWQ/GPTQ).
- nf4: w = NF4[q] * absmax, the 16 normal-float levels of QLoRA looked up in a table.
Packing: qweight int32 [K // 8, N], nibble i of word r is k = 8 r + i, so a K-tile of a column is a
few words and the N direction stays contiguous. scales [K // group, N] in the activation dtype,
zeros uint8 [K // group, N]. Reference quantizers, dequantizers and GEMM are below."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import autotune, compute_dtype, gemm_grid, m_bucket, prune_by_m, split_k_for, tile_ids

GROUP = 128
# QLoRA's NF4 levels (quantiles of N(0, 1) scaled to [-1, 1], exact zero included).
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def _configs() -> list[triton.Config]:
    shapes = [
        (16, 64, 128, 4, 4),
        (16, 128, 128, 4, 4),
        (16, 64, 64, 4, 5),
        (32, 64, 128, 4, 4),
        (32, 128, 128, 4, 4),
        (64, 64, 128, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 128, 128, 8, 3),
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 128, 128, 8, 3),
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


@triton.jit
def _w4a16_kernel(
    a_ptr,
    qw_ptr,
    scale_ptr,
    zero_ptr,
    lut_ptr,
    c_ptr,
    M,
    N,
    K,
    M_BUCKET,
    stride_am,
    stride_qw,
    stride_s,
    stride_cm,
    QGROUP: tl.constexpr,
    NF4: tl.constexpr,
    COMPUTE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # BLOCK_K divides QGROUP and QGROUP divides K: a K-tile lies in one quantization group, unmasked.
    pid_m, pid_n = tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
        acc = tl.dot(a.to(COMPUTE), w.to(COMPUTE), acc)
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c_ptrs, acc, mask=mask)


_kernel = autotune(
    _configs(),
    key=["M_BUCKET", "N", "K", "SPLIT_K", "NF4"],
    interpret_config=triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}),
    prune_configs_by={"early_config_prune": prune_by_m},
    reset_to_zero=["c_ptr"],
)(_w4a16_kernel)
_luts: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
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
    assert zeros is None or zeros.stride() == scales.stride()
    split_k = split_k_for(m, n, k, a.device) if split_k is None else split_k
    c = (
        torch.zeros(m, n, dtype=torch.float32, device=a.device)
        if split_k > 1
        else torch.empty(m, n, dtype=a.dtype, device=a.device)
    )
    if m:
        _kernel[gemm_grid](
            a,
            qweight,
            scales,
            zeros,
            _lut(a.device),
            c,
            m,
            n,
            k,
            m_bucket(m),
            a.stride(0),
            qweight.stride(0),
            scales.stride(0),
            c.stride(0),
            QGROUP=group,
            NF4=zeros is None,
            COMPUTE=compute_dtype(a.dtype),
            SPLIT_K=split_k,
        )
    return c.to(a.dtype) if split_k > 1 else c


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> int32 [K // 8, N] (nibble i of word r holds k = 8 r + i)."""
    n, k = codes.shape
    nibbles = codes.T.reshape(k // 8, 8, n).to(torch.int64)
    words = (nibbles << (4 * torch.arange(8, device=codes.device))[None, :, None]).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] -> codes [N, K] (int64)."""
    shifts = 4 * torch.arange(8, device=qweight.device)
    nibbles = (qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & 0xF
    return nibbles.reshape(-1, qweight.shape[1]).T


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear weight [N, K] -> (qweight, scales [K // group, N] in w's dtype, zeros uint8 [K // group, N])."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo = wg.amin(-1).clamp(max=0.0)
    hi = wg.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).to(w.dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.round(wg / scale[..., None] + zero[..., None]).clamp(0, 15).reshape(n, k)
    return (
        pack_int4(codes.to(torch.int64)),
        scale.to(w.dtype).T.contiguous(),
        zero.to(torch.uint8).T.contiguous(),
    )


def quantize_nf4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear weight [N, K] -> (qweight, absmax scales [K // group, N] in w's dtype)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    absmax = wg.abs().amax(-1).to(w.dtype).float()
    normed = wg / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[..., None]
    levels = torch.tensor(NF4_LEVELS, device=w.device)
    codes = (normed[..., None] - levels).abs().argmin(-1).reshape(n, k)
    return pack_int4(codes), absmax.to(w.dtype).T.contiguous()


def dequantize_4bit(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """The weight [N, K] in fp32, as the kernel reconstructs it."""
    codes = unpack_int4(qweight)
    k = codes.shape[1]
    expand = lambda t: t.float().T.repeat_interleave(k // t.shape[0], dim=1)
    if zeros is None:
        return torch.tensor(NF4_LEVELS, device=codes.device)[codes] * expand(scales)
    return (codes.float() - expand(zeros)) * expand(scales)


def w4a16_gemm_ref(
    a: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    return (a.float() @ dequantize_4bit(qweight, scales, zeros).T).to(a.dtype)
