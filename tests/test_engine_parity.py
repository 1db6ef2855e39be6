"""Greedy parity with HF transformers `generate`, token for token in fp32, through every engine path:
batching of mixed lengths, chunked prefill, page sizes, preemption, sliding windows, biases. The engine runs
on $PIPESERVE_TEST_DEVICE, the transformers reference on the CPU."""

from __future__ import annotations

import pytest
import torch

from pipeserve.engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE

pytestmark = pytest.mark.device

STORY_PROMPTS = [
    "Once upon a time",
    "The cat sat on the mat and",
    "Lily and Tom went to the park to play with a ball",
    "One day",
    "Tim had a red car. He",
]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    with torch.device("cpu"):
        return _hf_greedy(model_dir, prompts, max_new)


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    eos = hf.generation_config.eos_token_id
    outs = []
    for ids in prompts:
        gen = hf.generate(
            torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=0, eos_token_id=eos
        )[0, len(ids) :].tolist()
        outs.append(gen)
    return outs


def run_llm(model_dir: str, prompts: list[list[int]], max_new: int, **options) -> list[list[int]]:
    llm = LLM(model_dir, **{"device": TEST_DEVICE, "dtype": "float32", **options})
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0))
    assert llm.engine.stats()["pages_used"] == 0
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def story_case(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    prompts = [tok(p).input_ids for p in STORY_PROMPTS]
    return stories_dir, prompts, hf_greedy(stories_dir, prompts, 24)


@pytest.mark.parametrize(
    "options",
    [
        dict(page_size=16),
        dict(page_size=1, max_num_batched_tokens=1),
        dict(page_size=4, max_num_batched_tokens=4),
        dict(page_size=16, max_num_batched_tokens=16, max_num_seqs=3),
    ],
    ids=["batch", "chunk1-page1", "chunk4", "chunk16-seqs3"],
)
def test_stories_greedy_matches_hf(story_case, options):
    model_dir, prompts, expected = story_case
    assert run_llm(model_dir, prompts, 24, **options) == expected


def test_stories_text_is_the_known_continuation(stories_dir):
    llm = LLM(stories_dir, device=TEST_DEVICE)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert out.text.startswith(", there was a little girl named Lily. She loved to play outside in the park.")
    assert out.finish_reason == "length"


@pytest.mark.parametrize("policy", ["optimistic", "max"])
def test_preemption_keeps_tokens_identical(story_case, policy):
    model_dir, prompts, expected = story_case
    # 14 pages of 4 tokens cannot hold five ~35-token requests at once: the engine must preempt.
    llm = LLM(model_dir, device=TEST_DEVICE, dtype="float32", page_size=4, num_pages=14, admission=policy)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats["pages_used"] == 0 and stats["pages_reserved"] == 0
    if policy == "optimistic":
        assert stats["preemptions"] > 0


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("llama", {}),
        ("llama", dict(num_key_value_heads=1)),  # MQA
        ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),  # MHA, tied
        (
            "llama",
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            ),
        ),
        ("qwen2", {}),
        ("mistral", dict(sliding_window=6)),
    ],
    ids=["llama-gqa", "llama-mqa", "llama-tied", "llama3-rope", "qwen2-bias", "mistral-window"],
)
def test_random_models_match_hf(tiny_model, kind, overrides):
    model_dir = tiny_model(kind, **overrides)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g, device="cpu").tolist() for n in (5, 17, 1, 11)]
    expected = hf_greedy(model_dir, prompts, 12)
    assert run_llm(model_dir, prompts, 12, page_size=4, max_num_batched_tokens=8) == expected


def test_top_logprobs_match_hf(stories_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    ids = tok("Once upon a time").input_ids
    llm = LLM(stories_dir, device=TEST_DEVICE, dtype="float32")
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, logprobs=5))[0]
    with torch.device("cpu"), torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
        logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert abs(entry["logprob"] - ref[step, token].item()) < 1e-4
        top_vals, top_ids = ref[step].topk(5)
        assert list(entry["top"]) == top_ids.tolist()
        assert max(abs(a - b) for a, b in zip(entry["top"].values(), top_vals.tolist(), strict=True)) < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(stories_dir, dtype):
    llm = LLM(stories_dir, device=TEST_DEVICE, dtype=dtype, step_executor="eager")
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert len(out.token_ids) == 12 and out.text.startswith(", there was")
