"""Triton kernels, one file per family, each checked against a torch reference (tests run them on the
CPU under TRITON_INTERPRET=1, which must be set before this package is imported).

triton_overrides() feeds services.engine.ops.get_ops("triton"); the quantized ops (fused norm/act
quantization, W8A8 and W4A16 GEMMs) are imported from their modules by the quantized linear layers."""

from __future__ import annotations

from collections.abc import Callable


def triton_overrides() -> dict[str, Callable]:
    """Op name -> kernel with the torch reference's signature (services.engine.ops.Ops fields)."""
    from .activation import silu_and_mul
    from .decode_attention import decode_attention
    from .kv_store import store_kv
    from .norm import rms_norm
    from .prefill_attention import prefill_attention
    from .rope import apply_rope

    return {
        "store_kv": store_kv,
        "decode_attention": decode_attention,
        "prefill_attention": prefill_attention,
        "rms_norm": rms_norm,
        "apply_rope": apply_rope,
        "silu_and_mul": silu_and_mul,
    }
