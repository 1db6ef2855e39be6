"""Prefix caching is exact: with the cache warm, greedy tokens equal a cold engine's (prefix caching
off) and logprobs agree within 1e-5 in fp32, for every supported architecture, prompts sharing 0, 1,
many and all of their full pages mixed with non-sharing ones in one step, chunk sizes 1/4/16,
preemption and eviction pressure, the int8/fp8 KV caches, and the Triton kernels (interpreter)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeserve.engine import LLM, SamplingParams
from tests.conftest import TEST_DEVICE

PAGE = 4
MAX_NEW = 6


def prompts_sharing(base: list[int], fresh: list[list[int]]) -> list[list[int]]:
    """Prompts that share 0, 1, many and all of base's full pages, mixed with unrelated ones."""
    return [
        fresh[0],  # 0 pages
        base[:PAGE] + fresh[1][:7],  # 1 page
        fresh[2],
        base[: 6 * PAGE] + fresh[3][:3],  # many
        base,  # all of them (its last token is still computed)
        base + fresh[4][:5],  # all, and more
    ]


def case(vocab: int, seed: int = 1) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, vocab, (8 * PAGE + 2,), generator=g, device="cpu").tolist()
    fresh = [torch.randint(3, vocab, (n,), generator=g, device="cpu").tolist() for n in (9, 7, 13, 3, 5)]
    return base, fresh


def generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=1))


def cold_and_warm(model_dir: str, base: list[int], prompts: list[list[int]], tol: float = 1e-5,
                  between: list[list[int]] | None = None, **options: Any) -> tuple[LLM, list[Any]]:
    """Run `prompts` on a cold engine and on one whose cache holds `base` (and then ran `between`);
    assert they agree. Returns the warm engine and its outputs."""
    options = dict(device="cpu", dtype="float32", page_size=PAGE) | options
    cold = generate(LLM(model_dir, prefix_caching=False, **options), prompts)
    llm = LLM(model_dir, **options)
    generate(llm, [base])
    if between:
        generate(llm, between)
    warm = generate(llm, prompts)
    for c, w in zip(cold, warm, strict=True):
        assert w.token_ids == c.token_ids
        diff = max(abs(a["logprob"] - b["logprob"]) for a, b in zip(c.logprobs, w.logprobs, strict=True))
        assert diff <= tol, diff
    stats = llm.engine.stats()
    assert stats["pages_used"] == 0 and stats["pages_reserved"] == 0
    return llm, warm


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("mistral", dict(sliding_window=6)),
    ],
    ids=["llama", "qwen2-bias", "mistral-window"],
)
# Chunks of 1 and 4 tokens take many steps: slow (make test-fast runs 16).
@pytest.mark.parametrize(
    "chunk", [pytest.param(1, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow), 16]
)
def test_warm_equals_cold_on_every_architecture_and_chunk_size(tiny_model, kind, overrides, chunk):
    model_dir = tiny_model(kind, **overrides)
    base, fresh = case(320)
    prompts = prompts_sharing(base, fresh)
    llm, warm = cold_and_warm(model_dir, base, prompts, max_num_batched_tokens=chunk)
    # Cached tokens: whole pages only, never a prompt's last token.
    assert [o.num_cached_tokens for o in warm] == [0, PAGE, 0, 6 * PAGE, 8 * PAGE, 8 * PAGE]
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] == sum(o.num_cached_tokens for o in warm)
    assert stats["prefix_cache_queries"] == len(base) + sum(len(p) for p in prompts)


def test_warm_equals_cold_on_stories260k(stories_dir):
    base, fresh = case(512, seed=3)
    cold_and_warm(stories_dir, base, prompts_sharing(base, fresh), max_num_batched_tokens=16)


def test_warm_equals_cold_under_preemption_and_eviction(tiny_model):
    model_dir = tiny_model("llama")
    base, fresh = case(320, seed=5)
    prompts = prompts_sharing(base, fresh)
    # 24 pages of 4: the six prompts (~28 tokens each) cannot all run at once, and what is cached
    # is evicted as they grow.
    llm, _ = cold_and_warm(model_dir, base, prompts, num_pages=24, max_num_batched_tokens=16)
    assert llm.engine.stats()["preemptions"] > 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_warm_equals_cold_with_quantized_kv(tiny_model, kv_cache_dtype):
    model_dir = tiny_model("llama")
    base, fresh = case(320, seed=7)
    # The stored keys depend on the mean key of the request's first prefill chunk: pages are shared
    # only where that chunk is the same (here, the same prompt resubmitted), so warm equals cold.
    prompts = [base, fresh[0], base[: 6 * PAGE] + fresh[3]]
    # Other requests run in between, in the request slot base had: its pages keep their own mean.
    llm, warm = cold_and_warm(model_dir, base, prompts, between=[fresh[1], fresh[2]],
                              kv_cache_dtype=kv_cache_dtype, step_executor="eager")
    assert [o.num_cached_tokens for o in warm] == [8 * PAGE, 0, 0]


@pytest.mark.slow
@pytest.mark.device
def test_warm_equals_cold_on_the_triton_kernels(tiny_model):
    pytest.importorskip("triton")
    model_dir = tiny_model("llama")
    base, fresh = case(320, seed=9)
    prompts = [base, fresh[0], base[: 2 * PAGE] + fresh[1]]
    cold_and_warm(model_dir, base, prompts, tol=1e-4, backend="triton", max_num_batched_tokens=16,
                  device=TEST_DEVICE)


def test_cache_salt_isolates_tenants(tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", page_size=PAGE)
    base, _ = case(320)
    generate_salted = lambda salt: llm.generate(  # noqa: E731
        [base], SamplingParams(max_tokens=2, temperature=0.0), cache_salt=salt)[0]
    assert generate_salted("a").num_cached_tokens == 0
    assert generate_salted("b").num_cached_tokens == 0
    assert generate_salted("a").num_cached_tokens == 8 * PAGE
    assert generate_salted("").num_cached_tokens == 0


def test_prefix_caching_off_never_hits(tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", page_size=PAGE, prefix_caching=False)
    base, _ = case(320)
    outs = llm.generate([base, base], SamplingParams(max_tokens=2, temperature=0.0))
    outs += llm.generate([base], SamplingParams(max_tokens=2, temperature=0.0))
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] == stats["prefix_cache_queries"] == 0 and stats["pages_cached"] == 0
