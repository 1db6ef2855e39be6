"""Helpers for the Triton kernel tests: the test device, poisoned allocations, per-dtype error bounds,
paged KV cases. Tests marked `device` create their tensors on torch's default device, which conftest
sets to $PIPESERVE_TEST_DEVICE; generators follow it here."""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

import pytest
import torch

from pipeserve.engine.backend import native, reference
from pipeserve.gpu_check.kernels import INT8_POISON, poison_
from tests.conftest import TEST_DEVICE

DEVICE = torch.device(TEST_DEVICE)

# Bound on max|out - ref| / max|ref| per output dtype. bf16 is loose: the interpreter truncates
# fp32 -> bf16 instead of rounding, so one bf16 step (2**-7 relative) can separate out from ref.
REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# The native library's x86 tiers, as -march targets, and the CPU flags a build for each needs to run:
# portable loops throughout, 8-lane AVX2 kernels, AVX-512 without bf16 dot products.
MARCH_NEEDS = {"x86-64-v2": set(), "x86-64-v3": {"avx2", "fma"}, "skylake-avx512": {"avx512f"}}


def native_library(march: str) -> ctypes.CDLL:
    """The native CPU library built for -march=march (cached beside the engine's own build), declared;
    skips where this host is not x86 or its CPU lacks what that target needs."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={march} is an x86 target")
    needs = MARCH_NEEDS[march]
    if not needs <= set(native._host().split()):
        pytest.skip(f"this CPU lacks {', '.join(sorted(needs))}: a library built for {march} cannot run here")
    flags = tuple(f for f in native.FLAGS if f != "-march=native") + (f"-march={march}",)
    return native._declare(ctypes.CDLL(str(native._build(native.compiler() or "g++", flags))))


@pytest.fixture
def poisoned_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch.empty / torch.empty_like during the test returns poisoned memory, so an output
    element the kernel forgets to write fails the comparison (NaN never passes)."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


def assert_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0
) -> None:
    """All finite, and max|out - ref| <= REL_TOL[dtype] * scale * max|ref|."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out.float()).all(), "non-finite values in the kernel output"
    ref = ref.double()
    err = (out.double() - ref).abs().max().item()
    bound = REL_TOL[dtype or out.dtype] * scale * max(ref.abs().max().item(), 1e-6)
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"


def seeded(seed: int) -> torch.Generator:
    """A seeded generator on the test device (torch.randn and friends need one on their own device)."""
    return torch.Generator(device=DEVICE if DEVICE.type == "cuda" else "cpu").manual_seed(seed)


@dataclass
class PagedKV:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    def scales(self) -> dict[str, torch.Tensor]:
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def clean(self) -> PagedKV:
        """The same cache with the poison replaced by zeros, for the reference (which reads padding
        positions and masks them after the fact; NaN * 0 would be NaN)."""

        def fix(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if t.dtype == torch.float8_e4m3fn:
                return torch.where(t.float().isnan(), 0.0, t.float()).to(t.dtype)
            if t.dtype == torch.int8:
                return torch.where(t == INT8_POISON, 0, t).to(t.dtype)
            return t.nan_to_num(0.0)

        return PagedKV(
            fix(self.k_cache),
            fix(self.v_cache),
            fix(self.k_scale),
            fix(self.v_scale),
            self.block_tables,
            self.seq_lens,
        )


def paged_kv(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None,
    gen: torch.Generator,
    group: int = 8,
) -> PagedKV:
    """Requests' K/V scattered over shuffled pages; every slot no request owns (tails of last pages,
    spare pages, the padding of block tables) is poisoned. kv_dtype int8 / fp8 quantizes through the
    reference store_kv."""
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 2
    max_pages = max(pages_per_seq) + 1
    perm = torch.randperm(num_pages, generator=gen)
    spare = int(perm[-1])
    tables = torch.full((len(seq_lens), max_pages), spare, dtype=torch.int32)
    slots, start = [], 0
    for i, (n, p) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        tables[i, :p] = perm[start : start + p]
        start += p
        pos = torch.arange(n)
        slots.append(tables[i, pos // page_size].long() * page_size + pos % page_size)
    slot_mapping = torch.cat(slots)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.randn(len(slot_mapping), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slot_mapping), num_kv_heads, head_dim, generator=gen).to(dtype)
    cache_dtype = kv_dtype or dtype
    k_cache, v_cache = (
        poison_(torch.empty(shape, dtype=cache_dtype)),
        poison_(torch.empty(shape, dtype=cache_dtype)),
    )
    k_scale = v_scale = None
    if kv_dtype is not None:
        scale_shape = (*shape[:-1], head_dim // group)
        k_scale = poison_(torch.empty(scale_shape, dtype=torch.float16))
        v_scale = poison_(torch.empty(scale_shape, dtype=torch.float16))
    reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return PagedKV(k_cache, v_cache, k_scale, v_scale, tables, torch.tensor(seq_lens, dtype=torch.int32))
