"""The CPU backend's native kernels (pipeserve/engine/backend/native.py) against the reference
backend: decode attention over every cache dtype, head size (the small-head and generic paths),
query-head grouping, sliding windows and page boundaries, strided query rows, one and two threads;
the KV store; the torch path they replace; the compiled step's view of them as opaque ops; and the
build: cached by source hash, and a host without a compiler falls back to torch; and the builds for
CPUs without AVX-512 (AVX2 kernels) or without AVX2 (portable loops)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from pipeserve.engine.backend import cpu, native, reference
from tests.kernel_utils import native_library, paged_kv, seeded

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler"),
]


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# The row kernel takes query heads in passes of 256 / dim with AVX-512 and 96 / dim with AVX2. AVX-512:
# (2, 3, 64) is one partial pass, (1, 6, 64), (1, 5, 128) and (1, 9, 32) a full pass and a partial one;
# AVX2: (1, 4, 16) one partial pass, (1, 9, 32) three full ones, dim 64 and 128 one head a pass.
@pytest.mark.parametrize(("hkv", "group", "dim"), [(2, 2, 8), (1, 4, 16), (2, 1, 64), (1, 2, 80), (2, 3, 64),
                                                   (1, 6, 64), (1, 5, 128), (1, 9, 32)])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_matches_the_reference(threads, dtype, hkv, group, dim, window):
    gen = seeded(11)
    lens = [1, 16, 17, 150, 33]  # one key, a whole page, one past it, many pages
    kv = paged_kv(lens, 16, hkv, dim, dtype, None, gen).clean()
    # Query rows strided as slices of a fused projection are.
    fused = torch.randn(len(lens), hkv * group * dim + 24, generator=gen).to(dtype)
    q = fused[:, : hkv * group * dim].view(len(lens), hkv * group, dim)
    assert native.supports_decode(q, kv.k_cache, None)
    got = native.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3, window)
    want = reference.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "page"), [([150], 16), ([70, 1, 33], 32), ([40], 8)])
def test_decode_rows_fewer_than_threads_and_other_page_sizes(threads, dtype, lens, page):
    """A single row with two threads splits its KV heads between them; a row per thread takes all of
    its heads page by page, pages of 8 or 32 tokens included (a 16-key block across a page's end)."""
    gen = seeded(14)
    kv = paged_kv(lens, page, 4, 64, dtype, None, gen).clean()
    q = torch.randn(len(lens), 12, 64, generator=gen).to(dtype)
    assert native.supports_decode(q, kv.k_cache, None)
    for window in (None, 21):
        args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3, window)
        got, want = native.decode_attention(*args), reference.decode_attention(*args)
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_backend_takes_the_native_path_and_the_torch_path_agrees():
    gen = seeded(12)
    kv = paged_kv([5, 150, 9, 33], 16, 2, 8, torch.float32, None, gen).clean()
    q = torch.randn(4, 4, 8, generator=gen)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.35, None)
    assert native.supports_decode(q, kv.k_cache, None)
    got = cpu.decode_attention(*args)
    torch_path = cpu.torch_decode_attention(*args)
    torch.testing.assert_close(got, torch_path, atol=1e-5, rtol=1e-5)


def test_quantized_caches_keep_the_torch_path():
    gen = seeded(13)
    kv = paged_kv([20, 40], 16, 2, 16, torch.float32, torch.int8, gen).clean()
    q = torch.randn(2, 4, 16, generator=gen)
    assert not native.supports_decode(q, kv.k_cache, kv.k_scale)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25, None)
    torch.testing.assert_close(cpu.decode_attention(*args, **kv.scales()),
                               reference.decode_attention(*args, **kv.scales()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_matches_the_reference(dtype):
    gen = seeded(14)
    pages, page_size, hkv, dim = 6, 4, 2, 8
    qkv = torch.randn(5, (4 + 2 * hkv) * dim, generator=gen).to(dtype)
    k = qkv[:, 4 * dim : (4 + hkv) * dim].view(5, hkv, dim)  # strided rows, as the model's
    v = qkv[:, (4 + hkv) * dim :].view(5, hkv, dim)
    slots = torch.tensor([3, 17, 4, 22, 9])
    caches = [torch.zeros(pages, page_size, hkv, dim, dtype=dtype) for _ in range(4)]
    assert native.supports_store(k, v, caches[0], None)
    native.store_kv(k, v, caches[0], caches[1], slots)
    reference.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_opaque_ops_under_the_compiler():
    """The compiled step sees both kernels as ops: same numbers as the direct calls."""
    gen = seeded(15)
    kv = paged_kv([9, 40], 16, 2, 16, torch.float32, None, gen).clean()
    q = torch.randn(2, 4, 16, generator=gen)
    k_new, v_new = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    slots = (kv.block_tables[:, 2].long() * 16 + 15)  # unused slots of unused pages

    def step(q, k_new, v_new, k_cache, v_cache, tables, lens):
        native.store_kv(k_new, v_new, k_cache, v_cache, slots)
        return native.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, None)

    want = step(q, k_new, v_new, kv.k_cache.clone(), kv.v_cache.clone(), kv.block_tables, kv.seq_lens)
    k_cache, v_cache = kv.k_cache.clone(), kv.v_cache.clone()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(
        q, k_new, v_new, k_cache, v_cache, kv.block_tables, kv.seq_lens)
    torch.testing.assert_close(got, want)
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], k_new)


