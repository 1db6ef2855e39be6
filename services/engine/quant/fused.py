"""The norms and the activation that feed a W8A8 GEMM, fused with its per-token quantization
(PPL.LLM): the GEMM input is quantized in the same pass that produces it, so the float activation
never makes a round trip through memory just to be quantized."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.model.llama import RMSNorm

from .kernels import QuantKernels
from .linear import QuantAct


class QuantRMSNorm(nn.Module):
    """RMSNorm (+ residual add) whose output is quantized per token: returns QuantAct, or
    (QuantAct, x + residual) like RMSNorm returns (out, x + residual)."""

    def __init__(self, norm: RMSNorm, quant_dtype: torch.dtype, kernels: QuantKernels) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.quant_dtype = quant_dtype
        self.kernels = kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out = self.kernels.rms_norm_quant(x, self.weight, self.eps, residual, self.quant_dtype)
        if residual is None:
            return QuantAct(*out)
        q, scale, residual = out
        return QuantAct(q, scale), residual


class SiluMulQuant:
    """silu(gate) * up of the fused gate/up output, quantized per token for the down projection."""

    def __init__(self, quant_dtype: torch.dtype, kernels: QuantKernels) -> None:
        self.quant_dtype = quant_dtype
        self.kernels = kernels

    def __call__(self, x: torch.Tensor) -> QuantAct:
        return QuantAct(*self.kernels.silu_and_mul_quant(x, self.quant_dtype))
