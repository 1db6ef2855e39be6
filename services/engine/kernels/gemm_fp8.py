"""FP8 (e4m3) W8A8 GEMM for Hopper-class GPUs: the W8A8 kernel of gemm_int8.py with fp32
accumulation, tuned separately. Reference: gemm_int8.scaled_mm_ref; quantizers: quant.py."""

from __future__ import annotations

import torch
import triton

from .common import autotune, prune_by_m
from .gemm_int8 import INTERPRET_CONFIG, launch_w8a8, w8a8_kernel


def _configs() -> list[triton.Config]:
    shapes = [
        (128, 256, 128, 8, 3),
        (256, 128, 128, 8, 3),
        (128, 128, 128, 8, 4),
        (128, 128, 128, 4, 4),
        (64, 256, 128, 8, 3),
        (64, 128, 128, 4, 4),
        (16, 64, 256, 4, 4),
        (16, 128, 128, 4, 4),
        (32, 64, 256, 4, 4),
        (32, 128, 128, 4, 4),
        (64, 64, 256, 4, 4),
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


_fp8_kernel = autotune(
    _configs(),
    key=["M_BUCKET", "N", "K", "SPLIT_K"],
    interpret_config=INTERPRET_CONFIG,
    prune_configs_by={"early_config_prune": prune_by_m},
    reset_to_zero=["c_ptr"],
)(w8a8_kernel)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    split_k: int | None = None,
) -> torch.Tensor:
    """fp8 a [M, K] x fp8 w [N, K] with fp32 a_scale [M, 1] and w_scale [N] -> out_dtype [M, N]."""
    assert a.dtype == torch.float8_e4m3fn and w.dtype == torch.float8_e4m3fn
    return launch_w8a8(_fp8_kernel, a, a_scale, w, w_scale, bias, out_dtype, split_k)
