"""The CPU's linear layers (pipeserve/engine/backend/cpu_linear.py) and the native packed product
behind them: which layers are swapped (and that only the packed weight is kept), its numbers against
F.linear (row counts, tails of K and N, bias, strided rows, one and two threads, in and out of the
compiler), the bf16 packed product, the oneDNN GEMM the measured table hands many rows to, the
portable builds (no AVX2; AVX2 without AVX-512; AVX-512 without bf16 dot products), and an
engine's greedy tokens with the native kernels on and off."""

from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.backend import cpu_gemm, native
from pipeserve.engine.backend import cpu_linear as C
from tests.kernel_utils import native_library

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler"),
]

NO_BF16_GEMM = "oneDNN has no bf16 GEMM on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"


@pytest.fixture(autouse=True)
def _native_built() -> None:
    # CpuLinear packs through the library: built here, not by whichever test happened to run first.
    assert native.available()


def test_only_large_plain_fp32_and_bf16_cpu_linears_are_swapped(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "table", lambda: cpu_gemm.Table("test", ()))  # packed only
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(512, 1024).to(torch.bfloat16), nn.Linear(64, 96),
                          nn.Linear(512, 1024).half(), nn.ReLU())
    model.add_module("lm_head", nn.Linear(512, 1024, bias=False))  # an untied head: packed too
    first = model[0]
    assert C.use_cpu_linears(model) == 3
    swapped = model[0]
    assert isinstance(swapped, C.CpuLinear) and not hasattr(swapped, "weight")  # the packed copy only
    assert swapped.packed.numel() == first.weight.numel() and swapped.bias is not None
    assert swapped.reordered is None  # no GEMM row count in the table: no second copy
    assert type(model[1]) is C.CpuLinear and model[1].packed.dtype == torch.bfloat16
    assert type(model[2]) is nn.Linear and type(model[3]) is nn.Linear and type(model.lm_head) is C.CpuLinear
    x = torch.randn(3, 512)
    with torch.inference_mode():
        torch.testing.assert_close(model[0](x), first(x), atol=1e-4, rtol=1e-4)


def test_nothing_is_swapped_without_the_native_kernels(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)  # a host without a C++ compiler
    assert C.use_cpu_linears(nn.Sequential(nn.Linear(512, 1024))) == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 64, 32), (2, 64, 32), (3, 37, 50), (5, 130, 517),
                                              (8, 4, 16), (9, 70, 33), (17, 256, 128), (32, 3, 1000),
                                              (70, 20, 40), (200, 100, 24), (400, 33, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_matches_f_linear(threads, rows, n, k, bias):
    """Every row count (full tiles of 6 and each remainder, blocks of 192 rows), panel tails (n not a
    multiple of 16, groups of fewer than 4 panels), strided rows."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * n + k)
        wide = torch.randn(rows, k + 7, generator=gen)
        x = wide[:, 3 : 3 + k]  # strided rows, as a slice of a fused projection's output
        w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if bias else None
        packed = native.pack_weight(w)
        assert packed.numel() == -(-n // native.PANEL) * native.PANEL * k
        got = native.packed_linear(x, packed, b, n)
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_leading_dimensions_are_kept():
    linear = nn.Linear(512, 1024)
    layer = C.CpuLinear(linear)
    x = torch.randn(2, 3, 512)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), linear(x), atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # compiles (Inductor or the library build)
@pytest.mark.parametrize(("dtype", "rows", "gemm_from"), [
    (torch.float32, 5, None),  # the packed product
    pytest.param(torch.bfloat16, 16, 8, marks=pytest.mark.skipif(not cpu_gemm.available(torch.bfloat16),
                                                                 reason=NO_BF16_GEMM)),  # the GEMM
])
def test_compiled_op_matches_eager(dtype, rows, gemm_from):
    # Both products are opaque ops under Inductor (its own oneDNN lowering rejects a reordered weight).
    layer = C.CpuLinear(nn.Linear(512, 1024).to(dtype), gemm_from=gemm_from)
    x = torch.randn(rows, 512).to(dtype)
    with torch.inference_mode():
        want = torch.relu(layer(x))
        got = torch.compile(lambda t: torch.relu(layer(t)), fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(got, want)


@pytest.mark.slow  # an engine each way
def test_engine_greedy_tokens_same_with_native_kernels_off(tiny_model, monkeypatch):
    """Eager engines (the native step needs the kernels): with the native kernels, and with the torch
    ops of a host without a C++ compiler."""
    model_dir = tiny_model("llama", hidden_size=512, intermediate_size=1024)  # MLPs large enough
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4], [20, 21, 22, 23], [30, 31]]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = []
    for available in (True, False):
        if not available:
            monkeypatch.setattr(native, "available", lambda: False)
        llm = LLM(model_dir, device="cpu", dtype="float32", num_pages=64, step_executor="eager")
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 64, 32), (3, 37, 51), (6, 130, 517), (9, 70, 33),
                                              (70, 20, 40), (200, 100, 24), (48, 64, 64), (64, 96, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_packed_product_matches_f_linear_on_bf16_rows(threads, rows, n, k, bias):
    """bf16 panels (pairs of k, an odd K's zero tail, N past the panels): fp32 accumulation of the
    rows rounded to bf16, against the same product in fp32. Where the CPU has AMX, from 2 rows: tiles
    written straight to y with the bias they started from, and partial ones (rows or columns) through
    a buffer."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows * n + k)
        x = torch.randn(rows, k + 5, generator=gen)[:, 2 : 2 + k]
        w = torch.randn(n, k, generator=gen).bfloat16()
        b = torch.randn(n, generator=gen) if bias else None
        packed = native.pack_weight(w)
        assert packed.dtype == torch.bfloat16
        assert packed.numel() == -(-n // native.PANEL) * native.PANEL * -(-k // 32) * 32
        got = native.packed_linear(x, packed, b, n)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x.bfloat16().float(), w.float(), b), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 64])
