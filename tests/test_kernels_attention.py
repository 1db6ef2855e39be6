"""Triton paged-attention kernels (store_kv, decoding, prefill) against the reference backend on fresh
random inputs: ragged lengths, page boundaries, page sizes 1 and 16, single tokens, GQA 1/4/8,
sliding windows, split-KV, head_dim 8 and 64, bf16/fp16/fp32, int8 and fp8 KV caches. Outputs and
unused cache slots are poisoned; NaN never passes. Runs under TRITON_INTERPRET=1 without a GPU."""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine.backend import reference as ref
from pipeserve.engine.quantization.kv_cache import dequantize_kv, quantize_kv
from pipeserve.engine.triton_kernels import decode_attention as dk
from pipeserve.engine.triton_kernels import kv_cache
from pipeserve.engine.triton_kernels import prefill_attention as pk
from tests.kernel_utils import (
    INT8_POISON,
    assert_close,
    paged_kv,
    poison_,
    poisoned_alloc,  # noqa: F401  (fixture, used via usefixtures)
    seeded,
)

pytestmark = [pytest.mark.device, pytest.mark.timeout(120), pytest.mark.usefixtures("poisoned_alloc")]

F32, F16, BF16, I8, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn


# -- the quantized KV format (torch reference) --------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [I8, FP8])
def test_kv_quant_roundtrip_error_is_bounded(kv_dtype):
    x = torch.randn(64, 2, 32, generator=seeded(0)) * torch.logspace(-3, 2, 64)[:, None, None]
    x[3] = 0.0  # an all-zero token must quantize to zeros, not NaN
    q, scale = quantize_kv(x, kv_dtype, group=8)
    assert q.dtype == kv_dtype and scale.dtype == F16 and scale.shape == (64, 2, 4)
    deq = dequantize_kv(q, scale)
    assert torch.isfinite(deq).all() and (deq[3] == 0).all()
    amax = x.unflatten(-1, (4, 8)).abs().amax(-1, keepdim=True)
    err = (deq - x).unflatten(-1, (4, 8)).abs()
    if kv_dtype == I8:  # half a step of the (fp16-rounded) scale
        assert (err <= amax / 127 * 0.5 * 1.002 + 1e-7).all()
    else:  # e4m3: 3 mantissa bits, half an ulp of the value, subnormals near zero
        assert (err <= x.unflatten(-1, (4, 8)).abs() / 16 + amax / 448 * 2**-10 + 1e-7).all()


