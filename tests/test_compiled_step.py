"""Compiled decode steps (pipeserve/engine/executor/: padded.py, inductor.py, cuda_graph.py): buckets,
padding onto the scratch page, and greedy outputs token-identical to eager steps on stories260K and on
every architecture the parity tests cover (the compiling tests are marked slow: Inductor builds C++).

Dense fp32 models would take the native step under `auto` (tests/test_native_step.py covers it):
these tests ask for `step_executor="compiled"`, so that Inductor's step is what they compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.executor import FlatBatch, StepBuffers
from pipeserve.engine.executor.cuda_graph import CudaGraphStep
from pipeserve.engine.executor.inductor import InductorStep
from pipeserve.engine.executor.padded import batch_buckets
from pipeserve.engine.kv.pool import KVPool
from pipeserve.model_config import ModelConfig
from tests.test_engine_parity import STORY_PROMPTS


def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(256)[-3:] == (64, 128, 256)


def padded(kind: type, pool: KVPool, max_rows: int, **options) -> InductorStep | CudaGraphStep:
    """A padded executor without a model (bucket and padding logic only)."""
    buffers = StepBuffers(shapes={}, device=torch.device("cpu"))
    return kind(model=None, pool=pool, buffers=buffers, max_rows=max_rows, **options)


def test_inductor_buckets_stop_at_its_largest_batch():
    assert padded(InductorStep, tiny_pool(), 256).buckets == (1, 2, 4, 8, 16, 32, 64)
    assert padded(InductorStep, tiny_pool(), 6).buckets == (1, 2, 4, 6)
    assert padded(InductorStep, tiny_pool(), 4, exact=(2, 3)).buckets == (1, 2, 3, 4)


def test_cuda_graph_buckets_stop_at_max_cuda_graph_batch():
    """Every batch size up to --max-cuda-graph-batch has a bucket (captured at start); larger steps,
    and steps of prefill rows, are not covered: they run eager."""
    graphs = padded(CudaGraphStep, tiny_pool(), 1280, max_batch=256)
    assert graphs.buckets[-1] == 256 and graphs.max_rows == 256
    assert padded(CudaGraphStep, tiny_pool(), 12, max_batch=256).buckets == (1, 2, 4, 8, 12)
    assert padded(CudaGraphStep, tiny_pool(), 12, max_batch=4).buckets == (1, 2, 4)
    assert graphs.full_width  # a captured graph's tables span the block table


def tiny_pool(num_pages: int = 6, page_size: int = 4) -> KVPool:
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 16,
                                 "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "num_key_value_heads": 1, "vocab_size": 32, "max_position_embeddings": 32})
    return KVPool(cfg=cfg, num_pages=num_pages, page_size=page_size, dtype=torch.float32,
                  device=torch.device("cpu"), max_num_seqs=4, max_model_len=32)


def test_padding_rows_only_touch_the_scratch_page():
    pool = tiny_pool()
    compiled = padded(InductorStep, pool, 4)
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
    assert compiled.covers(decode_rows(3, 3)) and not compiled.covers(decode_rows(3, 5))
    assert not compiled.covers(decode_rows(5, 5))


def decode_rows(num_decode: int, num_rows: int) -> FlatBatch:
    """A flat batch of num_rows rows, num_decode of them decode rows (only the counts matter)."""
    rows = np.zeros(num_rows, np.int64)
    return FlatBatch(input_ids=rows, positions=rows, slot_mapping=rows, row_slots=rows, num_decode=num_decode,
                     decode_slots=rows[:num_decode], prefill_slots=rows[:0], prefill_cu_q_lens=rows[:1],
                     prefill_seq_lens=rows[:0], sample_rows=rows, sample_slots=rows, sample_seq_lens=rows)


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
    llm = LLM(stories_dir, device="cpu", dtype="float32", step_executor="compiled", max_num_seqs=4)
    runner = llm.engine.runner
    assert isinstance(runner.executor, InductorStep)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths])
    assert [o.token_ids for o in outs] == eager
    assert set(runner.executor._steps) == {1, 2, 4}
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
    assert greedy(model_dir, prompts, [12, 12], step_executor="compiled", **options) == expected
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
    assert greedy(model_dir, prompts, [10, 10], step_executor="compiled", **options) == expected
    assert compiled_graphs() > before


def count_compiled_verifications(llm: LLM) -> dict[str, int]:
    """Counts, as the engine runs, steps with verification rows that ran compiled and eager."""
    runner = llm.engine.runner
    executor, eager = runner.executor, runner.eager
    counts = {"compiled": 0, "eager": 0}

    def counted(step, name: str):
        def run(flat):
            if flat.num_verify_rows:
                counts[name] += 1
            return step(flat)
        return run

    executor.run, eager.run = counted(executor.run, "compiled"), counted(eager.run, "eager")
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stories_verification_steps_compiled_equal_eager(stories_dir, method, monkeypatch):
    """Verification rows run as compiled decode rows when the step's rows fit a bucket (one request
    verifying 1 + 4 rows: bucket 5) and eager otherwise (two requests: 10 rows, past a top bucket
    of 8 here); the greedy tokens are a plain eager engine's."""
    monkeypatch.setattr("pipeserve.engine.executor.inductor.MAX_INDUCTOR_BATCH", 8)
    prompts = ["Once upon a time, there was a little girl. Once upon a time, there",
               "Lily and Ben went to the park. They saw a dog. Lily and Ben went to"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 30)]
    base = LLM(stories_dir, device="cpu", dtype="float32", compile=False)
    want = [o.token_ids for o in base.generate(prompts, params)]
    draft = dict(draft_model=stories_dir) if method == "draft" else dict(prompt_lookup_min=1)
    llm = LLM(stories_dir, device="cpu", dtype="float32", step_executor="compiled", max_num_seqs=2,
              speculative_method=method, speculative_adaptive=False, **draft)
    assert isinstance(llm.engine.runner.executor, InductorStep)
    assert llm.engine.runner.executor.buckets == (1, 2, 3, 4, 5, 8)
    counts = count_compiled_verifications(llm)
    drafted = count_draft_rounds(llm) if method == "draft" else None
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.stats()["spec_accepted_tokens"] > 0
    assert counts["compiled"] > 0 and counts["eager"] > 0
    assert drafted is None or drafted["rows"] > 0  # the draft's own rounds ran compiled


