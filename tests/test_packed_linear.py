"""Packed linear layers (services/engine/model/packed_linear.py): which layers are swapped, which
row counts take the packed product, its numbers against F.linear in and out of the compiler, the
packed copy's lifetime, and an engine with packing on and off giving the same greedy tokens."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.engine import LLM, SamplingParams
from services.engine.model import packed_linear as P

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not P.available(), reason="torch built without oneDNN"),
]


def big_linear(bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(512, 1024, bias=bias)  # 512K elements: the smallest packed size


def test_only_large_fp32_cpu_linears_are_swapped():
    model = nn.Sequential(big_linear(), nn.Linear(64, 64), big_linear().to(torch.bfloat16), nn.ReLU())
    model.add_module("lm_head", big_linear())
    assert P.pack_linears(model) == 1
    assert isinstance(model[0], P.PackedLinear)
    assert type(model[1]) is nn.Linear and type(model[2]) is nn.Linear  # small; bf16
    assert type(model.lm_head) is nn.Linear  # read by compute_logits directly


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 32, 128, 129, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_f_linear(rows, bias):
    linear = big_linear(bias)
    packed = P.PackedLinear(linear)
    x = torch.randn(rows, 512)
    with torch.inference_mode(), torch.profiler.profile() as prof:
        got = packed(x)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias), atol=1e-4, rtol=1e-4)
    took_packed = any(e.name == "mkldnn::_linear_pointwise" for e in prof.events())
    assert took_packed == (P.MIN_ROWS <= rows <= P.MAX_ROWS)


def test_compiled_op_matches_eager():
    packed = P.PackedLinear(big_linear(bias=True))
    x = torch.randn(8, 512)
    with torch.inference_mode():
        want = packed(x)
        got = torch.compile(lambda t: torch.relu(packed(t)), fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(got, torch.relu(want))


def test_packed_copy_goes_with_its_layer():
    packed = P.PackedLinear(big_linear())
    handle = packed.handle
    assert handle in P._PACKED
    del packed
    gc.collect()
    assert handle not in P._PACKED


def test_engine_greedy_tokens_same_with_and_without_packing(tmp_path):
    from tests.models import build_tiny_model

    model_dir = build_tiny_model(str(tmp_path / "m"), hidden_size=512, intermediate_size=1024)  # MLPs packed
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4], [20, 21, 22, 23], [30, 31]]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = []
    for packed in (True, False):
        llm = LLM(model_dir, device="cpu", dtype="float32", packed_weights=packed, num_pages=64)
        assert any(isinstance(m, P.PackedLinear) for m in llm.engine.model.modules()) == packed
        outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
