"""The fused MoE Triton kernels (pipeserve/engine/triton_kernels/fused_moe.py) under the interpreter
against the torch reference: routing (softmax top-k, renormalized or not), the block alignment of
token/expert pairs, and the whole fused_moe, over several expert counts, top-k 1/2/8, token counts
below and above the block size, and experts no token picks. Outputs poisoned before each run. The
CPU backend's sort-based MoE is checked against the same reference."""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine.backend import cpu
from pipeserve.engine.backend import reference as ref
from pipeserve.engine.triton_kernels import fused_moe as fm
from tests.conftest import TEST_DEVICE
from tests.kernel_utils import (
    assert_close,
    poisoned_alloc,  # noqa: F401  (fixture, used via usefixtures)
    seeded,
)

pytestmark = [pytest.mark.device, pytest.mark.timeout(120), pytest.mark.usefixtures("poisoned_alloc")]

F32, BF16 = torch.float32, torch.bfloat16
# (experts, top_k, tokens): block size 16 under the interpreter, so 3 x 2 pairs fill less than one
# block and 40 x 8 fill many.
CASES = [(3, 1, 1), (3, 2, 21), (8, 2, 3), (8, 8, 40), (20, 1, 33), (20, 8, 5)]
# The interpreter runs every program's lanes on the CPU: most cases wait for `make test`.
SLOW = pytest.mark.slow


def cases(fast: set[tuple[int, int, int]]) -> list:
    """CASES, those not in `fast` marked slow."""
    return [c if c in fast else pytest.param(*c, marks=SLOW) for c in CASES]


def router_logits(tokens: int, experts: int, gen: torch.Generator, dead: int = 0) -> torch.Tensor:
    """Random logits; the last `dead` experts are never picked (large negative logits)."""
    logits = torch.randn(tokens, experts, generator=gen) * 2
    if dead:
        logits[:, experts - dead :] = -30.0
    return logits


@pytest.mark.parametrize("experts,top_k,tokens", CASES)
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(experts, top_k, tokens, renormalize):
    logits = router_logits(tokens, experts, seeded(experts * 100 + tokens))
    weights, ids = fm.topk_softmax(logits, top_k, renormalize)
    want_w, want_ids = ref.moe_route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert_close(weights, want_w, F32)
    if renormalize:
        assert torch.allclose(weights.sum(-1), torch.ones(tokens))