def test_bf16_product_rounds_its_rows_as_torch(rows):
    """Each row is rounded to bf16 as torch rounds it (ties to even, at both halves of a 32-value
    block and in the tail), denormals taken as zero where AVX512-BF16's dot products (and AMX's) run,
    as those instructions take them: with a permutation for the weight, the product is the rounded
    row itself."""
    k = 70  # two 32-value blocks and a tail of 6
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * 1000
    x[:, :8] = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.0e38, 1.5e-39, -2.0e-40, 1e-30, 0.0])
    x[:, 40:44] = torch.tensor([1.00390625, 1.01171875, 2.0e-39, 6.0e4])
    x[:, -2:] = torch.tensor([1.01171875, 9.0e-40])
    perm = torch.randperm(k, generator=gen)
    w = torch.eye(k)[perm].bfloat16()  # y[:, i] = x[:, perm[i]]
    got = native.packed_linear(x, native.pack_weight(w), None, k)
    want = x.bfloat16().float()
    if "AVX512-BF16" in native.isa():
        want = torch.where(want.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(want), want)
    want = want[:, perm]
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_from_the_tables_count_take_the_gemm(dtype, monkeypatch):
    if not cpu_gemm.available(dtype):
        pytest.skip(NO_BF16_GEMM if cpu_gemm.available() else "torch without oneDNN")
    linear = nn.Linear(512, 1024).to(dtype)
    layer = C.CpuLinear(linear, gemm_from=8)
    assert layer.reordered is not None
    calls = []
    gemm = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda *a: calls.append(a[0].shape[0]) or gemm(*a))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        for rows in (1, 7, 8, 64):
            x = torch.randn(rows, 512).to(dtype)
            got = layer(x)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), linear(x).float(), atol=tol, rtol=tol)
    assert calls == [8, 64]  # fewer rows take the packed product


