"""The quantized model on the Triton path (the CPU interpreter here, TRITON_INTERPRET=1 from conftest):
the W8A8 / W4A16 GEMMs and the fused RMSNorm / SiLU-mul quantization kernels give the torch path's
logits, and the engine serves a quantized model with an INT8 KV cache on it. Tiny inputs: the
interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.backend import get_backend
from pipeserve.engine.model.accuracy import logits_error, teacher_forced_logits
from pipeserve.engine.model.loader import load_model
from pipeserve.engine.quantization.model import quantize_model
from tests.conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow, pytest.mark.device, pytest.mark.timeout(240),
              pytest.mark.usefixtures("torch_one_thread")]


@pytest.mark.parametrize("method", ["w8a8-int8", "w8a8-fp8", "w4a16", "nf4"])
def test_triton_quantized_model_matches_the_torch_path(stories_dir, method):
    seqs = [[1, 403, 407, 261, 378], [1, 286, 261]]  # two prefills, one chunk each
    logits = {}
    for backend in ("cpu", "triton"):
        # Attention, RoPE and norms on torch for both: their kernels have their own tests (and the
        # engine test below); this one isolates the quantized GEMMs and fused quantization.
        model = load_model(stories_dir, get_backend("cpu"), torch.device(TEST_DEVICE), torch.float32,
                           512)[0]
        quantize_model(model, method, backend)
        assert model.layers[0].mlp.down_proj.backend is get_backend(backend)
        logits[backend] = teacher_forced_logits(model, seqs)
    # Same codes, same scales: only the accumulation order differs (int8 sums are exact).
    assert logits_error(logits["triton"], logits["cpu"]) < 1e-5


def test_triton_engine_serves_w8a8_int8_with_int8_kv_like_torch(stories_dir):
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "triton"):
        llm = LLM(stories_dir, device=TEST_DEVICE, backend=backend, quantization="w8a8-int8",
                  kv_cache_dtype="int8", num_pages=8, step_executor="eager")
        tokens[backend] = llm.generate(["Once upon a time"], greedy)[0].token_ids
    assert tokens["triton"] == tokens["cpu"] and len(tokens["cpu"]) == 4
