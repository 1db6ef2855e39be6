"""The norms and the activation that feed a W8A8 GEMM, fused with its per-token quantization
(PPL.LLM): the GEMM input is quantized in the same pass that produces it, so the float activation
never makes a round trip through memory just to be quantized."""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.engine.backend import Backend

from .linear import QuantAct


class QuantRMSNorm(nn.Module):
    """RMSNorm (+ residual add) whose output is quantized per token: returns QuantAct, or
    (QuantAct, x + residual) like RMSNorm returns (out, x + residual)."""

    def __init__(self, weight: nn.Parameter, eps: float, quant_dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        self.weight = weight  # the float norm's, shared
        self.eps = eps
        self.quant_dtype = quant_dtype
        self.backend = backend

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> QuantAct | tuple[QuantAct, torch.Tensor]:
        out = self.backend.rms_norm_quant(x, self.weight, self.eps, residual, self.quant_dtype)
        if len(out) == 2:
            return QuantAct(out[0], out[1])
        q, scale, new_residual = out
        return QuantAct(q, scale), new_residual


class SiluMulQuant:
    """silu(gate) * up of the fused gate/up output, quantized per token for the down projection."""

    def __init__(self, quant_dtype: torch.dtype, backend: Backend) -> None:
        self.quant_dtype = quant_dtype
        self.backend = backend

    def __call__(self, x: torch.Tensor) -> QuantAct:
        return QuantAct(*self.backend.silu_and_mul_quant(x, self.quant_dtype))