def test_crossover_is_where_the_gemm_wins_from_then_on():
    rows = [1, 8, 64, 256]
    assert cpu_gemm.crossover(rows, [1.0, 2.0, 9.0, 30.0], [2.0, 3.0, 5.0, 20.0]) == 64
    assert cpu_gemm.crossover(rows, [1.0, 2.0, 9.0, 30.0], [0.5, 3.0, 5.0, 20.0]) == 64  # a lone early win
    assert cpu_gemm.crossover(rows, [1.0, 2.0, 9.0, 30.0], [2.0, 3.0, 10.0, 31.0]) is None
    assert cpu_gemm.crossover(rows, [1.0, 2.0, 9.0, 30.0], [2.0, 3.0, 8.5, 29.0]) is None  # within noise
    assert cpu_gemm.crossover(rows, [1.0, 2.0, 9.0, 30.0], [0.5, 1.0, 5.0, 20.0]) == 1


def test_table_lookup_by_cpu_class_dtype_and_nearest_shape():
    data = {"amx": {"entries": [
        {"dtype": "bfloat16", "n": 1280, "k": 768, "gemm_from": 8},
        {"dtype": "bfloat16", "n": 512, "k": 512, "gemm_from": 32},
        {"dtype": "float32", "n": 1280, "k": 768, "gemm_from": None}]}}
    table = cpu_gemm.parse(data, "amx")
    assert table.gemm_from(1280, 768, torch.bfloat16) == 8
    assert table.gemm_from(1024, 768, torch.bfloat16) == 8  # nearest measured shape
    assert table.gemm_from(512, 256, torch.bfloat16) == 32
    assert table.gemm_from(1280, 768, torch.float32) is None
    assert table.gemm_from(1280, 768, torch.float16) is None  # a dtype not measured
    assert cpu_gemm.parse(data, "avx512").entries == ()  # another CPU class: nothing measured
    assert cpu_gemm.cpu_class("fpu avx512f avx512_bf16 amx_bf16 amx_tile") == "amx"
    assert cpu_gemm.cpu_class("fpu avx512f avx512_bf16") == "avx512_bf16"
    assert cpu_gemm.cpu_class("fpu avx2 fma") == "avx2"
    assert cpu_gemm.cpu_class("fpu sse4_2") == "other"


def test_the_committed_table_parses_for_every_cpu_class():
    import json

    data = json.loads(cpu_gemm.TABLE.read_text())
    for cpu, section in data.items():
        table = cpu_gemm.parse(data, cpu)
        assert table.entries and {e.dtype for e in table.entries} == set(section["commands"])
        assert all(c.startswith("pipeserve bench gemm") for c in section["commands"].values())
        assert all(e.dtype in cpu_gemm.DTYPES and (e.gemm_from is None or e.gemm_from >= 1)
                   for e in table.entries)


def test_gemm_rows_follow_most_of_the_weight():
    layers = [C.CpuLinear(nn.Linear(512, 1024)) for _ in range(3)]
    assert C.gemm_rows(layers) is None
    layers[0].gemm_from, layers[1].gemm_from = 16, 64
    assert C.gemm_rows(layers) == 64  # 16 covers a third of the weight, 64 two thirds


@pytest.mark.slow  # two library builds
@pytest.mark.parametrize(("march", "isa"), [("x86-64-v2", 0), ("x86-64-v3", 8), ("skylake-avx512", 1)])
def test_portable_builds_compute_the_same_products(march, isa):
    """The library built for a CPU without AVX2 (portable loops throughout), for one with AVX2 and
    FMA but no AVX-512 (8-lane tiles, bf16 widened), and for one with AVX-512F but no bf16 dot
    products (portable bf16 loops): every product as on this host, at row counts on both sides of
    the tiles' sizes and of the bf16 widening threshold."""
    lib = native_library(march)
    assert lib.pipeserve_isa() == isa
    gen = torch.Generator().manual_seed(7)
    for dtype, rows in itertools.product((torch.float32, torch.bfloat16), (1, 5, 13, 200)):
        n, k = 70, 517
        x, b = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
        w = torch.randn(n, k, generator=gen).to(dtype)
        packed = native.pack_weight(w)
        out = torch.empty(rows, n)
        fn = lib.pipeserve_packed_linear if dtype == torch.float32 else lib.pipeserve_packed_linear_bf16
        fn(x.data_ptr(), k, packed.data_ptr(), b.data_ptr(), out.data_ptr(), rows, n, k, 1)
        torch.testing.assert_close(out, native.packed_linear(x, packed, b, n), atol=1e-4, rtol=1e-4)
