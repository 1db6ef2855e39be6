"""gpu-check's speed section: what later tuning is measured by. Full-size shapes with random bf16
weights drawn on the GPU (no checkpoint):

- decode_b1_llama1b / decode_b1_llama8b: batch-1 decode ms/token of the Triton engine with CUDA
  graphs, and its % of the floor (every weight byte read once per token at the measured copy rate);
- decode attention GB/s at batch 64 x 2,048 context with bf16, int8 and fp8 KV (% of copy rate);
- W8A8 int8 / fp8 and W4A16 GEMMs at a decode (M=1) and a prefill (M=2048) shape, in microseconds,
  with torch.matmul bf16's time and the speedup over it in the detail;
- decode tokens/s at batch 64 and 256 (Llama-3.2-1B shape), and at batch 256 with 1,024 tokens of
  context (Llama-3-8B shape) with its % of that step's floor (weights and the whole KV read once);
- CUDA-graph capture time of every batch bucket up to 256 (the engine's start with graphs minus
  without), for both shapes;
- `pipeserve up` to SERVING for the 8B shape (random weights, the Triton cache warm from the rows
  before it)."""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .environment import timed
from .models import write_shape_config
from .report import SpeedRow
from .runner import Context, run_parts

BF16 = torch.bfloat16


def pct(floor: float | None, measured: float) -> float | None:
    """floor / measured as a percentage (how close to the floor), None without a floor."""
    return None if floor is None or measured <= 0 else round(100.0 * floor / measured, 1)


def weight_bytes(model: Any) -> int:
    """Bytes a decode step reads: every weight once, but only one row of an untied embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    tied = getattr(model, "lm_head", None) is None  # the embedding is the LM head, read whole
    return int(total if tied else total - (embed.numel() - embed.shape[1]) * embed.element_size())


# Per shape: the KV cache in GB (the 8B's holds 256 x 1,100 tokens at 128 KiB each) and the tokens
# of context of the large-batch row (None: no such row).
KV_GB = {"llama1b": 8.0, "llama8b": 38.0}
LONG_CONTEXT = 1024


def engine(model_dir: str, graphs: bool, max_num_seqs: int, kv_cache_gb: float = 8.0) -> Any:
    from pipeserve.engine import LLM

    # Random weights drawn on the device: the directory holds only config.json and a tokenizer.
    return LLM(model_dir, device="cuda", dtype="bfloat16", backend="triton", load_format="dummy",
               step_executor="compiled" if graphs else "eager", max_num_batched_tokens=8192,
               max_num_seqs=max_num_seqs, max_model_len=4096, kv_cache_gb=kv_cache_gb).engine


def steady_decode(eng: Any, batch: int, prompt_len: int = 32, warm: int = 8,
                  steps: int = 64) -> Callable[[], None]:
    """Add `batch` requests with room for `warm + steps` more tokens, run their prefills and `warm`
    decode steps: the engine is in steady decode. Returns the device's sync (a no-op on the CPU)."""
    from pipeserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    vocab = eng.model_config.vocab_size
    for i in range(batch):
        ids = torch.randint(3, vocab, (prompt_len,), generator=g, device="cpu").tolist()
        eng.add(f"speed-{batch}-{i}", ids, SamplingParams(max_tokens=warm + steps + 4, temperature=0.0,
                                                          ignore_eos=True))
    while eng.scheduler.waiting or any(seq.num_output == 0 for seq in eng.scheduler.running):
        eng.step()  # the prefills
    for _ in range(warm):
        eng.step()
    sync: Callable[[], None] = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    return sync


def step_seconds(eng: Any, steps: int, sync: Callable[[], None]) -> float:
    """Seconds per step over `steps` steps, the device synced at both ends."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    return (time.perf_counter() - start) / steps


def drain(eng: Any) -> None:
    while eng.has_work():
        eng.step()


def decode_seconds(eng: Any, batch: int, prompt_len: int = 32, warm: int = 8, steps: int = 64) -> float:
    """Seconds per steady-state decode step of `batch` requests: timed after every prompt is in and
    `warm` decode steps more."""
    sync = steady_decode(eng, batch, prompt_len, warm, steps)
    elapsed = step_seconds(eng, steps, sync)
    drain(eng)
    return elapsed


def free_device() -> None:
    """Give an engine's device memory back before the next one (its objects may hold cycles)."""
    gc.collect()
    torch.cuda.empty_cache()


