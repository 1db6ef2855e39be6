"""Compiled decode steps (pipeserve/engine/compiled_step.py): buckets, padding onto the scratch page,
when the compiler is chosen, and greedy outputs token-identical to eager steps on stories260K and on
every architecture the parity tests cover (the compiling tests are marked slow: Inductor builds C++).

Dense fp32 models would take the native step here (tests/test_native_step.py covers it): these tests
switch it off, so that Inductor's step is what they compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.compiled_step import CompiledDecode, batch_buckets, compile_mode
from pipeserve.engine.kv.pool import KVPool
from pipeserve.model_config import ModelConfig
from tests.test_engine_parity import STORY_PROMPTS


@pytest.fixture(autouse=True)
def inductor_steps(monkeypatch):
    monkeypatch.setenv("PIPESERVE_NATIVE_STEP", "0")


def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(256)[-3:] == (64, 128, 256)


def test_inductor_buckets_stop_at_its_largest_batch():
    pool = tiny_pool()
    assert CompiledDecode(None, pool, 256, "inductor").buckets == (1, 2, 4, 8, 16, 32, 64)  # type: ignore[arg-type]
    assert CompiledDecode(None, pool, 256, "cuda-graph").buckets[-1] == 256  # type: ignore[arg-type]
    assert CompiledDecode(None, pool, 6, "inductor").buckets == (1, 2, 4, 6)  # type: ignore[arg-type]


def test_compile_mode_by_backend_and_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_mode(True, "cpu", cpu) == "inductor"
    assert compile_mode(True, "torch", cpu) == "inductor"
    assert compile_mode(True, "triton", cuda) == "cuda-graph"
    assert compile_mode(True, "cpu", cuda) is None  # its host-side memos cannot be captured
    assert compile_mode(True, "triton", cpu) is None  # the Triton interpreter
    assert compile_mode(True, "reference", cpu) is None  # the oracle stays eager
    assert compile_mode(False, "cpu", cpu) is None


def test_no_cpp_compiler_means_eager_steps(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert compile_mode(True, "cpu", torch.device("cpu")) is None


def test_compile_defaults_on_and_follows_the_env(monkeypatch):
    monkeypatch.delenv("PIPESERVE_COMPILE")
    assert EngineConfig().compile is True
    monkeypatch.setenv("PIPESERVE_COMPILE", "0")
    assert EngineConfig().compile is False
    assert EngineConfig(compile=True).compile is True


def tiny_pool(num_pages: int = 6, page_size: int = 4) -> KVPool:
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 16,
                                 "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "num_key_value_heads": 1, "vocab_size": 32, "max_position_embeddings": 32})
    return KVPool(cfg, num_pages, page_size, torch.float32, torch.device("cpu"), 4, 32)


def test_padding_rows_only_touch_the_scratch_page():
    pool = tiny_pool()
    compiled = CompiledDecode(None, pool, max_rows=4, mode="inductor")  # type: ignore[arg-type]
    assert pool.num_pages == 5 and pool.stats().pages_used == 0  # the scratch page is out of circulation
    scratch = compiled.scratch_page
    assert scratch not in pool._free
    tables = np.zeros((3, 8), np.int32)
    tables[0, :2], tables[1, 0], tables[2, :2] = [1, 2], 3, [4, 5]
    ids, pos, slots, table, lens = compiled.pad(
        np.array([7, 8, 9]), np.array([5, 2, 6]), np.array([9, 14, 18]), tables
    )
    assert ids.tolist() == [7, 8, 9, 0] and pos.tolist() == [5, 2, 6, 0]
    assert slots.tolist() == [9, 14, 18, scratch * 4]  # the padded row writes the scratch page
    assert lens.tolist() == [6, 3, 7, 1]
    assert table.shape == (4, 2)  # gather width: the longest row's pages, no more
    assert table[:3].tolist() == tables[:, :2].tolist() and (table[3] == scratch).all()
    assert compiled.covers(3, 3) and not compiled.covers(3, 5) and not compiled.covers(5, 5)


def greedy(model_dir: str, prompts: list[list[int]], max_tokens: list[int], **options) -> list[list[int]]:
    llm = LLM(model_dir, device="cpu", dtype="float32", **options)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["pages_used"] == 0
    return [o.token_ids for o in outs]


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (a silent fall back to eager adds none)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_stories_compiled_equals_eager_across_buckets(stories_dir):
    """Three requests ending at different steps: decode batches of 3 rows (padded to bucket 4),
    then 2 (bucket 2), beside eager steps while prompts are prefilled; bucket 1 compiled at start."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    prompts = [tok(p).input_ids for p in STORY_PROMPTS[:3]]
    lengths = [8, 20, 20]
    eager = greedy(stories_dir, prompts, lengths, compile=False)
    before = compiled_graphs()
    llm = LLM(stories_dir, device="cpu", dtype="float32", compile=True, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.compiled is not None
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths])
    assert [o.token_ids for o in outs] == eager
    assert set(runner.compiled._steps) == {1, 2, 4}
    assert compiled_graphs() >= before + 3


