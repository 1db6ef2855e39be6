"""Number formats every quantizer in the engine shares (KV cache, activations, weights), in torch.

- int8 / fp8 (float8_e4m3fn) codes: values divided by a symmetric scale, then rounded half away from
  zero and saturated to [-127, 127] (int8) or clamped to [-448, 448] and cast (fp8). The Triton
  kernels round the same way (pipeserve/engine/triton_kernels/quantize.py).
- 4-bit weights (W4A16): int4 with zero points, w = (q - zero) * scale, or NF4, w = NF4_LEVELS[q] *
  absmax, in groups of W4_GROUP along K. Packed int32 [K // 8, N]: nibble i of word r holds k = 8 r + i,
  so a K-tile of a column is a few words and the N direction stays contiguous.
"""

from __future__ import annotations

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}

W4_GROUP = 128
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


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """The rounding the kernels use (their float -> int casts truncate, so they add +-0.5 first)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def safe_inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in fp32, 0 where scale == 0 (an all-zero group quantizes to zeros)."""
    scale = scale.float()
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))


def to_codes(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values already divided by their scale -> int8 (round half away, saturate) or fp8 codes."""
    if dtype == torch.int8:
        return round_half_away(y).clamp_(-127, 127).to(torch.int8)
    return y.clamp(-448.0, 448.0).to(dtype)


def per_row_quant(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] -> (codes [T, N] int8 / fp8, fp32 scale [T, 1]) with scale = max|row| / qmax."""
    # Times the reciprocal, as the kernels do: bit-identical on every device (torch on CUDA divides a
    # tensor by a scalar through its reciprocal, the CPU does not).
    scale = x.float().abs().amax(-1, keepdim=True) * (1.0 / QMAX[dtype])
    return to_codes(x.float() * safe_inverse(scale), dtype), scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> int32 [K // 8, N]."""
    n, k = codes.shape
    nibbles = codes.T.reshape(k // 8, 8, n).to(torch.int64)
    words = (nibbles << (4 * torch.arange(8, device=codes.device))[None, :, None]).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] -> codes [N, K] (int64)."""
    shifts = 4 * torch.arange(8, device=qweight.device)
    nibbles = (qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & 0xF
    return nibbles.reshape(-1, qweight.shape[1]).T


def dequantize_4bit(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 weight [N, K] the codes stand for: int4 with `zeros`, NF4 (scales = absmax) without."""
    codes = unpack_int4(qweight)
    k = codes.shape[1]

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.float().T.repeat_interleave(k // t.shape[0], dim=1)

    if zeros is None:
        return torch.tensor(NF4_LEVELS, device=codes.device)[codes] * expand(scales)
    return (codes.float() - expand(zeros)) * expand(scales)
