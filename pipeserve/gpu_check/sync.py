"""gpu-check's one-sync section: the steady-state decode step of the Triton engine with CUDA graphs
does exactly one blocking device-to-host readback (the sampled tokens), with logprobs, min_tokens,
penalties and speculative decoding on: once with n-gram proposals, once with a draft model (whose
proposals stay on the device through verification). torch.cuda.set_sync_debug_mode("warn") warns on
every synchronizing call; the warnings of each step are counted."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from .models import build_tiny_model
from .report import CorrectnessRow
from .runner import Context

WARM_STEPS = 6  # prefills and the first decode steps (buffers, graph capture) are not steady state
COUNTED_STEPS = 24
PROPOSERS = {"ngram": "n-gram", "draft": "draft model"}


def count_syncs(fn: Callable[[], object]) -> int:
    """How many synchronizing CUDA calls fn makes."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def one_sync_row(counts: list[int], proposer: str = "ngram") -> CorrectnessRow:
    """Passes when every counted step synchronized exactly once."""
    ok = bool(counts) and all(c == 1 for c in counts)
    return CorrectnessRow.check(f"one blocking readback per decode step ({PROPOSERS[proposer]})", ok,
                                f"syncs per step: {counts}")


def step_syncs(model_dir: str, device: str, count: Callable[[Callable[[], object]], int] = count_syncs,
               dtype: str = "bfloat16", counted: int = COUNTED_STEPS, proposer: str = "ngram",
               warm: int = WARM_STEPS) -> list[int]:
    """`count` of each steady-state step of 8 requests with every per-step host need switched on:
    half of them with logprobs and penalties (they decode one token a step), half speculating
    (greedy and seeded sampling, verified by matching and by rejection sampling). proposer: ngram,
    or draft (the model as its own draft). warm: the steps run first, not counted."""
    from pipeserve.engine import LLM, SamplingParams

    executor = "compiled" if device == "cuda" else "eager"  # CUDA graphs; the interpreter runs eager
    spec = {"draft_model": model_dir} if proposer == "draft" else {}
    llm = LLM(model_dir, device=device, dtype=dtype, backend="triton", step_executor=executor, page_size=16,
              num_pages=256, speculative_method=proposer, num_speculative_tokens=3,
              speculative_adaptive=False, **spec)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for i in range(8):
        phrase = torch.randint(3, vocab, (5,), generator=g).tolist()
        # Enough tokens that every request runs through the counted steps, even accepting every proposal.
        params = SamplingParams(max_tokens=(warm + counted) * 5, min_tokens=warm + counted,
                                ignore_eos=True, temperature=0.0 if i % 4 == 1 else 0.8, seed=i)
        if i % 2 == 0:
            params = replace(params, logprobs=5, repetition_penalty=1.1, presence_penalty=0.3,
                             frequency_penalty=0.2)
        engine.add(f"sync-{i}", phrase * (2 + i), params)
    for _ in range(warm):
        engine.step()
    return [count(engine.step) for _ in range(counted)]


def run(ctx: Context) -> None:
    if ctx.device != "cuda":
        raise RuntimeError("the sync count needs CUDA (torch.cuda.set_sync_debug_mode)")
    with tempfile.TemporaryDirectory(prefix="gpu-check-sync-") as tmp:
        model_dir = build_tiny_model(f"{tmp}/llama", "llama")
        for proposer in PROPOSERS:
            ctx.row(one_sync_row(step_syncs(model_dir, ctx.device, proposer=proposer), proposer))
