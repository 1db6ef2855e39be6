"""gpu-check's engine parity section, on tiny random Llama, Qwen2 and Mixtral checkpoints built here:

- the reference backend, the Triton kernels eager and the Triton kernels with CUDA graphs give
  identical greedy tokens over 64 steps of a batch of mixed prompt lengths, run with prefill chunks
  (a small token budget per step), prefix-cache hits (the prompts extend one already served) and
  n-gram speculative decoding on;
- the Triton engine's greedy tokens equal Hugging Face transformers' on the same device;
- every quantized mode's teacher-forced top-1 agrees with the unquantized model's (report.AGREEMENT).
All in fp32, so that the comparisons are exact (and the agreements those measured on the CPU)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch

from pipeserve.config import QUANTIZATIONS

from .models import build_tiny_model
from .report import AGREEMENT, CorrectnessRow
from .runner import Context

STEPS = 64
KINDS = ("llama", "qwen2", "mixtral")
# The engines compared: (name, options). The compiled step executor is CUDA graphs on CUDA.
MODES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("reference", {"backend": "reference", "step_executor": "eager"}),
    ("triton eager", {"backend": "triton", "step_executor": "eager"}),
    ("triton cuda graphs", {"backend": "triton", "step_executor": "compiled"}),
)


def prompts(vocab: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A base prompt served first, then a batch of mixed lengths: two extend the base (prefix-cache
    hits), two repeat a phrase (n-gram proposals get accepted), one is fresh."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    base = rand(48)
    phrase = rand(6)
    batch = [base + rand(5), base[:32] + rand(21), phrase * 6, rand(3) + phrase * 3, rand(70)]
    return base, batch


def greedy_tokens(model_dir: str, device: str, steps: int, mode: dict[str, Any],
                  **options: Any) -> tuple[list[list[int]], int]:
    """(tokens of each batch prompt, prompt tokens served from the prefix cache)."""
    from pipeserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, **{"device": device, "dtype": "float32", "page_size": 4, "num_pages": 512,
                            "max_num_batched_tokens": 24, "speculative_method": "ngram",
                            "num_speculative_tokens": 3, "speculative_adaptive": False, **mode, **options})
    base, batch = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate([base], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    outs = llm.generate(batch, params)
    return [o.token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


def hf_greedy(model_dir: str, device: str, steps: int) -> list[list[int]]:
    """transformers' greedy continuation of each batch prompt, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: every prompt runs all its steps
    _, batch = prompts(model.config.vocab_size)
    outs = []
    with torch.inference_mode():
        for ids in batch:
            x = torch.tensor([ids], device=device)
            gen = model.generate(x, max_new_tokens=steps, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(ids):].tolist())
    return outs


def mode_parity(kind: str, model_dir: str, device: str, steps: int) -> list[CorrectnessRow]:
    runs: dict[str, list[list[int]]] = {}
    rows = []
    for name, mode in MODES:
        if mode["step_executor"] == "compiled" and device != "cuda":
            continue  # CUDA graphs need CUDA; the interpreter runs eager
        tokens, cached = greedy_tokens(model_dir, device, steps, mode)
        runs[name] = tokens
        rows.append(CorrectnessRow.check(f"parity {kind} prefix cache hits ({name})", cached > 0,
                                         f"{cached} prompt tokens from the cache"))
    first, want = next(iter(runs.items()))
    for name, tokens in runs.items():
        if name == first:
            continue
        same = tokens == want
        rows.append(CorrectnessRow.check(f"parity {kind} {name} = {first}", same,
                                         "" if same else first_difference(tokens, want)))
    return rows


def first_difference(got: list[list[int]], want: list[list[int]]) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (a, b) in enumerate(zip(g, w, strict=False)):
            if a != b:
                return f"prompt {i} step {j}: {a} != {b}"
        if len(g) != len(w):
            return f"prompt {i}: {len(g)} tokens != {len(w)}"
    return ""


def hf_parity(kind: str, model_dir: str, device: str, steps: int, backend: str) -> CorrectnessRow:
    got, _ = greedy_tokens(model_dir, device, steps, {"backend": backend, "step_executor": "eager"},
                           speculative_method="none")
    want = hf_greedy(model_dir, device, steps)
    same = got == want
    return CorrectnessRow.check(f"parity {kind} {backend} = transformers", same,
                                "" if same else first_difference(got, want))


def quant_agreement(model_dir: str, device: str, method: str, backend: str, dtype: str,
                    steps: int) -> float:
    """Teacher-forced top-1 agreement of `method` with the unquantized model on the unquantized
    model's own greedy continuations."""
    from pipeserve.engine import LLM, SamplingParams
    from pipeserve.engine.model.accuracy import teacher_forced_logits

    def model(quantization: str) -> Any:
        return LLM(model_dir, device=device, dtype=dtype, backend=backend, quantization=quantization,
                   step_executor="eager", num_pages=64).engine.model

    dense = LLM(model_dir, device=device, dtype=dtype, backend=backend, step_executor="eager", num_pages=64)
    _, batch = prompts(dense.engine.model_config.vocab_size)
    outs = dense.generate(batch, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    want = teacher_forced_logits(dense.engine.model, seqs)
    got = teacher_forced_logits(model(method), seqs)
    agree = total = 0
    for g, w in zip(got, want, strict=True):
        agree += int((g.argmax(-1) == w.argmax(-1)).sum())
        total += g.shape[0]
    return agree / total


def run(ctx: Context) -> None:
    steps = STEPS if ctx.device == "cuda" else 4
    with tempfile.TemporaryDirectory(prefix="gpu-check-models-") as tmp:
        for kind in KINDS:
            model_dir = build_tiny_model(f"{tmp}/{kind}", kind)
            for row in guarded(f"parity {kind}", partial(mode_parity, kind, model_dir, ctx.device, steps)):
                ctx.row(row)
            hf = partial(hf_parity, kind, model_dir, ctx.device, steps, "triton")
            for row in guarded(f"parity {kind} transformers", partial(one, hf)):
                ctx.row(row)
        for method in QUANTIZATIONS[1:]:
            for kind in ("llama", "mixtral"):
                name = f"parity {kind} {method} top-1 agreement"

                def agreement(kind: str = kind, method: str = method,
                              name: str = name) -> list[CorrectnessRow]:
                    value = quant_agreement(f"{tmp}/{kind}", ctx.device, method, "triton", "float32", steps)
                    return [CorrectnessRow.measured(name, 1 - value, 1 - AGREEMENT[method],
                                                    f"agreement {value:.3f} (at least {AGREEMENT[method]})")]

                for row in guarded(name, agreement):
                    ctx.row(row)


def one(fn: Callable[[], CorrectnessRow]) -> list[CorrectnessRow]:
    return [fn()]


def guarded(name: str, fn: Callable[[], Iterable[CorrectnessRow]]) -> list[CorrectnessRow]:
    """fn's rows, or one failed row with the exception's reason (the next check still runs)."""
    try:
        return list(fn())
    except Exception as exc:
        return [CorrectnessRow(name, False, None, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])]