def count_draft_rounds(llm: LLM) -> dict[str, int]:
    """Counts the draft model's rows that ran through its own compiled decode steps."""
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.draft is not None
    executor = speculator.draft.runner.executor
    assert executor.mode != "eager" and executor is not llm.engine.runner.executor
    counts, run = {"rows": 0}, executor.run

    def counted(flat):
        counts["rows"] += flat.num_rows
        return run(flat)

    executor.run = counted
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
    llm = LLM(model_dir, device="cpu", dtype="float32", step_executor="compiled", speculative_method=method,
              speculative_adaptive=False, num_speculative_tokens=3, **spec, **options)
    counts = count_compiled_verifications(llm)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=16, temperature=0.0)] * 2)
    assert [o.token_ids for o in outs] == expected
    assert counts["compiled"] > 0 and counts["eager"] == 0
    assert llm.engine.stats()["pages_used"] == 0


class FakeGraph:
    def __init__(self, log: list[str], size: int) -> None:
        self.log, self.size = log, size

    def replay(self) -> None:
        self.log.append(f"replay {self.size}")


def test_cuda_graphs_capture_every_bucket_before_serving_largest_first(monkeypatch):
    """prepare() captures each bucket once, largest first, all into one pool; steps then only
    replay, and a bucket missing at that point is an error, not a capture while serving."""
    pool = tiny_pool(num_pages=12)
    shapes = {"input_ids": (torch.int64, (8,)), "positions": (torch.int64, (8,)),
              "slot_mapping": (torch.int64, (8,)),
              "decode_block_tables": (torch.int32, (8, pool.max_pages_per_seq)),
              "decode_seq_lens": (torch.int32, (8,))}
    buffers = StepBuffers(shapes=shapes, device=torch.device("cpu"))
    log: list[str] = []
    handles = iter(["the pool"])
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    class Recorded(CudaGraphStep):
        def _capture(self, args):
            log.append(f"capture {args[0].shape[0]} into {self._pool}")
            return FakeGraph(log, args[0].shape[0]), torch.zeros(args[0].shape[0], 32)

    graphs = Recorded(model=None, pool=pool, buffers=buffers, max_rows=8, max_batch=4, exact=(3,))
    graphs.prepare()
    assert [e for e in log if e.startswith("capture")] == [f"capture {n} into the pool" for n in (4, 3, 2, 1)]
    log.clear()
    rows = np.zeros(3, np.int64)
    flat = FlatBatch(input_ids=rows, positions=rows, slot_mapping=rows, row_slots=rows, num_decode=3,
                     decode_slots=rows, prefill_slots=rows[:0], prefill_cu_q_lens=rows[:1],
                     prefill_seq_lens=rows[:0], sample_rows=np.arange(3), sample_slots=rows,
                     sample_seq_lens=rows + 1)
    logits = graphs.run(flat)
    assert log == ["replay 3"] and logits is not None and logits.shape == (3, 32)
    assert not graphs.covers(decode_rows(5, 5))  # above --max-cuda-graph-batch: eager
    graphs._graphs.pop(2)
    with pytest.raises(AssertionError, match="not captured"):
        graphs.run(decode_rows(2, 2))
