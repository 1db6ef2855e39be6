"""gpu-check's quant section: the quantized and MoE kernels against their bf16 baselines, most
valuable rows first (each part in its own try, so one failure keeps the others' rows):

1. decode attention at batch 64 x 2,048 context (32 q / 8 kv heads, head_dim 128): int8 and fp8 KV
   against bf16 KV;
2. W8A8 fp8 / int8 and W4A16 GEMMs at Llama-3-8B shapes, M = 1, 16, 256, 4096, against bf16
   torch.matmul (the GEMM alone; the per-token activation quantization, fused into RMSNorm in the
   engine, is timed apart and named in the detail);
3. fused MoE (bf16, int8 and fp8 experts) against a loop over experts with torch.matmul, Mixtral-8x7B
   and Qwen3-30B-A3B shaped layers at 16, 64, 256 tokens;
4. RMSNorm + per-token quantization fused against RMSNorm then per_token_quant;
5. end to end: an 8B-shaped Llama with random weights, decode step time at batch 1 and 64 for six
   weight / KV-cache modes with CUDA graphs; engines left when under END_TO_END_RESERVE_S of the
   section's budget remain are reported as skipped rows, so the section ends with its rows.

A ratio target's row has the speedup over its baseline as its value (unit "x"), pct_of_floor the
kernel's share of its roofline (copy bandwidth for what is bound by bytes, the tensor-core rate for
what is bound by math), and both times with the achieved rate in its detail. Inputs rotate over
enough copies that the L2 cache does not serve them. Every kernel's output is compared with the
reference backend's op on the same inputs and codes; a mismatch is named in the row and fails the
section at its end. Every function takes its device and shapes, so the tests run the same code on the
CPU at tiny shapes under the Triton interpreter."""

from __future__ import annotations

import gc
import itertools
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from .environment import timed
from .kernels import dequant, rel_error
from .report import THRESHOLDS, SpeedRow
from .runner import Context, run_parts
from .speed import pct

BF16, F32, I8, FP8 = torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn
QNAME = {I8: "int8", FP8: "fp8"}
BUDGET_S = 225.0  # the section's work; its limit (runner.SECTIONS) is 240 s
END_TO_END_RESERVE_S = 40.0  # no engine starts with less of the budget left
MAX_COPIES = 16


@dataclass
class Plan:
    """Where and at what shapes the section runs: full size on CUDA, tiny for the CPU tests."""

    device: torch.device
    dtype: torch.dtype  # activations and the float baseline (fp32 under the interpreter)
    repeats: int
    l2_bytes: int  # what one pass of a kernel's inputs must exceed, rotated copies together
    attention: tuple[int, int, int, int, int, int]  # batch, context, q heads, kv heads, head_dim, page
    gemm_shapes: tuple[tuple[int, int], ...]  # (N, K): out, in
    gemm_m: tuple[int, ...]
    moe: tuple[tuple[str, int, int, int, int], ...]  # name, hidden, intermediate, experts, top_k
    moe_tokens: tuple[int, ...]
    norm_m: tuple[int, ...]
    norm_hidden: int

    @classmethod
    def for_device(cls, device: torch.device) -> Plan:
        if device.type == "cuda":
            l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20))
            return cls(device, BF16, 15, l2,
                       (64, 2048, 32, 8, 128, 16), ((4096, 4096), (14336, 4096), (4096, 14336)),
                       (1, 16, 256, 4096),
                       (("mixtral", 4096, 14336, 8, 2), ("qwen3moe", 2048, 768, 128, 8)), (16, 64, 256),
                       (1, 256, 4096), 4096)
        # The interpreter's bf16 arithmetic is wrong: fp32 activations; a small "L2" so rotation runs.
        return cls(device, F32, 1, 2**16, (2, 64, 4, 2, 32, 16), ((48, 128), (64, 256)), (1, 16),
                   (("tiny", 64, 48, 4, 2),), (3,), (1, 5), 64)


