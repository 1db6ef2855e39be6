"""The Triton backend: every op a kernel from pipeserve/engine/triton_kernels/."""

from __future__ import annotations

from pipeserve.engine.triton_kernels import (
    activation,
    decode_attention,
    fused_moe,
    gemm_w4a16,
    gemm_w8a8,
    kv_cache,
    lora,
    norm,
    prefill_attention,
    quantize,
    rope,
)

from .base import Backend

BACKEND = Backend.collect(
    "triton",
    *map(vars, (kv_cache, decode_attention, prefill_attention, norm, rope, activation, quantize, gemm_w8a8,
                gemm_w4a16, fused_moe, lora)),
    # CUDA graphs capture the kernels' launches; under the CPU interpreter there is nothing to capture.
    compiled_step=(("cuda", "cuda-graph"),),
)
