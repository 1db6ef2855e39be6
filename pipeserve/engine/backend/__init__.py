"""The one interface to the engine's hot ops, and the backends that implement it.

A `Backend` lists every op the model and its quantized layers call; a model is built with one,
chosen once by name (`get_backend`):
- "reference" (reference.py): plain, readable torch. The oracle the other backends are tested
  against, never tuned for speed.
- "cpu" (cpu.py): torch tuned for the CPU (persistent workspaces, one SDPA call per batch or chunk,
  per-step memos, real int8 / fp8 GEMMs). ("torch", its older name, is resolved in the config.)
- "triton" (triton.py): the GPU kernels of pipeserve/engine/triton_kernels/ (run on the CPU under
  TRITON_INTERPRET=1 in tests).
"auto" is "triton" on CUDA and "cpu" elsewhere (`resolve_backend`).

Besides its ops a backend declares its specifics, so that nothing outside this package asks for it
by name: `prepare_model` (what it does to a loaded model before serving), `compiled_step` (the
compiled step executor it supports per device type) and `native_step` (whether the native CPU step
may run its models).

Shapes: q [T, Hq, D], k / v [T, Hkv, D]; paged caches [P, S, Hkv, D] with, when quantized, fp16
scales [P, S, Hkv, D // group] passed as k_scale / v_scale (format:
pipeserve/engine/quantization/kv_cache.py).
Quantized activations are (codes, fp32 scale [T, 1]).
"""

from __future__ import annotations

from functools import cache

import torch

from pipeserve.config import BACKENDS

from .base import OP_NAMES, Backend, NormOut, NormQuantOut, QuantOut

__all__ = ["OP_NAMES", "Backend", "NormOut", "NormQuantOut", "QuantOut", "get_backend", "resolve_backend"]


def resolve_backend(name: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "cpu" elsewhere; any other name unchanged."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" else "cpu"


@cache
def get_backend(name: str) -> Backend:
    """The backend called `name` (one of BACKENDS), built once."""
    if name == "reference":
        from .reference import BACKEND as reference

        return reference
    if name == "cpu":
        from . import native
        from .cpu import BACKEND as cpu

        native.available()  # built (or loaded) now, not inside a compiled step's trace
        return cpu
    if name == "triton":
        from .triton import BACKEND as triton

        return triton
    raise ValueError(f"unknown backend {name!r} (one of {', '.join(BACKENDS)})")
