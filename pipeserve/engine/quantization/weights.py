"""Load-time weight quantizers (no calibration data): what an ordinary fp32/fp16/bf16 checkpoint's
linear weight [N, K] becomes under each method, in the code formats of
pipeserve/engine/quantization/formats.py:

- W8A8 int8 / fp8: one symmetric scale per output channel, or one per tensor for the ablation that
  shows why per-channel matters.
- W4A16 int4 / nf4: groups are `min(128, K)` wide. The kernel wants K a multiple of the group (and
  of 8, the codes per packed word), so a ragged K (stories260K's down_proj has K = 172) is padded
  with zero columns: zeros do not move a group's range (the int4 range always contains 0, and they
  cannot raise an absmax), and the GEMM pads the activations with zeros to match.
  Round-to-nearest over a group's full range spends levels on its few largest weights, so int4 clips
  each group's range first, by the ratio (from CLIP_RATIOS) that minimises the group's squared
  error: a calibration-free search (the `mse` option of GPTQ's RTN baseline); it does not help NF4,
  whose levels already follow a normal weight distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .formats import (
    NF4_LEVELS,
    QMAX,
    W4_GROUP,
    dequantize_4bit,
    pack_int4,
    per_row_quant,
    safe_inverse,
    to_codes,
)

WEIGHT_ONLY_FORMATS = ("int4", "nf4")
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def quantize_per_channel(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes [N, K] int8 / fp8, fp32 scale [N]): one symmetric scale per output channel."""
    q, scale = per_row_quant(w.float(), dtype)
    return q, scale[:, 0]


def quantize_per_tensor(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes, fp32 scale [N]) with one scale for the whole tensor (the ablation)."""
    scale = w.float().abs().amax() / QMAX[dtype]
    return to_codes(w.float() * safe_inverse(scale), dtype), scale.expand(w.shape[0]).contiguous()


def round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 x stored as `dtype` without rounding down (a scale rounded down would make the group's
    extremes overflow the 16 codes and clip), back in fp32."""
    stored = x.to(dtype)
    up = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    return torch.where(stored.float() < x, up, stored).float()


def quantize_int4(w: torch.Tensor, group: int = W4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear weight [N, K] -> (qweight, scales [K // group, N] in w's dtype, zeros uint8 [K // group, N])."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo = wg.amin(-1).clamp(max=0.0)
    hi = wg.amax(-1).clamp(min=0.0)
    scale = round_up_to(((hi - lo) / 15), w.dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.round(wg / scale[..., None] + zero[..., None]).clamp(0, 15).reshape(n, k)
    return (
        pack_int4(codes.to(torch.int64)),
        scale.to(w.dtype).T.contiguous(),
        zero.to(torch.uint8).T.contiguous(),
    )


def quantize_nf4(w: torch.Tensor, group: int = W4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear weight [N, K] -> (qweight, absmax scales [K // group, N] in w's dtype)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    absmax = wg.abs().amax(-1).to(w.dtype).float()
    normed = wg / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[..., None]
    levels = torch.tensor(NF4_LEVELS, device=w.device)
    codes = (normed[..., None] - levels).abs().argmin(-1).reshape(n, k)
    return pack_int4(codes), absmax.to(w.dtype).T.contiguous()


@dataclass
class Packed4bit:
    """A 4-bit weight in the W4A16 kernel's layout, K zero-padded to `padded_k`."""

    qweight: torch.Tensor  # int32 [padded_k // 8, N]
    scales: torch.Tensor  # [padded_k // group, N]: int4 scale or nf4 absmax
    zeros: torch.Tensor | None  # uint8 [padded_k // group, N] for int4; None for nf4
    in_features: int

    @property
    def padded_k(self) -> int:
        return self.qweight.shape[0] * 8

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] weight the codes stand for."""
        return dequantize_4bit(self.qweight, self.scales, self.zeros)[:, : self.in_features]


def group_size(in_features: int, group: int = W4_GROUP) -> int:
    return min(group, in_features)


def padded_in_features(in_features: int, group: int = W4_GROUP) -> int:
    step = group_size(in_features, group)
    step = math.lcm(step, 8)  # a whole number of groups and of packed words
    return -(-in_features // step) * step


def quantize_4bit(w: torch.Tensor, fmt: str, group: int = W4_GROUP,
                  clip_ratios: tuple[float, ...] | None = None) -> Packed4bit:
    """[N, K] -> Packed4bit in format "int4" (asymmetric, zero points) or "nf4" (NF4 levels), each
    group's range clipped by the best of `clip_ratios` ((1.0,): plain round-to-nearest; default:
    CLIP_RATIOS for int4, none for nf4, whose levels already follow a normal weight distribution)."""
    if fmt not in WEIGHT_ONLY_FORMATS:
        raise ValueError(f"4-bit format must be one of {WEIGHT_ONLY_FORMATS}, got {fmt!r}")
    clip_ratios = clip_ratios or (CLIP_RATIOS if fmt == "int4" else (1.0,))
    k = w.shape[1]
    g = group_size(k, group)
    wp = F.pad(w, (0, padded_in_features(k, group) - k)).view(w.shape[0], -1, g)
    lo, hi = wp.amin(-1, keepdim=True), wp.amax(-1, keepdim=True)
    if clip_ratios == (1.0,):
        clip_ratios = ()  # nothing to search

    def quantize(ratio: torch.Tensor) -> Packed4bit:
        clipped = torch.minimum(torch.maximum(wp, lo * ratio), hi * ratio).flatten(1)
        if fmt == "int4":
            return Packed4bit(*quantize_int4(clipped, g), in_features=k)
        return Packed4bit(*quantize_nf4(clipped, g), zeros=None, in_features=k)

    best_err, best_ratio = None, torch.ones_like(lo)
    for r in clip_ratios:  # per group, keep the ratio with the smallest squared error
        ratio = torch.full_like(lo, r)
        packed = quantize(ratio)
        deq = dequantize_4bit(packed.qweight, packed.scales, packed.zeros).view_as(wp)
        err = (deq - wp.float()).square().sum(-1, keepdim=True)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err, best_ratio = torch.where(better, err, best_err), torch.where(better, ratio, best_ratio)
    return quantize(best_ratio)