def kv_bytes_per_token(eng: Any) -> int:
    cfg = eng.model_config
    return int(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2)  # K and V, bf16


def decode_rows(ctx: Context, tmp: str, copy_gbps: float | None) -> None:
    for shape in ("llama1b", "llama8b"):
        model_dir = write_shape_config(f"{tmp}/{shape}", shape)
        start = time.perf_counter()
        eng = engine(model_dir, False, 256, KV_GB[shape])
        eager_start = time.perf_counter() - start
        del eng
        free_device()
        start = time.perf_counter()
        eng = engine(model_dir, True, 256, KV_GB[shape])
        graph_start = time.perf_counter() - start
        capture = eng.runner.executor.capture_seconds
        ctx.row(SpeedRow(f"cuda_graph_capture_{shape}", round(capture, 2), "s",
                         detail=f"every bucket up to 256; engine start with graphs {graph_start:.1f} s, "
                                f"eager {eager_start:.1f} s (the first start compiles the kernels)"))
        nbytes = weight_bytes(eng.model)
        floor_ms = None if copy_gbps is None else nbytes / (copy_gbps * 1e9) * 1e3
        ms = decode_seconds(eng, 1) * 1e3
        ctx.row(SpeedRow(f"decode_b1_{shape}", round(ms, 3), "ms/token", pct(floor_ms, ms),
                         f"{nbytes / 1e9:.2f} GB of weights; floor {floor_ms and round(floor_ms, 3)} ms"))
        if shape == "llama1b":
            for batch in (64, 256):
                tok_s = batch / decode_seconds(eng, batch)
                ctx.row(SpeedRow(f"decode_b{batch}_{shape}", round(tok_s, 1), "tokens/s"))
        else:
            batch, steps = 256, 32
            sec = decode_seconds(eng, batch, prompt_len=LONG_CONTEXT, warm=4, steps=steps)
            # The step's floor: every weight byte and the KV of every row (at its mean context) read once.
            kv = batch * (LONG_CONTEXT + 4 + steps / 2) * kv_bytes_per_token(eng)
            floor = None if copy_gbps is None else (nbytes + kv) / (copy_gbps * 1e9)
            ctx.row(SpeedRow(f"decode_b{batch}_ctx{LONG_CONTEXT}_{shape}", round(batch / sec, 1),
                             "tokens/s", pct(floor, sec),
                             f"{sec * 1e3:.2f} ms/step; {(nbytes + kv) / 1e9:.1f} GB a step"))
        del eng
        free_device()


def serving_start_row(ctx: Context, tmp: str) -> None:
    """`pipeserve up` to SERVING for the 8B shape, random weights (the Triton cache warm by now)."""
    from pipeserve.local_cluster import LocalCluster

    model_dir = write_shape_config(f"{tmp}/llama8b", "llama8b")
    start = time.perf_counter()
    with LocalCluster(Path(tmp) / "serve-8b.log", model_dir, "--load-format", "dummy", "--dtype", "bfloat16",
                      "--kv-cache-gb", "8", workers=1, device="cuda", startup=180.0):
        seconds = time.perf_counter() - start
    ctx.row(SpeedRow("serving_start_llama8b", round(seconds, 1), "s",
                     detail="`pipeserve up` to SERVING, random bf16 weights, CUDA graphs up to 256"))


