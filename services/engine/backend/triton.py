"""The Triton backend: every op a kernel from services/engine/triton_kernels/."""

from __future__ import annotations

from services.engine.triton_kernels import (
    activation,
    decode_attention,
    gemm_w4a16,
    gemm_w8a8,
    kv_cache,
    norm,
    prefill_attention,
    quantize,
    rope,
)

from . import Backend

BACKEND = Backend(
    name="triton",
    store_kv=kv_cache.store_kv,
    decode_attention=decode_attention.decode_attention,
    prefill_attention=prefill_attention.prefill_attention,
    rms_norm=norm.rms_norm,
    apply_rope=rope.apply_rope,
    silu_and_mul=activation.silu_and_mul,
    per_token_quant=quantize.per_token_quant,
    rms_norm_quant=norm.rms_norm_quant,
    silu_and_mul_quant=activation.silu_and_mul_quant,
    int8_gemm=gemm_w8a8.int8_gemm,
    fp8_gemm=gemm_w8a8.fp8_gemm,
    w4a16_gemm=gemm_w4a16.w4a16_gemm,
)
