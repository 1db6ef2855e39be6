"""The CPU backend's shortcuts against plain formulas and the reference backend: rope on q|k as one
view, SDPA with head_dim zero-padded, prefill on the chunks' fresh K/V, the decode plan shared by all
layers of a step (StepMemo), the memo's own keying, and every attention case against the reference."""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine.backend import cpu as A
from pipeserve.engine.backend import reference
from pipeserve.engine.backend.cpu import apply_rope
from pipeserve.engine.backend.step_memo import StepMemo
from pipeserve.engine.model.rope import rope_cache
from tests.kernel_utils import paged_kv, seeded

pytestmark = pytest.mark.timeout(120)


def rope_formula(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rope in float64 on the first rot_dim channels."""
    rot = cos_sin.shape[-1]
    half = rot // 2
    cs = cos_sin.double()[positions]
    cos, sin = torch.cat([cs[:, :half]] * 2, -1)[:, None], torch.cat([cs[:, half:]] * 2, -1)[:, None]
    x = x.double()
    part = x[..., :rot]
    rotated = torch.cat([-part[..., half:], part[..., :half]], -1)
    return torch.cat([part * cos + rotated * sin, x[..., rot:]], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rope_matches_rotate_half(dtype, fused, rot_dim):
    tokens, hq, hkv, dim = 7, 4, 2, 16
    gen = seeded(0)
    cache = rope_cache(rot_dim, 64, 10000.0, None)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen).to(dtype)
    if fused:  # q and k are adjacent slices of one projection: rotated as one view
        q = qkv[:, : hq * dim].view(tokens, hq, dim)
        k = qkv[:, hq * dim : (hq + hkv) * dim].view(tokens, hkv, dim)
    else:
        q = qkv[:, : hq * dim].reshape(tokens, hq, dim).clone()
        k = qkv[:, (hq + hkv) * dim :].reshape(tokens, hkv, dim).clone()
    want_q, want_k = rope_formula(q, positions, cache), rope_formula(k, positions, cache)
    v_before = qkv[:, (hq + hkv) * dim :].clone()
    apply_rope(q, k, positions, cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.double(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k.double(), want_k, atol=tol, rtol=tol)
    if fused:  # the fused view stops at k: v untouched
        assert torch.equal(qkv[:, (hq + hkv) * dim :], v_before)


def naive_attention(q, k, v, scale, q_start):
    """q [Lq, Hq, D] at positions q_start.., k/v [Lk, Hkv, D]; causal, GQA; float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(("keys", "heads", "dim"), [
    (20, 4, 8), (200, 4, 8),  # a small head dim below and above the padding threshold
    (127, 6, 64), (128, 6, 64), (300, 6, 64),  # below, at and above two causal query blocks
])
def test_sdpa_matches_causal_attention(keys, heads, dim):
    # Small head dims are padded exactly; a whole prompt of 128+ tokens runs as query blocks against
    # the keys up to each block's end: the same numbers as causal attention, GQA heads grouped.
    gen = seeded(1)
    q = torch.randn(1, keys, heads, dim, generator=gen)
    k, v = torch.randn(1, keys, 2, dim, generator=gen), torch.randn(1, keys, 2, dim, generator=gen)
    out = A._sdpa(q, k, v, None, 0.3)
    assert out.shape == q.shape
    want = naive_attention(q[0], k[0], v[0], 0.3, 0)
    torch.testing.assert_close(out[0].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keys", [20, 300])
def test_sdpa_bf16_is_causal_attention_in_bf16(keys):
    # bf16 prompts take the flash kernel's own causal path in bf16 (fp32 accumulation inside it).
    gen = seeded(1)
    q = torch.randn(1, keys, 6, 64, generator=gen).bfloat16()
    k, v = (torch.randn(1, keys, 2, 64, generator=gen).bfloat16() for _ in range(2))
    out = A._sdpa(q, k, v, None, 0.3)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    want = naive_attention(q[0], k[0], v[0], 0.3, 0)
    torch.testing.assert_close(out[0].double(), want, atol=2e-2, rtol=2e-2)


def test_prefill_on_fresh_kv_equals_reading_pages():
    """Whole prompts take their K/V from the step's rows, a continued chunk reads its pages: same
    numbers as reading everything back from the cache."""
    gen = seeded(2)
    lens = [5, 150, 9]
    kv = paged_kv(lens, 16, 2, 8, torch.float32, None, gen).clean()
    # Request 1 continues a prompt: its last 6 tokens are this step's chunk; the others are whole.
    q_lens = [5, 6, 9]
    cu = torch.tensor([0, 5, 11, 20], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 8, generator=gen)
    pos = [torch.arange(n - c, n) for n, c in zip(lens, q_lens, strict=True)]
    rows = [kv.block_tables[i, p // 16].long() * 16 + p % 16 for i, p in enumerate(pos)]
    slots = torch.cat(rows)
    k_new = kv.k_cache.view(-1, 2, 8)[slots].clone()
    v_new = kv.v_cache.view(-1, 2, 8)[slots].clone()
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 9, 150, 0.35)
    fresh = A.prefill_attention(*args, new_kv=(k_new, v_new))
    paged = A.prefill_attention(*args)
    torch.testing.assert_close(fresh, paged, atol=1e-6, rtol=1e-6)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        tables = kv.block_tables[i : i + 1]
        keys = A.gather_pages(kv.k_cache, tables, lens[i])[0]
        values = A.gather_pages(kv.v_cache, tables, lens[i])[0]
        want = naive_attention(q[lo:hi], keys, values, 0.35, lens[i] - q_lens[i])
        torch.testing.assert_close(fresh[lo:hi].double(), want, atol=1e-5, rtol=1e-5)


def test_decode_plan_follows_new_lengths():
    """Layers of one step share the decode plan; a new step's lengths, a longer max_len or a length
    written in place are never served the old plan."""
    gen = seeded(3)
    kv = paged_kv([40, 70, 33], 16, 2, 8, torch.float32, None, gen).clean()
    q = torch.randn(3, 4, 8, generator=gen)

    def naive(seq_lens):
        out = []
        for i, n in enumerate(seq_lens):
            tables = kv.block_tables[i : i + 1]
            keys, values = A.gather_pages(kv.k_cache, tables, n)[0], A.gather_pages(kv.v_cache, tables, n)[0]
            out.append(naive_attention(q[i : i + 1], keys, values, 0.35, n - 1))
        return torch.cat(out)

    def check(seq_lens, max_len=None):
        got = A.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, 0.35, None, max_len)
        torch.testing.assert_close(got.double(), naive(seq_lens.tolist()), atol=1e-5, rtol=1e-5)

    lens = torch.tensor([40, 70, 33], dtype=torch.int32)
    check(lens)
    check(lens)  # served from the memo
    lens[0] = 12  # in place: a new version
    check(lens)
    check(torch.tensor([40, 20, 33], dtype=torch.int32), 40)  # a new step's tensor


def test_step_memo_keys_on_identity_version_and_extra():
    memo, calls = StepMemo(), []

    def build():
        calls.append(1)
        return len(calls)

    a, b = torch.zeros(3), torch.zeros(3)
    assert memo.get((a,), 1, build) == 1
    assert memo.get((a,), 1, build) == 1  # same tensor, same version: reused
    assert memo.get((b,), 1, build) == 2  # equal values, other tensor: rebuilt
    assert memo.get((b,), 2, build) == 3  # other extra key
    b.add_(1)
    assert memo.get((b,), 2, build) == 4  # written in place
    with torch.inference_mode():
        c = torch.zeros(3)  # no version counter: never served from the memo
    assert memo.get((c,), 2, build) == 5
    assert memo.get((c,), 2, build) == 6


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 7])
def test_attention_matches_the_reference(kv_dtype, window):
    gen = seeded(4)
    lens = [5, 150, 9, 33]
    kv = paged_kv(lens, 16, 2, 8, torch.float32, kv_dtype, gen).clean()
    scales = kv.scales()
    q = torch.randn(4, 4, 8, generator=gen)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.35, window)
    want = reference.decode_attention(*args, **scales)
    torch.testing.assert_close(A.decode_attention(*args, **scales), want, atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 5, 11, 20, 53], dtype=torch.int32)
    qp = torch.randn(53, 4, 8, generator=gen)
    args = (qp, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 33, 150, 0.35, window)
    want = reference.prefill_attention(*args, **scales)
    torch.testing.assert_close(A.prefill_attention(*args, **scales), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_ops_match_the_reference(dtype):
    gen = seeded(5)
    x, res = torch.randn(6, 32, generator=gen).to(dtype), torch.randn(6, 32, generator=gen).to(dtype)
    w = torch.randn(32, generator=gen).to(dtype)
    for got, want in zip(A.rms_norm(x, w, 1e-5, res), reference.rms_norm(x, w, 1e-5, res), strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(A.silu_and_mul(x), reference.silu_and_mul(x))
    cos_sin = rope_cache(8, 64, 10000.0, None)
    qkv = torch.randn(6, 6, 8, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (6,), generator=gen)
    want = qkv.clone()
    A.apply_rope(qkv[:, :4], qkv[:, 4:], positions, cos_sin)
    reference.apply_rope(want[:, :4], want[:, 4:], positions, cos_sin)
    torch.testing.assert_close(qkv, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-5)


def test_aligned_operands_keep_the_int8_and_fp8_products():
    """CUDA's int8 / fp8 GEMMs take only sizes in multiples of 8 / 16: the torch path pads K and N with
    zeros (through uint8, fp8 having no pad kernel) and cuts the padded columns off; the products equal
    the unpadded ones."""
    from pipeserve.engine.backend.cpu import _aligned

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (5, 43), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (21, 43), generator=g, dtype=torch.int8)
    pa, pw = _aligned(a, 1, 8), _aligned(w, 8, 8)
    assert pa.shape == (5, 48) and pw.shape == (24, 48) and not pw[21:].any() and not pa[:, 43:].any()
    assert torch.equal(torch._int_mm(pa, pw.t())[:, :21], torch._int_mm(a, w.t()))
    f8 = torch.randn(7, 43, generator=g).to(torch.float8_e4m3fn)
    p8 = _aligned(f8, 16, 16)
    assert p8.dtype == torch.float8_e4m3fn and p8.shape == (16, 48)
    assert torch.equal(p8[:7, :43].float(), f8.float()) and not p8.float()[7:].any()
    assert _aligned(pw, 8, 8) is pw  # already aligned: no copy
