"""The Triton backend end to end: get_backend("triton") holds kernels with the reference's signatures,
and LLM(..., backend="triton") (interpreted on the CPU, compiled on PIPESERVE_TEST_DEVICE=cuda)
produces the same greedy tokens as backend="cpu" on a 2-layer random Llama (head_dim 64) and on
stories260K (head_dim 8), with the int8 KV cache off and on. Small pools: the interpreter copies
every tensor argument's storage."""

from __future__ import annotations

import inspect

import pytest

from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.backend import get_backend
from pipeserve.engine.backend.base import OP_NAMES
from tests.conftest import TEST_DEVICE

pytestmark = [pytest.mark.slow, pytest.mark.device, pytest.mark.timeout(300)]

OPTIONS = dict(device=TEST_DEVICE, dtype="float32", page_size=4, num_pages=48, max_num_batched_tokens=12)


def test_triton_ops_keep_the_reference_signatures():
    ops, reference = get_backend("triton"), get_backend("reference")
    assert ops.name == "triton"
    for name in OP_NAMES:  # the ops; a backend's specifics (prepare_model, ...) are not kernels
        kernel, ref = getattr(ops, name), getattr(reference, name)
        assert kernel is not ref and kernel.__module__.startswith("pipeserve.engine.triton_kernels")
        want = list(inspect.signature(ref).parameters.items())
        got = list(inspect.signature(kernel).parameters.items())
        assert [(p, v.kind, v.default) for p, v in got[: len(want)]] == [
            (p, v.kind, v.default) for p, v in want
        ]


def greedy(model: str | None, prompts: list[list[int]], backend: str, kv_cache_dtype: str, max_tokens: int):
    llm = LLM(model, backend=backend, kv_cache_dtype=kv_cache_dtype, step_executor="eager", **OPTIONS)
    assert llm.engine.backend == backend
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_random_llama_head_dim_64(tiny_model, kv_cache_dtype):
    model = tiny_model("llama")
    # Prompt lengths cross page (4) and chunk (12) boundaries: chunked prefill plus decode steps.
    prompts = [[5, 17, 99, 3, 42, 7, 64, 21, 8, 250, 11, 90, 33, 4], [300, 2, 41]]
    want = greedy(model, prompts, "cpu", kv_cache_dtype, 5)
    assert greedy(model, prompts, "triton", kv_cache_dtype, 5) == want


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_stories260k(stories_dir, kv_cache_dtype):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    prompts = [tok(p).input_ids for p in ("Once upon a time", "The cat sat on the mat and")]
    want = greedy(stories_dir, prompts, "cpu", kv_cache_dtype, 6)
    assert greedy(stories_dir, prompts, "triton", kv_cache_dtype, 6) == want
