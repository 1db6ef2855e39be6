"""Backend dispatch for the engine's hot ops. Every op has a torch reference here; the Triton
backend (services/engine/kernels/) overrides entries with kernels of the same signature."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .activation import silu_and_mul
from .attention import AttentionMetadata, decode_attention, prefill_attention, store_kv
from .norm import rms_norm
from .rope import apply_rope, rope_cache

__all__ = ["AttentionMetadata", "Ops", "get_ops", "rope_cache"]


@dataclass(frozen=True)
class Ops:
    name: str
    store_kv: Callable
    decode_attention: Callable
    prefill_attention: Callable
    rms_norm: Callable
    apply_rope: Callable
    silu_and_mul: Callable


TORCH_OPS = Ops("torch", store_kv, decode_attention, prefill_attention, rms_norm, apply_rope, silu_and_mul)


def get_ops(backend: str) -> Ops:
    if backend == "torch":
        return TORCH_OPS
    if backend == "triton":
        from services.engine.kernels import triton_overrides

        return replace(TORCH_OPS, name="triton", **triton_overrides())
    raise ValueError(f"unknown backend {backend!r} (torch or triton)")
