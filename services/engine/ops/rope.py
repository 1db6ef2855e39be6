"""Rotary position embeddings (rotate-half layout, as HF Llama): cache construction incl. llama3
and linear scaling, and the torch reference that applies it in place."""

from __future__ import annotations

import math
from typing import Any

import torch

from .step_memo import StepMemo


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def rope_cache(rot_dim: int, max_pos: int, theta: float, scaling: dict[str, Any] | None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_pos, rot_dim] fp32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(rot_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device)


_ROTATION = StepMemo()  # the last rope cache's table: caches are built once per model, never written


def _rotation_table(cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_pos, 2, rot_dim] (cos|cos, -sin|sin) and the rotate-half column order, so that rope is
    x * cos + x[perm] * sin: whole-width ops (the half-width ones run at a third of the speed)."""
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
    table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
    perm = torch.cat([torch.arange(half, 2 * half), torch.arange(half)]).to(cos_sin_cache.device)
    return table, perm


_ROWS = StepMemo()


def _rows(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = table.index_select(0, positions)
    return rows[:, None, 0], rows[:, None, 1]


def _heads_together(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hkv, D] view when k's heads directly follow q's in memory (they do
    when both are slices of one fused qkv projection): one set of ops instead of two."""
    if q.dtype != k.dtype or q.stride() != k.stride() or q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hkv, D], rotated in place at their positions (in fp32, as HF)."""
    if q.shape[0] == 0:
        return
    table, perm = _ROTATION.get((cos_sin_cache,), None, lambda: _rotation_table(cos_sin_cache))
    rot = table.shape[-1]
    cos, sin = _ROWS.get((positions, cos_sin_cache), None, lambda: _rows(table, positions))
    joint = _heads_together(q, k)
    for x in (q, k) if joint is None else (joint,):
        part = x[..., :rot]
        xf = part.float()
        swapped = xf.index_select(-1, perm).mul_(sin)
        if xf.dtype == x.dtype:  # fp32: in place
            part.mul_(cos).add_(swapped)
        else:
            part.copy_(xf.mul_(cos).add_(swapped))