ARCHITECTURES = [
    ("llama", {}),
    ("llama", dict(num_key_value_heads=1)),
    ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    ("qwen2", {}),
    ("mistral", dict(sliding_window=6)),
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen3_moe", {}),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,overrides", ARCHITECTURES,
    ids=["llama-gqa", "llama-mqa", "llama-tied", "llama3-rope", "qwen2-bias", "mistral-window", "mixtral",
         "qwen2-moe", "qwen3-moe"],
)
def test_every_architecture_compiled_equals_eager(tiny_model, kind, overrides):
    """One bucket (max_num_seqs=1) per model keeps it to one compile: the architecture's own code
    (biases, windows, rope scaling, experts, q/k norms) under the compiler, long enough to cross pages."""
    model_dir = tiny_model(kind, **overrides)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 11)]
    options = dict(page_size=4, max_num_seqs=1)
    expected = greedy(model_dir, prompts, [12, 12], compile=False, **options)
    before = compiled_graphs()
    assert greedy(model_dir, prompts, [12, 12], compile=True, **options) == expected
    assert compiled_graphs() > before  # compiled, not fallen back to eager


@pytest.mark.slow
def test_quantized_compiled_equals_eager(tiny_model):
    """W8A8 int8 GEMMs over an int8 KV cache (scales written and read through the same ops)."""
    model_dir = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (6, 9)]
    options = dict(page_size=4, max_num_seqs=2, quantization="w8a8-int8", kv_cache_dtype="int8")
    expected = greedy(model_dir, prompts, [10, 10], compile=False, **options)
    before = compiled_graphs()
    assert greedy(model_dir, prompts, [10, 10], compile=True, **options) == expected
    assert compiled_graphs() > before


def count_compiled_verifications(llm: LLM) -> dict[str, int]:
    """Counts, as the engine runs, steps with verification rows that ran compiled and eager."""
    runner = llm.engine.runner
    assert runner.compiled is not None
    counts = {"compiled": 0, "eager": 0}
    forward, run = runner.forward, runner.compiled.run
    state = {"verify": False, "compiled": False}

    def counted_run(*args, **kwargs):
        state["compiled"] = True
        return run(*args, **kwargs)

    def counted_forward(batch):
        state["compiled"] = False
        out = forward(batch)
        if batch.verify:
            counts["compiled" if state["compiled"] else "eager"] += 1
        return out

    runner.forward, runner.compiled.run = counted_forward, counted_run
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stories_verification_steps_compiled_equal_eager(stories_dir, method, monkeypatch):
    """Verification rows run as compiled decode rows when the step's rows fit a bucket (one request
    verifying 1 + 4 rows: bucket 5) and eager otherwise (two requests: 10 rows, past a top bucket
    of 8 here); the greedy tokens are a plain eager engine's."""
    monkeypatch.setattr("pipeserve.engine.compiled_step.MAX_INDUCTOR_BATCH", 8)
    prompts = ["Once upon a time, there was a little girl. Once upon a time, there",
               "Lily and Ben went to the park. They saw a dog. Lily and Ben went to"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 30)]
    base = LLM(stories_dir, device="cpu", dtype="float32", compile=False)
    want = [o.token_ids for o in base.generate(prompts, params)]
    draft = dict(draft_model=stories_dir) if method == "draft" else dict(prompt_lookup_min=1)
    llm = LLM(stories_dir, device="cpu", dtype="float32", compile=True, max_num_seqs=2,
              speculative_method=method, speculative_adaptive=False, **draft)
    assert llm.engine.runner.compiled is not None and llm.engine.runner.compiled.buckets == (1, 2, 3, 4, 5, 8)
    counts = count_compiled_verifications(llm)
    drafted = count_draft_rounds(llm) if method == "draft" else None
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.stats()["spec_accepted_tokens"] > 0
    assert counts["compiled"] > 0 and counts["eager"] > 0
    assert drafted is None or drafted["rows"] > 0  # the draft's own rounds ran compiled


def count_draft_rounds(llm: LLM) -> dict[str, int]:
    """Counts the draft model's rows that ran through its compiled decode steps."""
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.draft is not None
    compiled = speculator.draft.runner.compiled
    assert compiled is not None and compiled is not llm.engine.runner.compiled
    counts, run = {"rows": 0}, compiled.run

    def counted(input_ids, *args):
        counts["rows"] += input_ids.shape[0]
        return run(input_ids, *args)

    compiled.run = counted
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("kind,overrides,method", [
    ("llama", {}, "ngram"),
    ("llama", {}, "draft"),
    ("mistral", dict(sliding_window=6), "ngram"),
], ids=["llama-ngram", "llama-draft", "mistral-window-ngram"])
def test_tiny_verification_steps_compiled_equal_eager(tiny_model, kind, overrides, method):
    """Batch 1 (max_num_seqs=1, k=3: buckets 1, 2, 4): every verification step runs compiled, its
    rows crossing pages (and the sliding window) at their own positions."""
    model_dir = tiny_model(kind, **overrides)
    prompts = [[5, 17, 99, 3, 42, 5, 17, 99, 3, 42, 5, 17], [7, 8, 9, 7, 8, 9, 7]]
    options = dict(page_size=4, max_num_seqs=1)
    expected = greedy(model_dir, prompts, [16, 16], compile=False, **options)
    spec = dict(prompt_lookup_min=1) if method == "ngram" else dict(draft_model=model_dir)
    llm = LLM(model_dir, device="cpu", dtype="float32", compile=True, speculative_method=method,
              speculative_adaptive=False, num_speculative_tokens=3, **spec, **options)
    counts = count_compiled_verifications(llm)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=16, temperature=0.0)] * 2)
    assert [o.token_ids for o in outs] == expected
    assert counts["compiled"] > 0 and counts["eager"] == 0
    assert llm.engine.stats()["pages_used"] == 0