@pytest.mark.parametrize("experts,top_k,tokens", CASES)
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_block_size(experts, top_k, tokens, block_m):
    gen = seeded(experts + top_k + tokens)
    dead = min(experts // 3, experts - top_k)  # experts no token picks: no blocks
    _, ids = ref.moe_route(router_logits(tokens, experts, gen, dead), top_k, False)
    align = fm.align_block_size(ids.int(), experts, block_m)
    n = ids.numel()
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    assert int(align.num_padded[0]) == total and total % block_m == 0
    assert align.sorted_ids.shape[0] >= total and (align.sorted_ids[total:] == n).all()
    start = 0
    for e in range(experts):
        group = align.sorted_ids[start : start + int(padded[e])]
        # The expert's pairs in pair order, then the sentinel up to the block boundary.
        want = (flat == e).nonzero()[:, 0].int()
        assert torch.equal(group[: len(want)], want) and (group[len(want) :] == n).all()
        blocks = align.expert_ids[start // block_m : (start + int(padded[e])) // block_m]
        assert (blocks == e).all()
        start += int(padded[e])
    assert (align.expert_ids[total // block_m :] == -1).all()
    assert int((padded == 0).sum()) >= dead


@pytest.mark.parametrize("experts,top_k,tokens", cases({(3, 1, 1), (8, 2, 3)}))
@pytest.mark.parametrize("dtype", [F32, pytest.param(BF16, marks=SLOW)])
def test_fused_moe_matches_reference(experts, top_k, tokens, dtype):
    gen = seeded(experts * top_k + tokens)
    hidden, inter = 48, 40  # neither a multiple of the 32-wide tiles: masked edges
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    logits = router_logits(tokens, experts, gen, dead=min(experts // 3, experts - top_k)).to(dtype)
    for renormalize in (False, True):
        out = fm.fused_moe(x, logits, w13, w2, top_k, renormalize)
        want = ref.fused_moe(x.float(), logits.float(), w13.float(), w2.float(), top_k, renormalize)
        assert out.dtype == dtype
        assert_close(out, want, dtype, scale=4.0 if dtype == BF16 else 1.0)


def test_fused_moe_no_tokens():
    w13, w2 = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    assert fm.fused_moe(torch.randn(0, 8), torch.randn(0, 4), w13, w2, 2, True).shape == (0, 8)


@pytest.mark.parametrize("experts,top_k,tokens", CASES)
def test_cpu_backend_moe_matches_reference(experts, top_k, tokens):
    gen = seeded(7 * experts + tokens)
    x = torch.randn(tokens, 32, generator=gen)
    w13 = torch.randn(experts, 48, 32, generator=gen) * 0.2
    w2 = torch.randn(experts, 32, 24, generator=gen) * 0.2
    logits = router_logits(tokens, experts, gen, dead=min(experts // 3, experts - top_k))
    for renormalize in (False, True):
        out = cpu.fused_moe(x, logits, w13, w2, top_k, renormalize)
        assert_close(out, ref.fused_moe(x, logits, w13, w2, top_k, renormalize), F32)


def quantized_experts(method: str, experts: int, hidden: int, inter: int, gen: torch.Generator):
    """Float experts and their quantized form (quantization/experts.py) on the reference backend."""
    from pipeserve.engine.quantization.experts import W4A16Experts, W8A8Experts

    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    if method in ("int8", "fp8"):
        dtype = torch.int8 if method == "int8" else torch.float8_e4m3fn
        return w13, w2, W8A8Experts(w13, w2, 2, True, dtype, ref.BACKEND)
    return w13, w2, W4A16Experts(w13, w2, 2, True, method, ref.BACKEND)


def quant_args(q) -> tuple:
    if hasattr(q, "w13_scale"):
        return q.w13, q.w13_scale, q.w2, q.w2_scale
    return q.w13, q.w13_scales, q.w13_zeros, q.w2, q.w2_scales, q.w2_zeros


@pytest.mark.parametrize("method", ["int8", *(pytest.param(m, marks=SLOW) for m in ("fp8", "int4", "nf4"))])
@pytest.mark.parametrize("experts,top_k,tokens", [(3, 1, 2), pytest.param(8, 2, 21, marks=SLOW),
                                                  pytest.param(8, 8, 5, marks=SLOW)])
def test_quantized_fused_moe_matches_reference(method, experts, top_k, tokens):
    gen = seeded(experts * 31 + tokens)
    # hidden 64 and inter 96: whole 4-bit groups (64, 96) that the 32-deep K tiles divide.
    w13, w2, q = quantized_experts(method, experts, 64, 96, gen)
    x = torch.randn(tokens, 64, generator=gen)
    logits = router_logits(tokens, experts, gen, dead=min(experts // 3, experts - top_k))
    name = "fused_moe_w8a8" if method in ("int8", "fp8") else "fused_moe_w4a16"
    out = getattr(fm, name)(x, logits, *quant_args(q), top_k, True)
    want = getattr(ref, name)(x, logits, *quant_args(q), top_k, True)
    # The kernels quantize the activations themselves: a rounding step of an int8 / fp8 code apart.
    assert_close(out, want, F32, scale={"int8": 400.0, "fp8": 2000.0}.get(method, 1.0))
    # And the quantized MoE approximates the float one.
    dense = ref.fused_moe(x, logits, w13, w2, top_k, True)
    rel = (want - dense).norm() / dense.norm()
    assert rel < {"int8": 0.04, "fp8": 0.15, "int4": 0.25, "nf4": 0.25}[method]  # a wrong layout: ~1
    if method in ("int8", "fp8"):
        assert_close(cpu.fused_moe_w8a8(x, logits, *quant_args(q), top_k, True), want, F32,
                     scale={"int8": 400.0, "fp8": 2000.0}[method])


@pytest.mark.slow
@pytest.mark.timeout(400)  # compiles every MoE kernel variant: minutes beside other workers on a GPU host
def test_quantize_model_quantizes_the_experts(tiny_model):
    from pipeserve.engine import LLM, SamplingParams
    from pipeserve.engine.model.moe import MoE
    from pipeserve.engine.quantization.experts import W4A16Experts, W8A8Experts

    for method, cls in (("w8a8-int8", W8A8Experts), ("w4a16", W4A16Experts)):
        llm = LLM(tiny_model("qwen2_moe"), device=TEST_DEVICE, dtype="float32", quantization=method,
                  page_size=4, step_executor="eager")
        sparse = [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, MoE)]
        assert sparse and all(isinstance(m.experts, cls) for m in sparse)
        out = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=4, temperature=0.0))
        assert [len(o.token_ids) for o in out] == [4, 4]
