"""Quantized KV cache formats: torch reference for quantize (store) and dequantize (attention).

Both formats are symmetric with one fp16 scale per group of consecutive channels of a token's head
(PPL.LLM: group 8). The group size lives in the scale tensor's shape: group = D // scale.shape[-1].
- int8: scale = max|x| / 127, q = round(x / scale) (half away from zero), clamped to [-127, 127].
- fp8 (float8_e4m3fn): scale = max|x| / 448, q = fp8(x / scale).
The scale is rounded to fp16 before dividing, so the stored scale is exactly the one used.
"""

from __future__ import annotations

import torch

KV_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
DEFAULT_GROUP = 8


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """The rounding the kernels use (float -> int casts truncate, so they add +-0.5 first)."""
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


def quantize_kv(
    x: torch.Tensor, dtype: torch.dtype, group: int = DEFAULT_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] of dtype, scale fp16 [..., D // group])."""
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"head_dim {d} is not a multiple of the KV quantization group {group}")
    xg = x.float().unflatten(-1, (d // group, group))
    scale = (xg.abs().amax(-1) / QMAX[dtype]).to(torch.float16)
    return to_codes(xg * safe_inverse(scale)[..., None], dtype).flatten(-2), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., D], scale [..., D // group] -> fp32 [..., D]."""
    groups = scale.shape[-1]
    return (q.float().unflatten(-1, (groups, q.shape[-1] // groups)) * scale.float()[..., None]).flatten(-2)
