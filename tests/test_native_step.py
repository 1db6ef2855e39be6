"""The native step (pipeserve/engine/executor/native.py, backend/csrc/decode_step.cpp): its logits
and KV writes against the per-op forward pass on the same inputs, which models it takes (as
model/llama.py declares), and greedy outputs token-identical to eager steps through the engine (no
Inductor build: these run fast)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.backend import get_backend, native
from pipeserve.engine.executor.inductor import InductorStep
from pipeserve.engine.executor.native import NATIVE_MERGED_ROWS, NativeStep, unsupported
from pipeserve.engine.executor.select import StepPlan, choose
from pipeserve.engine.model import llama
from tests.test_compiled_step import ARCHITECTURES, padded

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels need a C++ compiler")

DENSE = [a for a in ARCHITECTURES if a[0] in ("llama", "qwen2", "mistral")]  # experts take Inductor
IDS = ["llama-gqa", "llama-mqa", "llama-tied", "llama3-rope", "qwen2-bias", "mistral-window"]


def engine_parts(model_dir: str, **options):
    llm = LLM(model_dir, device="cpu", dtype="float32", step_executor="eager", page_size=4, max_num_seqs=4,
              num_pages=24, **options)
    return llm, llm.engine.model, llm.engine.pool


@pytest.mark.parametrize("kind,overrides", DENSE, ids=IDS)
def test_native_step_matches_the_per_op_forward(tiny_model, kind, overrides):
    """Rows at different lengths over pages of random K/V, and two rows of one request sharing its
    table (a verification chunk: the second attends to the K/V the first writes in the same step)."""
    _, model, pool = engine_parts(tiny_model(kind, **overrides))
    assert pool.kv is not None
    g = torch.Generator().manual_seed(0)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    per_op = padded(InductorStep, pool, 8)  # its forward, called eagerly
    per_op.model = model
    native_step = NativeStep(model, pool, 8)
    width = pool.max_pages_per_seq
    tables = np.zeros((4, width), np.int32)
    tables[0, :1] = [1]
    tables[1, :2] = [2, 3]
    tables[2:, :4] = [4, 5, 6, 7]  # one request, two rows
    positions = np.array([0, 6, 12, 13])
    slots = tables[np.arange(4), positions // 4].astype(np.int64) * 4 + positions % 4
    args = [torch.randint(3, 300, (4,), generator=g), torch.from_numpy(positions),
            torch.from_numpy(slots), torch.from_numpy(tables), torch.from_numpy(positions + 1).int()]
    kv_before = pool.kv.clone()
    with torch.inference_mode():
        want = per_op.forward(*args)
        kv_want = pool.kv.clone()
        pool.kv.copy_(kv_before)  # the native step writes the same K/V into the same slots
        got = native_step(*(a.numpy() for a in args))  # host arrays, as the runner passes them
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool.kv, kv_want, rtol=1e-5, atol=1e-5)


def test_which_models_the_native_step_takes(tiny_model):
    cpu, auto = torch.device("cpu"), StepPlan(requested="auto", max_rows=4)
    llm, model, pool = engine_parts(tiny_model("llama"))
    assert unsupported(model, pool) is None
    assert choose(auto, get_backend("cpu"), model, pool, cpu)[0] == "native"
    compiled = StepPlan(requested="compiled", max_rows=4)
    assert choose(compiled, get_backend("cpu"), model, pool, cpu)[0] == "inductor"
    _, moe, moe_pool = engine_parts(tiny_model("mixtral"))
    assert "mixture of experts" in (unsupported(moe, moe_pool) or "")
    assert choose(auto, get_backend("cpu"), moe, moe_pool, cpu)[0] == "inductor"
    with pytest.raises(ValueError, match="mixture of experts"):
        choose(StepPlan(requested="native", max_rows=4), get_backend("cpu"), moe, moe_pool, cpu)
    _, quant, quant_pool = engine_parts(tiny_model("llama"), quantization="w8a8-int8")
    assert unsupported(quant, quant_pool) is not None
    _, _, int8_pool = engine_parts(tiny_model("llama"), kv_cache_dtype="int8")
    assert "KV cache" in (unsupported(model, int8_pool) or "")
    bf16 = LLM(tiny_model("llama"), device="cpu", dtype="bfloat16", compile=False, max_num_seqs=2).engine
    assert unsupported(bf16.model, bf16.pool) is not None


def test_the_native_step_declares_every_feature_the_model_reads():
    """Each ModelConfig field model/llama.py reads is declared there as mirrored by the native step
    or refused by it: a new feature of the model fails here until the native step declares it."""
    source = Path(llama.__file__).read_text()
    read = set(re.findall(r"\bcfg\.([a-z_]+)", source)) - {"refusal"}
    declared = llama.NATIVE_STEP.mirrors | set(llama.NATIVE_STEP.refuses)
    assert read <= declared, f"declare in llama.NATIVE_STEP: {sorted(read - declared)}"
    assert not llama.NATIVE_STEP.mirrors & set(llama.NATIVE_STEP.refuses)


def greedy(model_dir: str, prompts: list[list[int]], n: int, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, device="cpu", dtype="float32", page_size=4, **options)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0)] * len(prompts))
    assert llm.engine.stats()["pages_used"] == 0
    return [o.token_ids for o in outs], llm


def counted_rows(llm: LLM) -> list[int]:
    """The row count of every step the engine runs through its native step, appended as it runs."""
    executor = llm.engine.runner.executor
    assert executor.mode == "native"
    rows, run = [], executor.run

    def counted(flat):
        rows.append(flat.num_rows)
        return run(flat)

    executor.run = counted  # type: ignore[method-assign]
    return rows


@pytest.mark.parametrize("kind,overrides", DENSE, ids=IDS)
def test_every_dense_architecture_native_equals_eager(tiny_model, kind, overrides):
    """Two prompts prefilled in one step of 16 rows, decode steps of 2 rows, and once the first
    request ends the third prompt prefilled beside the second's decode row (a merged step of 4
    rows): every step native."""
    model_dir = tiny_model(kind, **overrides)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 11, 3)]
    lengths = [4, 14, 10]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    eager = LLM(model_dir, device="cpu", dtype="float32", page_size=4, compile=False, max_num_seqs=2)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(model_dir, device="cpu", dtype="float32", page_size=4, max_num_seqs=2)  # auto: native
    assert llm.engine.runner.executor.max_rows == NATIVE_MERGED_ROWS  # every row count as itself
    rows = counted_rows(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert rows[:2] == [16, 2] and 4 in rows and llm.engine.stats()["pages_used"] == 0


def test_long_chunks_stay_eager(tiny_model):
    """A prompt longer than a native step's rows is prefilled eager, then decodes native."""
    model_dir = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 320, (NATIVE_MERGED_ROWS + 9,), generator=g).tolist()
    expected, _ = greedy(model_dir, [prompt], 6, compile=False, max_num_seqs=1)
    llm = LLM(model_dir, device="cpu", dtype="float32", page_size=4, max_num_seqs=1)
    rows = counted_rows(llm)
    assert llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids == expected[0]
    assert rows == [1] * 5


