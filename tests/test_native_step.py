"""The native step (pipeserve/engine/executor/native.py, backend/csrc/decode_step.cpp): its logits
and KV writes against the per-op forward pass on the same inputs, which models it takes (as
model/llama.py declares), greedy outputs token-identical to eager steps through the engine (no
Inductor build: these run fast), and in bf16 the same within bf16's rounding, with teacher-forced
agreement against fp32 on a real model."""

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


def engine_parts(model_dir: str, dtype: str = "float32", **options):
    llm = LLM(model_dir, device="cpu", dtype=dtype, step_executor="eager", page_size=4, max_num_seqs=4,
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
    assert unsupported(bf16.model, bf16.pool) is None
    assert choose(auto, get_backend("cpu"), bf16.model, bf16.pool, cpu) == (
        "native", f"dense bfloat16 LlamaForCausalLM, {torch.get_num_threads()} threads")
    fp16 = LLM(tiny_model("llama"), device="cpu", dtype="float16", compile=False, max_num_seqs=2).engine
    assert "neither fp32 nor bf16" in (unsupported(fp16.model, fp16.pool) or "")


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


def teacher_forced(model_dir: str, dtype: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of each sequence, through one native step of all its rows (each a
    query at its own position, attending causally by length)."""
    llm = LLM(model_dir, device="cpu", dtype=dtype, step_executor="eager", page_size=4, max_num_seqs=1,
              num_pages=64)
    model, pool = llm.engine.model, llm.engine.pool
    step = NativeStep(model, pool, max(len(q) for q in seqs))
    out = []
    for seq in seqs:
        n = len(seq)
        tables = np.zeros((n, pool.max_pages_per_seq), np.int32)
        tables[:, : -(-n // 4)] = np.arange(1, 1 + -(-n // 4))
        pos = np.arange(n)
        slots = tables[0, pos // 4].astype(np.int64) * 4 + pos % 4
        with torch.inference_mode():
            out.append(step(np.array(seq), pos, slots, tables, pos + 1).clone())
    return out


@pytest.mark.parametrize("kind,overrides", [DENSE[0], DENSE[2], DENSE[4]], ids=[IDS[0], IDS[2], IDS[4]])
def test_bf16_native_step_matches_the_fp32_step_within_rounding(tiny_model, kind, overrides):
    """bf16 weights and cache: the fp32 step's logits on the same checkpoint, within what rounding the
    weights, the products' input rows and K/V to bf16 moves them."""
    model_dir = tiny_model(kind, **overrides)
    seqs = [[int(t) for t in torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n))]
            for n in (5, 17)]
    bf16 = teacher_forced(model_dir, "bfloat16", seqs)
    fp32 = teacher_forced(model_dir, "float32", seqs)
    for got, want in zip(bf16, fp32, strict=True):
        assert got.dtype == torch.float32
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() < 0.05 * scale
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_bf16_native_equals_bf16_eager_greedy(tiny_model):
    model_dir = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 11, 3)]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (4, 14, 10)]
    eager = LLM(model_dir, device="cpu", dtype="bfloat16", page_size=4, compile=False, max_num_seqs=2)
    llm = LLM(model_dir, device="cpu", dtype="bfloat16", page_size=4, max_num_seqs=2)
    rows = counted_rows(llm)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert rows[:2] == [16, 2]  # every step native
    # Eager bf16 rounds every activation to bf16, the native step keeps them fp32: greedy ids agree
    # but for a near tie.
    agree = sum(a == b for g_, w_ in zip(got, want, strict=True) for a, b in zip(g_, w_, strict=True))
    assert agree >= 0.9 * sum(len(w) for w in want)


def test_stories_bf16_teacher_forced_agreement_with_fp32(stories_dir):
    """A real model: bf16 weights and cache through the native step, teacher-forced on fp32's greedy
    continuations, agree with fp32's next token at >= 97% of positions."""
    from transformers import AutoTokenizer

    from tests.test_engine_parity import STORY_PROMPTS

    tok = AutoTokenizer.from_pretrained(stories_dir)
    prompts = [tok(p).input_ids for p in STORY_PROMPTS]
    fp32_out, _ = greedy(stories_dir, prompts, 40, compile=False, max_num_seqs=5)
    seqs = [p + o for p, o in zip(prompts, fp32_out, strict=True)]
    fp32 = teacher_forced(stories_dir, "float32", seqs)
    bf16 = teacher_forced(stories_dir, "bfloat16", seqs)
    agree = total = 0
    for f, b, seq, p in zip(fp32, bf16, seqs, prompts, strict=True):
        # fp32's own greedy tokens are its argmax (the native step equals eager, HF-identical)
        assert f[len(p) - 1 : -1].argmax(-1).tolist() == seq[len(p) :]
        agree += int((b.argmax(-1) == f.argmax(-1)).sum())
        total += len(seq)
    assert agree >= 0.97 * total


def test_steps_from_the_tables_gemm_rows_run_per_op_through_the_gemm(tiny_model, monkeypatch):
    """A table giving oneDNN every bf16 layer from 8 rows: the native step takes steps of up to 7
    rows, larger ones (a 16-row prefill) run per op with the layers on the GEMM, and greedy ids
    agree with an engine whose layers never take it."""
    from pipeserve.engine.backend import cpu_gemm
    from pipeserve.engine.backend.cpu_linear import CpuLinear

    if not cpu_gemm.available(torch.bfloat16):
        pytest.skip("oneDNN has no bf16 GEMM here (torch without oneDNN, or a CPU without AVX-512 BW/VL/DQ "
                    "or AVX-NE-CONVERT)")
    model_dir = tiny_model("llama", hidden_size=512, intermediate_size=1024)  # layers CpuLinear packs
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [3, 4, 5]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = []
    for gemm_from in (None, 8):
        entries = tuple(cpu_gemm.Entry("bfloat16", n, k, gemm_from) for n, k in ((1536, 512), (2048, 512),
                                                                                  (512, 1024), (512, 512)))
        monkeypatch.setattr(cpu_gemm, "table", lambda entries=entries: cpu_gemm.Table("test", entries))
        llm = LLM(model_dir, device="cpu", dtype="bfloat16", page_size=4, max_num_seqs=2)
        executor = llm.engine.runner.executor
        layer = llm.engine.model.layers[0].mlp.gate_up_proj
        assert executor.mode == "native" and isinstance(layer, CpuLinear) and layer.gemm_from == gemm_from
        assert executor.max_rows == (NATIVE_MERGED_ROWS if gemm_from is None else 7)
        calls: list[int] = []
        if gemm_from is not None:
            monkeypatch.setattr(cpu_gemm, "linear", lambda *a, calls=calls, gemm=cpu_gemm.linear: (
                calls.append(a[0].shape[0]) or gemm(*a)))
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert (19 in calls) == (gemm_from is not None)  # the first step: 16 + 3 prompt rows, per op
    agree = sum(a == b for x, y in zip(*outs, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.9 * 16