def attention_rows(ctx: Context, copy_gbps: float | None) -> None:
    from pipeserve.engine.triton_kernels.decode_attention import decode_attention

    batch, ctx_len, hq, hkv, d, page = 64, 2048, 32, 8, 128, 16
    pages = batch * ctx_len // page
    tables = torch.randperm(pages, device="cuda").view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=BF16)
    for kv in (None, torch.int8, torch.float8_e4m3fn):
        raw = torch.randn(2, pages, page, hkv, d, device="cuda")
        if kv is None:
            k, v = raw.to(BF16)
            scales: dict[str, Any] = {}
        else:
            k, v = (raw * 20).clamp(-127, 127).to(kv)
            s = torch.rand(2, pages, page, hkv, d // 8, device="cuda", dtype=torch.float16)
            scales = {"k_scale": s[0], "v_scale": s[1]}
        nbytes = 2 * k.numel() * k.element_size() + sum(t.numel() * t.element_size() for t in scales.values())
        attend = partial(decode_attention, q, k, v, tables, lens, d**-0.5, max_seq_len=ctx_len, **scales)
        sec = timed(attend, torch.device("cuda"), 20)
        gbps = nbytes / sec / 1e9
        name = {None: "bf16", torch.int8: "int8", torch.float8_e4m3fn: "fp8"}[kv]
        ctx.row(SpeedRow(f"decode_attention_{name}_b64_ctx2048", round(gbps, 1), "GB/s",
                         pct(gbps, copy_gbps) if copy_gbps else None, f"{sec * 1e6:.1f} us"))


def gemm_rows(ctx: Context, copy_gbps: float | None, bf16_tflops: float | None) -> None:
    from pipeserve.engine.backend import get_backend
    from pipeserve.engine.quantization.weights import quantize_int4, quantize_per_channel

    tri, dev = get_backend("triton"), torch.device("cuda")
    n, k = 4096, 4096
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    i8w, i8s = quantize_per_channel(w, torch.int8)
    f8w, f8s = quantize_per_channel(w, torch.float8_e4m3fn)
    q4 = quantize_int4(w)
    for m in (1, 2048):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        base = timed(partial(torch.matmul, x, w.T), dev, 20)
        a8, a8s = tri.per_token_quant(x, torch.int8)
        af, afs = tri.per_token_quant(x, torch.float8_e4m3fn)
        kernels: dict[str, Callable[[], object]] = {
            "int8": partial(tri.int8_gemm, a8, a8s, i8w, i8s, None, BF16),
            "fp8": partial(tri.fp8_gemm, af, afs, f8w, f8s, None, BF16),
            "w4a16": partial(tri.w4a16_gemm, x, *q4),
        }
        for name, fn in kernels.items():
            sec = timed(fn, dev, 20)
            weight = n * k * (0.5 if name == "w4a16" else 1.0)
            if m == 1:  # decode: bound by reading the weights
                floor = None if copy_gbps is None else weight / (copy_gbps * 1e9)
            else:  # prefill: bound by the math (bf16 rate; int8 / fp8 tensor cores go twice as fast)
                floor = None if bf16_tflops is None else 2 * m * n * k / (bf16_tflops * 1e12)
            ctx.row(SpeedRow(f"gemm_{name}_m{m}_{n}x{k}", round(sec * 1e6, 2), "us", pct(floor, sec),
                             f"torch bf16 {base * 1e6:.2f} us, speedup {base / sec:.2f}x"))


def run(ctx: Context) -> None:
    if ctx.device != "cuda":
        raise RuntimeError("the speed rows need CUDA")
    copy_gbps, tflops = ctx.ceilings.get("copy_gbps"), ctx.ceilings.get("bf16_tflops")
    with tempfile.TemporaryDirectory(prefix="gpu-check-speed-") as tmp:
        # The decode rows first: a run stopped at its budget keeps the rows the targets are set on.
        parts: dict[str, Callable[[], None]] = {
            "decode": lambda: decode_rows(ctx, tmp, copy_gbps),
            "decode attention": lambda: attention_rows(ctx, copy_gbps),
            "gemm": lambda: gemm_rows(ctx, copy_gbps, tflops),
            "serving start": lambda: serving_start_row(ctx, tmp),
        }
        failed = run_parts(parts, torch.cuda.empty_cache)
    if failed:
        raise RuntimeError("; ".join(failed))
