"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers `generate`,
greedy and token for token in fp32, on tiny random checkpoints in both expert layouts (one module
per expert as transformers saves them, and fused 3-D expert tensors written from those): mixed
batches with chunked prefill on the cpu and reference backends, preemption in a small KV pool, and
one small case per architecture through the Triton kernels under the interpreter."""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine import LLM, SamplingParams
from pipeserve.model_config import ModelConfig
from tests.conftest import TEST_DEVICE
from tests.models import write_fused_experts
from tests.test_engine_parity import hf_greedy, run_llm

KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def moe_case(tiny_model, tmp_path_factory):
    """kind -> (per-expert dir, fused dir, prompts, HF's greedy tokens)."""
    cases: dict[str, tuple[str, str, list[list[int]], list[list[int]]]] = {}

    def make(kind: str):
        if kind not in cases:
            model_dir = tiny_model(kind)
            fused = write_fused_experts(model_dir, str(tmp_path_factory.mktemp(kind) / "fused"))
            g = torch.Generator().manual_seed(3)
            prompts = [torch.randint(3, 320, (n,), generator=g, device="cpu").tolist()
                       for n in (5, 17, 1, 11)]
            cases[kind] = (model_dir, fused, prompts, hf_greedy(model_dir, prompts, MAX_NEW))
        return cases[kind]

    return make


@pytest.mark.parametrize("kind", KINDS)
def test_config_reads_the_experts(tiny_model, kind):
    cfg = ModelConfig.from_dir(tiny_model(kind))
    assert cfg.is_moe
    expected = {
        "mixtral": (4, 2, 96, True, 0, [True, True], False),
        "qwen2_moe": (8, 4, 64, False, 96, [False, True], False),
        "qwen3_moe": (8, 2, 64, True, 0, [False, True], True),
    }[kind]
    got = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
           cfg.shared_expert_intermediate_size, cfg.moe_layers, cfg.qk_norm)
    assert got == expected


FAST = {("mixtral", "per-expert"), ("qwen3_moe", "fused")}  # the rest wait for `make test`


@pytest.mark.parametrize(
    "kind,layout",
    [(k, lay) if (k, lay) in FAST else pytest.param(k, lay, marks=pytest.mark.slow)
     for k in KINDS for lay in ("per-expert", "fused")],
)
def test_moe_matches_hf_chunked_mixed_batch(moe_case, kind, layout):
    per_expert, fused, prompts, expected = moe_case(kind)
    model_dir = per_expert if layout == "per-expert" else fused
    # Chunks of 8 tokens over pages of 4: prefill chunks share steps with other requests' decodes.
    assert run_llm(model_dir, prompts, MAX_NEW, page_size=4, max_num_batched_tokens=8,
                   step_executor="eager") == expected


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_moe_reference_backend_matches_hf(moe_case, kind):
    per_expert, _, prompts, expected = moe_case(kind)
    assert run_llm(per_expert, prompts, MAX_NEW, backend="reference", page_size=4,
                   max_num_batched_tokens=8) == expected


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_moe_preemption_keeps_tokens_identical(moe_case, kind):
    _, fused, prompts, expected = moe_case(kind)
    # 12 pages of 4 tokens hold fewer than the 23 pages the four requests reach: the engine preempts.
    llm = LLM(fused, device="cpu", dtype="float32", page_size=4, num_pages=12, max_num_batched_tokens=8,
              step_executor="eager")
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0 and stats["pages_used"] == 0


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", KINDS)
def test_moe_triton_interpreter_matches_hf(moe_case, kind):
    per_expert, _, prompts, expected = moe_case(kind)
    # Two prompts, a small pool: the interpreter copies every tensor argument's storage per launch.
    got = run_llm(per_expert, prompts[:2], 6, backend="triton", page_size=4, num_pages=24,
                  max_num_batched_tokens=12, device=TEST_DEVICE)
    assert got == [e[:6] for e in expected[:2]]


def test_loader_rejects_a_missing_expert(tiny_model, tmp_path):
    import os

    from safetensors.torch import load_file, save_file

    src = tiny_model("mixtral")
    dst = write_fused_experts(src, str(tmp_path / "broken"))
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.down_proj"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.mlp.experts.w2"):
        LLM(dst, device="cpu", dtype="float32")