def test_stories_native_equals_eager(stories_dir):
    from transformers import AutoTokenizer

    from tests.test_engine_parity import STORY_PROMPTS

    tok = AutoTokenizer.from_pretrained(stories_dir)
    prompts = [tok(p).input_ids for p in STORY_PROMPTS[:3]]
    expected, _ = greedy(stories_dir, prompts, 24, compile=False, max_num_seqs=4)
    got, llm = greedy(stories_dir, prompts, 24, max_num_seqs=4)
    assert llm.engine.runner.executor.mode == "native"
    assert got == expected


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_verification_rows_run_native_and_equal_eager(tiny_model, method):
    """Verification chunks (1 + k rows of one request) and the draft's one-token rounds run as
    native decode rows; the greedy tokens are a plain eager engine's."""
    from tests.test_compiled_step import count_compiled_verifications

    model_dir = tiny_model("llama")
    prompts = [[5, 17, 99, 3, 42, 5, 17, 99, 3, 42, 5, 17], [7, 8, 9, 7, 8, 9, 7]]
    expected, _ = greedy(model_dir, prompts, 16, compile=False, max_num_seqs=2)
    spec = dict(prompt_lookup_min=1) if method == "ngram" else dict(draft_model=model_dir)
    llm = LLM(model_dir, device="cpu", dtype="float32", page_size=4, max_num_seqs=2,
              speculative_method=method, speculative_adaptive=False, num_speculative_tokens=3, **spec)
    assert llm.engine.runner.executor.mode == "native"
    counts = count_compiled_verifications(llm)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=16, temperature=0.0)] * 2)
    assert [o.token_ids for o in outs] == expected
    assert counts["compiled"] > 0 and counts["eager"] == 0
    if method == "draft":
        speculator = llm.engine.speculator
        assert speculator is not None and speculator.draft is not None
        assert speculator.draft.runner.executor.mode == "native"
