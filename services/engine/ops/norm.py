"""RMSNorm (optionally fused with the residual add): torch reference."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: norm(x). With residual: (norm(x + residual), x + residual), as the
    pre-norm transformer block needs both. Accumulates in fp32 like HF."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * out.to(x.dtype)
    return out if residual is None else (out, residual)