@pytest.mark.slow  # compiles (Inductor or the library build)
def test_build_is_cached_and_a_missing_compiler_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPESERVE_CACHE", str(tmp_path))
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    assert compiler is not None
    first = native._build(compiler)
    assert first.exists() and first.is_relative_to(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native._build(compiler) == first and first.stat().st_mtime_ns == mtime  # not rebuilt

    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("CXX", str(Path(tmp_path) / "no-such-compiler"))
    assert not native.available()
    gen = seeded(16)
    kv = paged_kv([12, 30], 16, 2, 8, torch.float32, None, gen).clean()
    q = torch.randn(2, 4, 8, generator=gen)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.35, None)
    torch.testing.assert_close(cpu.decode_attention(*args), reference.decode_attention(*args),
                               atol=1e-5, rtol=1e-5)


def _prompt_kernel_here() -> bool:
    lib = native._lib if native.available() else None
    return lib is not None and bool(lib.pipeserve_prompt_attention_supported(64))


def _qkv_rows(length: int, heads: int, kv_heads: int, dim: int, gen: torch.Generator):
    """q, k, v [T, H, D] bf16 as slices of one fused projection's rows (strided, as a model's are)."""
    qkv = torch.randn(length, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, :heads * dim].view(length, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(length, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(length, kv_heads, dim)
    return q, k, v


@pytest.mark.skipif(not _prompt_kernel_here(), reason="no AMX tiles on this host (or not granted)")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
# later: the queries are the prompt's positions from there on (a chunk after its first tokens)
@pytest.mark.parametrize(("length", "heads", "kv_heads", "dim", "later"),
                         [(1, 2, 1, 64, 0), (16, 2, 2, 64, 0), (16, 2, 2, 64, 15), (33, 6, 2, 64, 0),
                          (33, 6, 2, 64, 1), (100, 8, 8, 128, 0), (100, 8, 8, 128, 29), (37, 4, 2, 32, 0),
                          (300, 12, 4, 64, 0), (300, 12, 4, 64, 172)])
def test_prompt_attention_matches_causal_sdpa(threads, length, heads, kv_heads, dim, later):
    q, k, v = _qkv_rows(length, heads, kv_heads, dim, seeded(length))
    q = q[later:]
    assert native.supports_prompt_attention(q, k, v)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    native.prompt_attention(q, k, v, dim ** -0.5, out)
    sees = torch.arange(length)[None, :] <= torch.arange(later, length)[:, None]  # key <= query position
    want = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(0, 1) for x in (q, k, v)), attn_mask=sees, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not _prompt_kernel_here(), reason="no AMX tiles on this host (or not granted)")
