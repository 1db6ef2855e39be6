"""The CPU's linear layers (pipeserve/engine/backend/cpu_linear.py) and the native packed product
behind them: which layers are swapped (and that only the packed weight is kept), its numbers against
F.linear (row counts, tails of K and N, bias, strided rows, one and two threads, in and out of the
compiler), and an engine's greedy tokens with the native kernels on and off."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.backend import cpu_linear as C
from pipeserve.engine.backend import native

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler"),
]


def test_only_large_plain_fp32_cpu_linears_are_swapped():
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(512, 1024).to(torch.bfloat16), nn.Linear(64, 96),
                          nn.ReLU())
    model.add_module("lm_head", nn.Linear(512, 1024, bias=False))  # an untied head: packed too
    first = model[0]
    assert C.use_cpu_linears(model) == 2
    swapped = model[0]
    assert isinstance(swapped, C.CpuLinear) and not hasattr(swapped, "weight")  # the packed copy only
    assert swapped.packed.numel() == first.weight.numel() and swapped.bias is not None
    assert type(model[1]) is nn.Linear and type(model[2]) is nn.Linear and type(model.lm_head) is C.CpuLinear
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
def test_compiled_op_matches_eager():
    layer = C.CpuLinear(nn.Linear(512, 1024))
    x = torch.randn(5, 512)
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
