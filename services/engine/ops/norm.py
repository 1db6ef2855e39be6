"""RMSNorm (optionally fused with the residual add): torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: norm(x). With residual: (norm(x + residual), x + residual), as the
    pre-norm transformer block needs both. Accumulates in fp32 and scales in x's dtype, like HF."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op, same arithmetic
        out = F.rms_norm(x, weight.shape, weight, eps)
    else:
        xf = x.float()
        out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)