# -- store_kv --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,kv_dtype,page_size,num_kv_heads,head_dim",
    [
        (BF16, None, 16, 2, 64),
        (F32, None, 1, 1, 8),
        (F16, I8, 16, 4, 64),
        (BF16, I8, 1, 2, 8),
        (F32, FP8, 16, 2, 32),
        (F16, FP8, 1, 3, 16),
    ],
)
def test_store_kv_matches_reference(dtype, kv_dtype, page_size, num_kv_heads, head_dim):
    gen = seeded(1)
    num_pages, tokens = 5, 9
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    slots = slots if page_size > 1 else slots[: min(tokens, num_pages)]
    slots_with_pad = torch.cat([slots, torch.tensor([-1])])  # a padding row: skipped
    k = torch.randn(len(slots_with_pad), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slots_with_pad), num_kv_heads, head_dim, generator=gen).to(dtype)
    caches = []
    for impl, slot_arg in ((ref.store_kv, slots), (kv_cache.store_kv, slots_with_pad)):
        cache_dtype = kv_dtype or dtype
        kc, vc = (
            poison_(torch.empty(shape, dtype=cache_dtype)),
            poison_(torch.empty(shape, dtype=cache_dtype)),
        )
        ks = vs = None
        if kv_dtype is not None:
            ks = poison_(torch.empty(*shape[:-1], head_dim // 8, dtype=F16))
            vs = poison_(torch.empty(*shape[:-1], head_dim // 8, dtype=F16))
        impl(k[: len(slot_arg)], v[: len(slot_arg)], kc, vc, slot_arg, ks, vs)
        caches.append((kc, vc, ks, vs))
    for want, got in zip(caches[0], caches[1], strict=True):
        if want is None:
            continue
        as_bytes = lambda t: (
            t.view(torch.uint8)
            if t.element_size() == 1
            else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
        )
        # Bit-identical, poison included: same slots written, nothing else touched.
        assert torch.equal(as_bytes(want), as_bytes(got))
    if kv_dtype == I8:
        assert (caches[1][0].view(-1, num_kv_heads, head_dim)[slots] != INT8_POISON).all()


# -- decoding attention -----------------------------------------------------------------------------

DECODE_CASES = [
    # dtype, kv_dtype, (Hq, Hkv), head_dim, page_size, seq_lens, window, num_splits
    (F32, None, (4, 4), 64, 16, [1, 16, 17, 40], None, 1),
    (F32, None, (8, 2), 8, 1, [5, 33], None, 3),
    (F16, None, (8, 1), 64, 16, [32, 1, 50], None, 2),
    (BF16, None, (4, 1), 64, 1, [20, 7], None, 1),
    (BF16, None, (8, 8), 8, 16, [48, 3], 7, 3),
    (F16, None, (4, 4), 32, 16, [45, 16], 20, 2),
    (F32, I8, (8, 1), 64, 16, [1, 31, 64], None, 2),
    (BF16, I8, (4, 1), 8, 1, [9, 25], None, 1),
    (F16, I8, (4, 4), 64, 16, [40, 17], 9, 3),
    (F32, FP8, (8, 2), 64, 16, [33, 2], None, 2),
    (BF16, FP8, (8, 1), 16, 1, [12, 30], 5, 1),
]


@pytest.mark.parametrize("dtype,kv_dtype,heads,head_dim,page_size,seq_lens,window,splits", DECODE_CASES)
def test_decode_attention_matches_reference(
    dtype, kv_dtype, heads, head_dim, page_size, seq_lens, window, splits
):
    gen = seeded(sum(seq_lens) + head_dim)
    hq, hkv = heads
    kv = paged_kv(seq_lens, page_size, hkv, head_dim, dtype, kv_dtype, gen)
    q = torch.randn(len(seq_lens), hq, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    clean = kv.clean()
    want = ref.decode_attention(
        q.float(),
        clean.k_cache,
        clean.v_cache,
        clean.block_tables,
        clean.seq_lens,
        scale,
        window,
        **clean.scales(),
    )
    got = dk.decode_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        kv.seq_lens,
        scale,
        window,
        **kv.scales(),
        num_splits=splits,
    )
    assert got.dtype == dtype
    assert_close(got, want, dtype)


def test_decode_default_split_count_and_max_seq_len_hint():
    gen = seeded(5)
    kv = paged_kv([3, 70], 16, 2, 16, F32, None, gen)
    q = torch.randn(2, 4, 16, generator=gen)
    want = ref.decode_attention(q, kv.clean().k_cache, kv.clean().v_cache, kv.block_tables, kv.seq_lens, 0.25)
    for hint in (None, 70):
        got = dk.decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25, max_seq_len=hint
        )
        assert_close(got, want)
    assert dk.num_splits_for(64, 8, 4096, torch.device("cpu")) == 1  # a full GPU batch needs no split
    assert dk.num_splits_for(1, 1, 32768, torch.device("cpu")) == 4  # 1 "SM" x 4 programs
    assert dk.num_splits_for(1, 8, 32768, torch.device("cpu")) == 1
    assert dk.num_splits_for(1, 1, 100, torch.device("cpu")) == 1  # short contexts never split


def test_decode_empty_batch():
    kv = paged_kv([4], 16, 1, 16, F32, None, seeded(6))
    out = dk.decode_attention(
        torch.empty(0, 2, 16), kv.k_cache, kv.v_cache, kv.block_tables[:0], kv.seq_lens[:0], 1.0
    )
    assert out.shape == (0, 2, 16)


# -- prefill attention ------------------------------------------------------------------------------

PREFILL_CASES = [
    # dtype, kv_dtype, (Hq, Hkv), head_dim, page_size, q_lens, seq_lens (> q_len: earlier chunks), window
    (F32, None, (4, 4), 64, 16, [1, 17, 40], [1, 17, 40], None),
    (F32, None, (8, 2), 8, 1, [5, 20], [5, 37], None),
    (F16, None, (8, 1), 64, 16, [33, 3], [48, 3], None),
    (BF16, None, (4, 1), 64, 1, [18, 1], [18, 9], None),
    (BF16, None, (8, 8), 8, 16, [40, 6], [40, 22], 7),
    (F16, None, (4, 2), 32, 16, [35, 31], [50, 31], 20),
    (F32, I8, (8, 1), 64, 16, [20, 31], [50, 31], None),
    (BF16, I8, (4, 4), 8, 1, [9, 16], [9, 32], 5),
    (F32, FP8, (8, 2), 64, 16, [24, 2], [24, 40], None),
    (F16, FP8, (4, 1), 16, 1, [13], [29], 4),
]


@pytest.mark.parametrize("dtype,kv_dtype,heads,head_dim,page_size,q_lens,seq_lens,window", PREFILL_CASES)
def test_prefill_attention_matches_reference(
    dtype, kv_dtype, heads, head_dim, page_size, q_lens, seq_lens, window
):
    gen = seeded(sum(q_lens) * 7 + head_dim)
    hq, hkv = heads
    kv = paged_kv(seq_lens, page_size, hkv, head_dim, dtype, kv_dtype, gen)
    q = torch.randn(sum(q_lens), hq, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    args = (kv.block_tables, cu, kv.seq_lens, max(q_lens), max(seq_lens), head_dim**-0.5, window)
    clean = kv.clean()
    want = ref.prefill_attention(q.float(), clean.k_cache, clean.v_cache, *args, **clean.scales())
    got = pk.prefill_attention(q, kv.k_cache, kv.v_cache, *args, **kv.scales())
    assert got.dtype == dtype
    assert_close(got, want, dtype)


def test_prefill_empty_batch():
    kv = paged_kv([4], 16, 1, 16, F32, None, seeded(7))
    cu = torch.zeros(1, dtype=torch.int32)
    out = pk.prefill_attention(
        torch.empty(0, 2, 16), kv.k_cache, kv.v_cache, kv.block_tables[:0], cu, kv.seq_lens[:0], 0, 0, 1.0
    )
    assert out.shape == (0, 2, 16)


def test_cache_layout_errors_are_clear():
    kv = paged_kv([4], 16, 1, 16, F32, I8, seeded(8))
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        kv_cache.store_kv(
            torch.zeros(1, 1, 16),
            torch.zeros(1, 1, 16),
            kv.k_cache,
            kv.v_cache,
            torch.zeros(1, dtype=torch.int64),
            kv.k_scale,
            None,
        )
    odd_scale = torch.zeros(*kv.k_cache.shape[:-1], 3, dtype=F16)
    with pytest.raises(ValueError, match="pow2 groups"):
        kv_cache.paged_kv(kv.k_cache, kv.v_cache, odd_scale, odd_scale)