def copies(nbytes: int, l2_bytes: int) -> int:
    """How many copies of an input of nbytes to rotate so that a pass over them is twice the L2."""
    return max(1, min(MAX_COPIES, math.ceil(2 * l2_bytes / max(1, nbytes))))


def rotating(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs fns in turn, a different one each call."""
    cycle = itertools.cycle(fns)
    return lambda: next(cycle)()


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class Checks:
    """Each kernel's output against its baseline; the mismatches, raised at the section's end."""

    errors: dict[str, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def compare(self, name: str, out: torch.Tensor, ref: torch.Tensor, precision: str) -> str:
        err, bound = rel_error(out, ref), THRESHOLDS[precision]
        self.errors[name] = err
        ok = math.isfinite(err) and err <= bound
        if not ok:
            self.failed.append(f"{name}: error {err:.3g} > {bound:g}")
        return f"error {err:.1e}" + ("" if ok else f" WRONG (bound {bound:g})")


def _ceiling(ceilings: dict[str, float | None], key: str) -> float | None:
    value = ceilings.get(key)
    return float(value) if value else None


def floor_s(num: float, rate: float | None) -> float | None:
    """num / rate, None without the rate."""
    return None if rate is None else num / rate


# 1. Decode attention -------------------------------------------------------------------------------

def attention_rows(ctx: Context, plan: Plan, checks: Checks) -> None:
    from pipeserve.engine.backend import get_backend
    from pipeserve.engine.triton_kernels.decode_attention import decode_attention

    dev, ref = plan.device, get_backend("reference")
    batch, ctx_len, hq, hkv, d, page = plan.attention
    copy_gbps = _ceiling(ctx.ceilings, "copy_gbps")
    per_pass = batch * ctx_len // page  # pages one call reads
    lens = torch.full((batch,), ctx_len, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, device=dev).to(plan.dtype)
    checked = min(batch, 8)  # the reference attends for these requests only
    bf16_s: float | None = None
    for kv in (None, I8, FP8):
        name = "bf16" if kv is None else QNAME[kv]
        elem = plan.dtype.itemsize if kv is None else 1
        tokens = batch * ctx_len * hkv
        one_pass = 2 * tokens * d * elem + (0 if kv is None else 2 * tokens * d // 8 * 2)  # + fp16 scales
        n = copies(one_pass, plan.l2_bytes)
        pool = n * per_pass
        # Each rotation reads its own pages of one pool: page tables, not caches, rotate.
        tables = torch.randperm(pool, device=dev).view(n, batch, -1).to(torch.int32)
        raw = torch.randn(2, pool, page, hkv, d, device=dev)
        scales: dict[str, torch.Tensor | None] = {"k_scale": None, "v_scale": None}
        if kv is None:
            k, v = raw.to(plan.dtype)
        else:
            k, v = (raw * 20).clamp(-127, 127).to(kv)
            s = torch.rand(2, pool, page, hkv, d // 8, device=dev, dtype=torch.float16) / 64
            scales = {"k_scale": s[0], "v_scale": s[1]}
        del raw
        calls = [partial(decode_attention, q, k, v, tables[i], lens, d**-0.5, max_seq_len=ctx_len,
                         k_scale=scales["k_scale"], v_scale=scales["v_scale"]) for i in range(n)]
        out = calls[0]()
        want = ref.decode_attention(q[:checked], k, v, tables[0][:checked], lens[:checked], d**-0.5, None,
                                    ctx_len, k_scale=scales["k_scale"], v_scale=scales["v_scale"])
        check = checks.compare(f"attention {name}", out[:checked].float(), want.float(),
                               "bf16" if plan.dtype == BF16 else "fp32")
        sec = timed(rotating(calls), dev, plan.repeats)
        gbps = one_pass / sec / 1e9
        of_copy = pct(gbps, copy_gbps) if copy_gbps else None  # achieved / copy rate, a percentage
        detail = (f"{sec * 1e6:.1f} us, {gbps:.0f} GB/s of {one_pass / 1e6:.0f} MB (KV + scales), "
                  f"{n} page-table rotations; {check}")
        shape = f"b{batch}_ctx{ctx_len}"
        if kv is None:
            bf16_s = sec
            ctx.row(SpeedRow(f"quant_attention_bf16_{shape}", round(gbps, 1), "GB/s", of_copy, detail))
        else:
            assert bf16_s is not None
            ctx.row(SpeedRow(f"quant_attention_{name}_{shape}", round(bf16_s / sec, 3), "x", of_copy,
                             f"speedup over bf16 KV ({bf16_s * 1e6:.1f} us); " + detail))
        del k, v, scales, calls


# 2. GEMMs ------------------------------------------------------------------------------------------

def gemm_rows(ctx: Context, plan: Plan, checks: Checks) -> None:
    from pipeserve.engine.backend import get_backend
    from pipeserve.engine.quantization.weights import quantize_int4, quantize_per_channel

    tri, ref, dev = get_backend("triton"), get_backend("reference"), plan.device
    copy_gbps = _ceiling(ctx.ceilings, "copy_gbps")
    tflops = _ceiling(ctx.ceilings, "bf16_tflops")
    quant_s: dict[tuple[int, int, torch.dtype], float] = {}  # the activation quantizer, per (M, K, dtype)
    for n, k in plan.gemm_shapes:
        w = (torch.randn(n, k, device=dev) * 0.02).to(plan.dtype)
        packed: dict[str, tuple[torch.Tensor, ...]] = {
            "bf16": (w,), "fp8": quantize_per_channel(w, FP8), "int8": quantize_per_channel(w, I8),
            "w4a16": quantize_int4(w)}
        # Rotated weight copies per kernel: same values at other addresses.
        weights = {name: [t] + [tuple(x.clone() for x in t)
                                for _ in range(copies(nbytes(*t), plan.l2_bytes) - 1)]
                   for name, t in packed.items()}
        for m in plan.gemm_m:
            x = torch.randn(m, k, device=dev).to(plan.dtype)
            base = timed(rotating([partial(torch.matmul, x, c[0].T) for c in weights["bf16"]]), dev,
                         plan.repeats)
            flop = 2 * m * n * k
            for name in ("fp8", "int8", "w4a16"):
                args: tuple[torch.Tensor, ...]
                if name == "w4a16":
                    op, args, out_dtype, fmt = "w4a16_gemm", (x,), plan.dtype, "W4A16"
                else:
                    q_dtype = FP8 if name == "fp8" else I8
                    args = tri.per_token_quant(x, q_dtype)
                    key = (m, k, q_dtype)
                    if key not in quant_s:
                        quant_s[key] = timed(partial(tri.per_token_quant, x, q_dtype), dev, plan.repeats)
                    op, out_dtype, fmt = f"{name}_gemm", plan.dtype, f"W8A8 {name}"
                extra: tuple[Any, ...] = () if name == "w4a16" else (None, out_dtype)
                calls = [partial(getattr(tri, op), *args, *c, *extra) for c in weights[name]]
                # W8A8: the quantized operands' own bound (the reference may accumulate fp8 products
                # in less than fp32, as cuBLAS's fast fp8 path does); W4A16: the activations' dtype.
                precision = name if name != "w4a16" else "bf16" if plan.dtype == BF16 else "tf32"
                check = checks.compare(f"gemm {name} {n}x{k} m{m}", calls[0]().float(),
                                       getattr(ref, op)(*args, *weights[name][0], *extra).float(), precision)
                sec = timed(rotating(calls), dev, plan.repeats)
                moved = nbytes(*args, *weights[name][0]) + m * n * out_dtype.itemsize
                if m <= 16:  # bound by reading the weights
                    floor = floor_s(moved, copy_gbps and copy_gbps * 1e9)
                else:  # bound by the math: int8 / fp8 tensor cores at twice the bf16 rate
                    floor = floor_s(flop, tflops and tflops * 1e12 * (1 if name == "w4a16" else 2))
                quant = "" if name == "w4a16" else (
                    f"; +{quant_s[(m, k, FP8 if name == 'fp8' else I8)] * 1e6:.1f} us per-token activation "
                    "quant (not counted: fused into RMSNorm in the engine)")
                ctx.row(SpeedRow(
                    f"quant_gemm_{name}_{n}x{k}_m{m}", round(base / sec, 3), "x", pct(floor, sec),
                    f"{fmt} {sec * 1e6:.1f} us ({moved / sec / 1e9:.0f} GB/s, "
                    f"{flop / sec / 1e12:.1f} TFLOP/s) "
                    f"vs torch.matmul bf16 {base * 1e6:.1f} us ({flop / base / 1e12:.1f} TFLOP/s); "
                    f"{len(weights[name])} weight copies{quant}; {check}"))
            del x
        del w, packed, weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# 3. Fused MoE --------------------------------------------------------------------------------------

def moe_loop(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             top_k: int, renormalize: bool) -> torch.Tensor:
    """The baseline: each token's top-k experts by softmax, then per expert a gather, torch.matmul for
    gate/up, SiLU-and-mul, torch.matmul for down, and a weighted scatter-add (one readback of the
    experts' token counts per call)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = ids.flatten()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token = order // top_k
    weight = weights.flatten()[order]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = token[start:start + count]
        gate, up = (x[rows] @ w13[e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].T
        out.index_add_(0, rows, y.float() * weight[start:start + count, None])
        start += count
    return out.to(x.dtype)


def moe_rows(ctx: Context, plan: Plan, checks: Checks) -> None:
    from pipeserve.engine.backend import get_backend
    from pipeserve.engine.quantization.experts import W8A8Experts

    tri, ref, dev = get_backend("triton"), get_backend("reference"), plan.device
    copy_gbps = _ceiling(ctx.ceilings, "copy_gbps")
    close = "bf16" if plan.dtype == BF16 else "tf32"
    for shape, hidden, inter, experts, top_k in plan.moe:
        w13 = (torch.randn(experts, 2 * inter, hidden, device=dev) * 0.02).to(plan.dtype)
        w2 = (torch.randn(experts, hidden, inter, device=dev) * 0.02).to(plan.dtype)
        quantized = {q: W8A8Experts(w13, w2, top_k, True, q, ref) for q in (I8, FP8)}
        for tokens in plan.moe_tokens:
            x = torch.randn(tokens, hidden, device=dev).to(plan.dtype)
            logits = torch.randn(tokens, experts, device=dev).to(plan.dtype)
            active = int(logits.float().topk(top_k, dim=-1).indices.unique().numel())
            loop_s = timed(partial(moe_loop, x, logits, w13, w2, top_k, True), dev, plan.repeats)
            # name: (the fused call, what it must equal, that precision, bytes per expert weight)
            kernels: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor, str, int]] = {
                "bf16": (partial(tri.fused_moe, x, logits, w13, w2, top_k, True),
                         ref.fused_moe(x, logits, w13, w2, top_k, True), close, w13.element_size())}
            for q, eq in quantized.items():
                qargs = (x, logits, eq.w13, eq.w13_scale, eq.w2, eq.w2_scale, top_k, True)
                kernels[QNAME[q]] = (partial(tri.fused_moe_w8a8, *qargs), ref.fused_moe_w8a8(*qargs),
                                     "int8 twice" if q == I8 else QNAME[q], 1)
            for name, (fn, baseline, precision, elem) in kernels.items():
                check = checks.compare(f"moe {shape} {name} t{tokens}", fn().float(), baseline.float(),
                                       precision)
                sec = timed(fn, dev, plan.repeats)
                read = active * 3 * hidden * inter * elem  # the routed experts' weights, read once
                ctx.row(SpeedRow(
                    f"quant_moe_{shape}_{name}_t{tokens}", round(loop_s / sec, 3), "x",
                    pct(floor_s(read, copy_gbps and copy_gbps * 1e9), sec),
                    f"fused {name} experts {sec * 1e6:.1f} us ({read / sec / 1e9:.0f} GB/s of {active} "
                    f"experts' weights) vs torch.matmul loop over bf16 experts {loop_s * 1e6:.1f} us; "
                    f"{check}"))
            del x, logits, kernels
        del w13, w2, quantized
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# 4. RMSNorm + quantization -------------------------------------------------------------------------

def norm_quant_rows(ctx: Context, plan: Plan, checks: Checks) -> None:
    from pipeserve.engine.backend import get_backend

    tri, ref, dev = get_backend("triton"), get_backend("reference"), plan.device
    copy_gbps = _ceiling(ctx.ceilings, "copy_gbps")
    h, eps = plan.norm_hidden, 1e-5
    weight = (1 + 0.1 * torch.randn(h, device=dev)).to(plan.dtype)
    elem = weight.element_size()
    for m in plan.norm_m:
        xs = [torch.randn(m, h, device=dev).to(plan.dtype)
              for _ in range(copies(m * h * elem, plan.l2_bytes))]
        for q in (I8, FP8):
            want = dequant(*ref.rms_norm_quant(xs[0], weight, eps, None, q)[:2])
            fused = [partial(tri.rms_norm_quant, x, weight, eps, None, q) for x in xs]

            def separate(x: torch.Tensor, q: torch.dtype = q) -> tuple[torch.Tensor, torch.Tensor]:
                y = tri.rms_norm(x, weight, eps)
                assert isinstance(y, torch.Tensor)
                return tri.per_token_quant(y, q)

            codes, scale = fused[0]()[:2]
            check = checks.compare(f"rms_norm_quant {QNAME[q]} m{m}", dequant(codes, scale), want, QNAME[q])
            codes, scale = separate(xs[0])
            checks.compare(f"rms_norm then per_token_quant {QNAME[q]} m{m}", dequant(codes, scale), want,
                           QNAME[q])
            fused_s = timed(rotating(fused), dev, plan.repeats)
            separate_s = timed(rotating([partial(separate, x) for x in xs]), dev, plan.repeats)
            out = m * h + m * 4 + h * elem  # codes, fp32 scales; the norm weight read once
            fused_b = m * h * elem + out
            separate_b = fused_b + 2 * m * h * elem  # the normed activations written and read back
            gbps = fused_b / fused_s / 1e9
            ctx.row(SpeedRow(
                f"quant_rms_norm_quant_{QNAME[q]}_m{m}_h{h}", round(separate_s / fused_s, 3), "x",
                pct(gbps, copy_gbps) if copy_gbps else None,
                f"fused {fused_s * 1e6:.1f} us ({fused_b / 1e6:.2f} MB, {gbps:.0f} GB/s) vs rms_norm then "
                f"per_token_quant {separate_s * 1e6:.1f} us ({separate_b / 1e6:.2f} MB, "
                f"{separate_b / separate_s / 1e9:.0f} GB/s); {check}"))


# 5. End to end -------------------------------------------------------------------------------------

# (weights, KV cache): what is worth a start of the 8B engine, most asked for first.
END_TO_END_MODES = (("none", "auto"), ("none", "int8"), ("none", "fp8"), ("w8a8-fp8", "auto"),
                    ("w8a8-int8", "auto"), ("w8a8-fp8", "fp8"))


def end_to_end_rows(ctx: Context, model_dir: str, deadline: float, engine_options: dict[str, Any],
                    batches: Sequence[int] = (1, 64), warm: int = 8, steps: int = 32,
                    modes: Sequence[tuple[str, str]] = END_TO_END_MODES,
                    clock: Callable[[], float] = time.monotonic) -> None:
    """Decode seconds per step for each (weights, kv) mode, one engine at a time; once under
    END_TO_END_RESERVE_S (or the last engine's time, if longer) remains before `deadline` (on
    `clock`), the modes left become rows saying they were skipped. A mode that fails gets a row
    saying why, the next one runs, and the failures are raised at the end."""
    base: dict[int, float] = {}
    last = 0.0
    failed: list[str] = []
    for weights, kv in modes:
        tag = f"{'bf16' if weights == 'none' else weights}_kv{kv}"
        left = deadline - clock()
        if left < max(END_TO_END_RESERVE_S, 1.2 * last):
            for batch in batches:
                ctx.row(SpeedRow(f"quant_e2e_{tag}_b{batch}", None, "ms/step",
                                 detail=f"skipped for time: {left:.0f} s of the section's budget left, the "
                                        f"last engine took {last:.0f} s"))
            continue
        start = clock()
        done: set[int] = set()
        try:
            end_to_end_mode(ctx, model_dir, engine_options, weights, kv, tag, batches, warm, steps,
                            base, (weights, kv) == modes[0], done, clock)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            failed.append(f"{tag}: {reason}")
            for batch in batches:
                if batch not in done:
                    ctx.row(SpeedRow(f"quant_e2e_{tag}_b{batch}", None, "ms/step",
                                     detail=f"failed: {reason}"))
        gc.collect()  # the engine and its CUDA graphs, before the next one takes their memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        last = clock() - start
    if failed:
        raise RuntimeError("; ".join(failed))


def end_to_end_mode(ctx: Context, model_dir: str, engine_options: dict[str, Any], weights: str, kv: str,
                    tag: str, batches: Sequence[int], warm: int, steps: int, base: dict[int, float],
                    is_base: bool, done: set[int], clock: Callable[[], float]) -> None:
    """One engine: its rows per batch (each batch in `done` once its row is out)."""
    from pipeserve.engine import LLM

    from .speed import decode_seconds

    start = clock()
    llm = LLM(model_dir, load_format="dummy", quantization=weights, kv_cache_dtype=kv, **engine_options)
    built = clock() - start
    try:
        for batch in batches:
            sec = decode_seconds(llm.engine, batch, warm=warm, steps=steps)
            if is_base:
                base[batch] = sec
            speedup = f"{base[batch] / sec:.2f}x bf16 / auto KV" if batch in base else "no bf16 baseline"
            ctx.row(SpeedRow(f"quant_e2e_{tag}_b{batch}", round(sec * 1e3, 3), "ms/step", None,
                             f"{speedup}; {batch / sec:.0f} tokens/s; engine built in {built:.1f} s"))
            done.add(batch)
    finally:
        llm.engine.close()


def end_to_end(ctx: Context, tmp: str, deadline: float) -> None:
    from .models import write_shape_config

    model_dir = write_shape_config(f"{tmp}/llama8b", "llama8b")
    end_to_end_rows(ctx, model_dir, deadline, dict(
        device="cuda", dtype="bfloat16", backend="triton", step_executor="compiled", max_num_seqs=64,
        max_cuda_graph_batch=64, max_model_len=4096, kv_cache_gb=8.0))


def run(ctx: Context, budget_s: float = BUDGET_S) -> None:
    if ctx.device != "cuda":
        raise RuntimeError("the quant rows need CUDA")
    deadline = time.monotonic() + budget_s
    plan, checks = Plan.for_device(torch.device("cuda")), Checks()
    with tempfile.TemporaryDirectory(prefix="gpu-check-quant-") as tmp:
        parts: dict[str, Callable[[], None]] = {
            "decode attention": lambda: attention_rows(ctx, plan, checks),
            "gemm": lambda: gemm_rows(ctx, plan, checks),
            "fused moe": lambda: moe_rows(ctx, plan, checks),
            "rms_norm_quant": lambda: norm_quant_rows(ctx, plan, checks),
            "end to end": lambda: end_to_end(ctx, tmp, deadline),
        }
        failed = run_parts(parts, torch.cuda.empty_cache)
    if checks.failed:
        failed.append("kernels off their baseline: " + ", ".join(checks.failed)[:300])
    if failed:
        raise RuntimeError("; ".join(failed))