def test_bf16_prefill_chunks_take_the_prompt_kernel(monkeypatch):
    gen = seeded(21)
    kv = paged_kv([40, 70], 16, 2, 64, torch.bfloat16, None, gen).clean()
    q = torch.randn(110, 4, 64, generator=gen).to(torch.bfloat16)
    rows = [cpu.gather_pages(c, kv.block_tables, 70)[b, :n] for c in (kv.k_cache, kv.v_cache)
            for b, n in ((0, 40), (1, 70))]
    new_kv = (torch.cat(rows[:2]), torch.cat(rows[2:]))  # the prompts' own K/V rows
    real = native.prompt_attention
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(native, "prompt_attention",
                        lambda q, k, *a: calls.append((q.shape[0], k.shape[0])) or real(q, k, *a))
    # Two whole prompts (their fresh rows), then a chunk that continues the second one: its last 30
    # positions over all 70 keys (from the pages).
    whole = (q, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([0, 40, 110]), kv.seq_lens, 70, 70,
             0.125)
    later = (q[:30], kv.k_cache, kv.v_cache, kv.block_tables[1:], torch.tensor([0, 30]), kv.seq_lens[1:], 30,
             70, 0.125)
    got = [cpu.prefill_attention(*whole, new_kv=new_kv), cpu.prefill_attention(*later)]
    assert calls == [(40, 40), (70, 70), (30, 70)]
    monkeypatch.setattr(native, "supports_prompt_attention", lambda *a: False)  # SDPA, causal or masked
    want = [cpu.prefill_attention(*whole, new_kv=new_kv), cpu.prefill_attention(*later)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module", params=["x86-64-v2", "x86-64-v3"])
def portable_lib(request):
    """The kernels built for a CPU without AVX2 (the portable loops) and for one with AVX2 and FMA but
    no AVX-512 (8-lane kernels), where this CPU can run them."""
    return native_library(request.param)


@pytest.mark.slow  # builds other libraries
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_kernels_match_the_reference(portable_lib, monkeypatch, dtype):
    monkeypatch.setattr(native, "_lib", portable_lib)
    q, k, v = _qkv_rows(8, 2, 1, 64, seeded(4))
    assert not native.supports_prompt_attention(q, k, v)  # AMX only: prompts keep SDPA there
    gen = seeded(5)
    lens = [1, 17, 150]
    # Head sizes of one to sixteen 8-lane vectors, with full and partial passes of query heads.
    cases = ((2, 2, 8), (1, 13, 8), (1, 4, 16), (1, 9, 32), (2, 3, 64), (1, 2, 80), (1, 2, 128))
    for hkv, group, dim in cases:
        kv = paged_kv(lens, 16, hkv, dim, dtype, None, gen).clean()
        q = torch.randn(len(lens), hkv * group, dim, generator=gen).to(dtype)
        got = native.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3, 7)
        want = reference.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.3, 7)
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for rows, n, k in ((1, 37, 50), (7, 70, 33), (13, 130, 517)):
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen)
        got = native.packed_linear(x, native.pack_weight(w), b, n)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_match_the_reference(threads, dtype, monkeypatch):
    # RMSNorm (with a residual add), SiLU-and-mul and RoPE over strided rows, as the per-op path's
    # prefill chunks call them: the native row kernels (every call taken, counted) against the
    # reference's ops (bf16: rounded where they round, so within one bf16 step).
    calls = {"rms_norm": 0, "silu_and_mul": 0, "apply_rope": 0}
    for name in calls:
        real = getattr(native, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(native, name, counted)
    tol = {"rtol": 2e-6, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}
    gen = seeded(21)
    rows, hidden = 37, 96
    wide = torch.randn(rows, hidden + 8, generator=gen).to(dtype)
    x, resid_in = wide[:, :hidden], torch.randn(rows, hidden, generator=gen).to(dtype)  # x's rows strided
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **tol)
    got, got_resid = cpu.rms_norm(x, w, 1e-5, resid_in)
    want, want_resid = reference.rms_norm(x, w, 1e-5, resid_in)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got_resid, want_resid) and got_resid.data_ptr() != x.data_ptr()
    gate_up = (torch.randn(rows, 2 * 48 + 4, generator=gen) * 6).to(dtype)[:, : 2 * 48]  # strided, both signs
    assert not gate_up.is_contiguous()
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up),
                               **({"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else tol))
    from pipeserve.engine.model.rope import rope_cache

    hq, hkv, dim, rot = 6, 2, 16, 8  # partial rotary: the last 8 channels of each head untouched
    table = rope_cache(rot, 64, 10000.0, None)
    qkv = torch.randn(rows, (hq + 2 * hkv) * dim, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (rows,), generator=gen)
    q, k = qkv[:, : hq * dim].view(rows, hq, dim), qkv[:, hq * dim : (hq + hkv) * dim].view(rows, hkv, dim)
    want_q, want_k = q.float(), k.float()
    reference.apply_rope(want_q, want_k, positions, table)
    v_before = qkv[:, (hq + hkv) * dim :].clone()
    cpu.apply_rope(q, k, positions, table)
    torch.testing.assert_close(q, want_q.to(dtype), **tol)
    torch.testing.assert_close(k, want_k.to(dtype), **tol)
    assert torch.equal(qkv[:, (hq + hkv) * dim :], v_before)
    assert calls == {"rms_norm": 2, "silu_and_mul": 1, "apply_rope": 1}  # q and k in one pass


def test_bf16_rows_round_as_torch_at_the_edges():
    # The residual sum's rounding to bf16, vectorized: bit for bit torch's, ties, denormals, infinities
    # and NaN included, over a row length that leaves a partial vector.
    assert native.available()
    gen = seeded(22)
    n = 37
    x = torch.randn(4, n, generator=gen)
    add = torch.randn(4, n, generator=gen)
    x[0, :8] = torch.tensor([1e-39, -3e-40, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.0])
    add[0, :8] = torch.tensor([2e-39, 1e-41, 1.0, 2.0, 0.0, -0.0, -0.0, 2.0**-8])  # 1 + 2^-8: a tie
    x, add = x.bfloat16(), add.bfloat16()
    w = torch.ones(n).bfloat16()
    _, resid = native.rms_norm(x, w, 1e-5, add)
    want = (x.float() + add.float()).bfloat16()
    assert torch.equal(resid.view(torch.int16), want.view(torch.int16))


def test_row_kernels_leave_other_dtypes_to_torch():
    x = torch.randn(4, 32, dtype=torch.float16)
    assert not native.supports_rows(x)
    assert native.supports_rows(x.float()) and native.supports_rows(x.bfloat16())
    assert not native.supports_rows(x.float(), x.bfloat16())  # mixed dtypes: torch
    torch.testing.assert_close(cpu.silu_and_mul(x), reference.silu_and_mul(x))
