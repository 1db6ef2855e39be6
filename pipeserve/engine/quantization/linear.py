"""Quantized replacements of nn.Linear, built from a loaded float layer at load time.

W8A8Linear (int8 or fp8): weights with one scale per output channel; activations with one scale per
token, computed on the fly (dynamic, no calibration). Its input is either a float tensor, which it
quantizes itself, or a QuantAct already quantized by the fused norm / activation that produced it.
W4A16Linear (int4 or nf4): 4-bit weights, float activations, dequantized inside the GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.engine.backend import Backend

from .weights import Packed4bit, quantize_4bit, quantize_per_channel, quantize_per_tensor

W8A8_DTYPES = {"w8a8-int8": torch.int8, "w8a8-fp8": torch.float8_e4m3fn}


class QuantAct(NamedTuple):
    """Activations quantized per token (or per tensor, the scale repeated per token)."""

    q: torch.Tensor  # [T, K] int8 / fp8 codes
    scale: torch.Tensor  # fp32 [T, 1]


class W8A8Linear(nn.Module):
    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    def __init__(self, linear: nn.Linear, quant_dtype: torch.dtype, backend: Backend,
                 per_tensor: bool = False) -> None:
        super().__init__()
        weight = linear.weight.detach()
        q, scale = (quantize_per_tensor if per_tensor else quantize_per_channel)(weight, quant_dtype)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = weight.dtype
        self.quant_dtype = quant_dtype
        self.per_tensor = per_tensor
        self.backend = backend
        self.gemm = backend.int8_gemm if quant_dtype == torch.int8 else backend.fp8_gemm

    def quantize(self, x: torch.Tensor) -> QuantAct:
        if self.per_tensor:
            q, scale = quantize_per_tensor(x, self.quant_dtype)
            return QuantAct(q, scale[:, None])
        return QuantAct(*self.backend.per_token_quant(x.contiguous(), self.quant_dtype))

    def forward(self, x: torch.Tensor | QuantAct) -> torch.Tensor:
        if not isinstance(x, QuantAct):
            x = self.quantize(x)
        return self.gemm(x.q, x.scale, self.weight, self.weight_scale, self.bias, self.out_dtype)

    def extra_repr(self) -> str:
        scales = "per-tensor" if self.per_tensor else "per-token x per-channel"
        return f"{self.in_features}, {self.out_features}, {self.quant_dtype}, {scales}"


class W4A16Linear(nn.Module):
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bias: torch.Tensor | None
    def __init__(self, linear: nn.Linear, fmt: str, backend: Backend) -> None:
        super().__init__()
        packed = quantize_4bit(linear.weight.detach(), fmt)
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("zeros", packed.zeros)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pad = packed.padded_k - linear.in_features
        self.fmt = fmt
        self.backend = backend

    def packed(self) -> Packed4bit:
        return Packed4bit(self.qweight, self.scales, self.zeros, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, self.pad)) if self.pad else x.contiguous()
        y = self.backend.w4a16_gemm(x, self.qweight, self.scales, self.zeros)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        group = self.packed().padded_k // self.scales.shape[0]
        return f"{self.in_features}, {self.out_features}, {self.fmt}, group {group}"
