"""The Triton kernel suite on a GPU: one command checks every kernel against its torch reference and
times it against the torch equivalent (SDPA, cuBLAS bf16, torch._scaled_mm / torch._int_mm) and the
roofline of this GPU (copy bandwidth and bf16 matmul rate measured in the same run).

    python -m pipeserve.bench.kernels             # Llama-3-8B layer shapes (32 q, 8 kv heads, head_dim 128)
    python -m pipeserve.bench.kernels --only decode,gemm_int8
    python -m pipeserve.bench.kernels --only moe  # the fused MoE at Mixtral-8x7B and Qwen3-30B-A3B shapes
    python -m pipeserve.bench.kernels --tiny      # tiny shapes: a quick check (no GPU: the interpreter)

Writes bench/results/<gpu>/kernels.json and kernels.md. Timing: triton.testing.do_bench medians (the
L2 cache is flushed before each launch). "% bw" = bytes the kernel must move / time / measured copy
bandwidth; "% mm" = FLOP / time / measured bf16 matmul rate. Quantized GEMMs are timed without the
activation quantization (it is fused into the producing norm / activation kernel). The fused MoE's
bytes are the weights of the experts its tokens actually touch plus its input and output.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

NO_GPU = (
    "python -m pipeserve.bench.kernels: no CUDA GPU here (torch.cuda.is_available() is False), so nothing "
    "was measured. "
    "The suite times the Triton kernels on a GPU; on this machine their correctness is covered by "
    "`pytest tests/test_kernels_*.py` (TRITON_INTERPRET=1), and `python -m pipeserve.bench.kernels --tiny` "
    "runs this suite's checks at tiny shapes in the interpreter."
)

# Llama-3-8B layer shapes.
HQ, HKV, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336
TOL = {"bfloat16": 3e-2}  # max|out - ref| / max|ref| for bf16 outputs against fp32 references


@dataclass
class Result:
    kernel: str
    shape: str
    ok: bool | None = None  # matches the torch reference within TOL
    max_rel_err: float | None = None
    ms: float | None = None
    baseline: str | None = None
    baseline_ms: float | None = None
    gb_per_s: float | None = None
    pct_bandwidth: float | None = None
    tflops: float | None = None
    pct_matmul: float | None = None
    target: str | None = None
    met: bool | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        return self.baseline_ms / self.ms if self.ms and self.baseline_ms else None


@dataclass
class Scale:
    """The shapes one run uses: the Llama-3-8B layer (full) or tiny ones for the interpreter."""

    hq: int
    hkv: int
    head_dim: int
    hidden: int
    intermediate: int
    page_size: int
    decode: list[tuple[int, int]]  # (batch, context)
    target_decode: tuple[int, int]  # where the bf16 / int8 / fp8 caches are compared
    prefill: list[tuple[int, int]]  # (q_len, context)
    gemm_m: list[int]
    gemm_nk: list[tuple[int, int]]
    tokens: int  # row-wise kernels
    targets: bool  # the speed targets apply to the full shapes only
    # Fused MoE: (name, experts, top_k, hidden, expert intermediate) and the token counts to run.
    moe: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    moe_tokens: list[int] = field(default_factory=list)

    @staticmethod
    def full() -> Scale:
        llama3 = dict(
            hq=HQ, hkv=HKV, head_dim=HEAD_DIM, hidden=HIDDEN, intermediate=INTERMEDIATE, page_size=16
        )
        return Scale(
            **llama3,
            decode=[(64, 4096), (1, 32768), (8, 8192), (256, 1024)],
            target_decode=(64, 4096),
            prefill=[(4096, 4096), (512, 4096)],
            gemm_m=[1, 16, 2048, 4096],
            gemm_nk=[(HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN)],
            tokens=4096,
            targets=True,
            moe=[("Mixtral-8x7B", 8, 2, 4096, 14336), ("Qwen3-30B-A3B", 128, 8, 2048, 768)],
            moe_tokens=[1, 16, 256, 4096],
        )

    @staticmethod
    def tiny() -> Scale:
        tiny = dict(hq=8, hkv=2, head_dim=64, hidden=256, intermediate=384, page_size=16)
        return Scale(
            **tiny,
            decode=[(3, 100)],
            target_decode=(3, 100),
            prefill=[(40, 72)],
            gemm_m=[1, 40],
            gemm_nk=[(96, 256)],
            tokens=24,
            targets=False,
            moe=[("tiny", 8, 2, 64, 96)],
            moe_tokens=[3, 40],
        )


class Suite:
    def __init__(
        self, device: Any, scale: Scale, rates: Any, timer: Callable[[Callable[[], Any]], float]
    ) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.s = scale
        self.rates = rates
        self.time = timer
        self.dtype = torch.bfloat16
        self.results: list[Result] = []
        self.gen = torch.Generator(device=device).manual_seed(0)

    # -- helpers ---------------------------------------------------------------------------------
    def randn(self, *shape: int, dtype: Any = None, std: float = 1.0) -> Any:
        t = self.torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.torch.float32) * std
        return t.to(dtype or self.dtype)

    def check(self, r: Result, out: Any, ref: Any, tol: float = TOL["bfloat16"]) -> None:
        """max|out - ref| / max|ref| <= tol, nothing non-finite."""
        out, ref = out.double(), ref.double()
        finite = bool(self.torch.isfinite(out).all())
        r.max_rel_err = (
            float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)) if finite else math.inf
        )
        r.ok = finite and r.max_rel_err <= tol

    def rate(self, r: Result, nbytes: float | None = None, flops: float | None = None) -> None:
        if not r.ms:
            return
        if nbytes:
            r.gb_per_s = nbytes / r.ms / 1e6
            r.pct_bandwidth = 100 * nbytes / (r.ms / 1e3) / self.rates.copy_bandwidth
        if flops:
            r.tflops = flops / r.ms / 1e9
            r.pct_matmul = 100 * flops / (r.ms / 1e3) / self.rates.matmul_flops

    def target(self, r: Result, goal: str, met: bool) -> None:
        if self.s.targets:
            r.target, r.met = goal, met

    def baseline(self, r: Result, name: str, fn: Callable[[], Any]) -> None:
        """Time a torch equivalent; a missing op (old torch, no fp8 support) leaves it blank."""
        try:
            fn()
            r.baseline, r.baseline_ms = name, self.time(fn)
        except Exception as exc:  # a baseline that cannot run is reported, not fatal
            r.extra["baseline_error"] = f"{name}: {type(exc).__name__}: {exc}"[:300]

    def run(self, kernel: str, shape: str, body: Callable[[Result], None]) -> Result:
        r = Result(kernel, shape)
        started = time.perf_counter()
        try:
            body(r)
        except Exception as exc:  # one failing kernel must not hide the others' figures
            r.ok, r.error = False, f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc()
        r.extra["wall_s"] = round(time.perf_counter() - started, 2)
        self.results.append(r)
        status = "ok" if r.ok else "FAIL" if r.ok is False else "-"
        print(f"{kernel:<22} {shape:<34} {status:<4} {r.ms or 0:9.4f} ms  {r.error or ''}", flush=True)
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
        return r

    # -- paged KV --------------------------------------------------------------------------------
    def paged(self, batch: int, ctx: int, kv: str | None) -> dict[str, Any]:
        from pipeserve.engine.quantization.kv_cache import KV_QUANT_DTYPES, quantize_kv

        torch, s = self.torch, self.s
        pages = -(-ctx // s.page_size)
        perm = torch.randperm(batch * pages, generator=self.gen, device=self.device)
        tables = perm.view(batch, pages).to(torch.int32)
        shape = (batch * pages, s.page_size, s.hkv, s.head_dim)
        k, v = self.randn(*shape), self.randn(*shape)
        out = {
            "block_tables": tables,
            "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=self.device),
        }
        if kv is None:
            out |= {"k_cache": k, "v_cache": v, "scales": {}}
        else:
            (kq, ks), (vq, vs) = quantize_kv(k, KV_QUANT_DTYPES[kv]), quantize_kv(v, KV_QUANT_DTYPES[kv])
            out |= {"k_cache": kq, "v_cache": vq, "scales": {"k_scale": ks, "v_scale": vs}}
        return out

    def kv_bytes(self, tokens: int, kv: str | None) -> float:
        per_head = self.s.head_dim * 2 if kv is None else self.s.head_dim + self.s.head_dim // 8 * 2
        return 2 * tokens * self.s.hkv * per_head

    def contiguous_kv(self, c: dict[str, Any], batch: int, ctx: int) -> tuple[Any, Any]:
        """[B, Hkv, ctx, D] bf16 copies of the paged cache for SDPA."""
        from pipeserve.engine.backend.cpu import gather_pages

        k = gather_pages(c["k_cache"], c["block_tables"], ctx, c["scales"].get("k_scale")).to(self.dtype)
        v = gather_pages(c["v_cache"], c["block_tables"], ctx, c["scales"].get("v_scale")).to(self.dtype)
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    # -- cases -----------------------------------------------------------------------------------
    def decode(self) -> None:
        from pipeserve.engine.backend import cpu as ref
        from pipeserve.engine.triton_kernels.decode_attention import decode_attention

        torch, s = self.torch, self.s
        times: dict[tuple[int, int, str], float] = {}
        for batch, ctx in s.decode:
            kvs = ["bf16", "int8", "fp8"] if (batch, ctx) == s.target_decode else ["bf16"]
            for kv_name in kvs:
                kv = None if kv_name == "bf16" else kv_name

                def body(r: Result, batch: int = batch, ctx: int = ctx, kv: str | None = kv) -> None:
                    c = self.paged(batch, ctx, kv)
                    q = self.randn(batch, s.hq, s.head_dim)
                    scale = s.head_dim**-0.5
                    args = (q, c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], scale)
                    fn = lambda: decode_attention(*args, None, ctx, **c["scales"])
                    self.check(r, fn(), ref.decode_attention(*args, **c["scales"]).float())
                    r.ms = self.time(fn)
                    r.extra["num_splits"] = self._splits(batch, ctx)
                    self.rate(r, self.kv_bytes(batch * ctx, kv) + 2 * q.numel() * q.element_size())
                    k, v = self.contiguous_kv(c, batch, ctx)
                    sdpa = torch.nn.functional.scaled_dot_product_attention
                    self.baseline(
                        r, "SDPA bf16 (contiguous KV)", lambda: sdpa(q[:, :, None], k, v, enable_gqa=True)
                    )
                    if (batch, ctx) == s.target_decode and kv is None:
                        self.target(r, ">= 80% bw", r.pct_bandwidth is not None and r.pct_bandwidth >= 80)

                r = self.run(f"decode_attention[{kv_name}]", f"B={batch} ctx={ctx} page={s.page_size}", body)
                if r.ms:
                    times[(batch, ctx, kv_name)] = r.ms
                if kv is not None and r.ms and (batch, ctx, "bf16") in times:
                    r.extra["speedup_vs_bf16_kernel"] = times[(batch, ctx, "bf16")] / r.ms
                    if kv == "int8":
                        self.target(r, ">= 1.45x the bf16 kernel", r.extra["speedup_vs_bf16_kernel"] >= 1.45)

    def _splits(self, batch: int, ctx: int) -> int:
        from pipeserve.engine.triton_kernels.decode_attention import num_splits_for

        return num_splits_for(batch, self.s.hkv, ctx, self.device)

    def prefill(self) -> None:
        from pipeserve.engine.backend import cpu as ref
        from pipeserve.engine.triton_kernels.prefill_attention import prefill_attention

        torch, s = self.torch, self.s
        for q_len, ctx in s.prefill:

            def body(r: Result, q_len: int = q_len, ctx: int = ctx) -> None:
                c = self.paged(1, ctx, None)
                q = self.randn(q_len, s.hq, s.head_dim)
                cu = torch.tensor([0, q_len], dtype=torch.int32, device=self.device)
                args = (
                    q,
                    c["k_cache"],
                    c["v_cache"],
                    c["block_tables"],
                    cu,
                    c["seq_lens"],
                    q_len,
                    ctx,
                    s.head_dim**-0.5,
                )
                fn = lambda: prefill_attention(*args)
                self.check(r, fn(), ref.prefill_attention(*args).float())
                r.ms = self.time(fn)
                pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2  # (query, key) pairs under the mask
                self.rate(r, self.kv_bytes(ctx, None) + 4 * q.numel(), flops=4 * pairs * s.head_dim * s.hq)
                k, v = self.contiguous_kv(c, 1, ctx)
                qs = q.transpose(0, 1)[None]  # [1, Hq, q_len, D]
                sdpa = torch.nn.functional.scaled_dot_product_attention
                if q_len == ctx:
                    self.baseline(
                        r, "SDPA causal bf16", lambda: sdpa(qs, k, v, is_causal=True, enable_gqa=True)
                    )
                    if ctx == 4096:
                        self.target(r, ">= 400 TFLOP/s", r.tflops is not None and r.tflops >= 400)

            self.run("prefill_attention", f"q_len={q_len} ctx={ctx} page={s.page_size}", body)

    def gemms(self, formats: list[str]) -> None:
        from pipeserve.engine.quantization import weights

        torch, s = self.torch, self.s
        quantizers: dict[str, Callable[[Any], Any]] = {
            "int8": lambda w: weights.quantize_per_channel(w, torch.int8),
            "fp8": lambda w: weights.quantize_per_channel(w, torch.float8_e4m3fn),
            "int4": weights.quantize_int4,
            "nf4": weights.quantize_nf4,
        }
        for n, k in s.gemm_nk:
            w = self.randn(n, k, std=0.02)
            packed = {fmt: quantizers[fmt](w) for fmt in formats}
            for m in s.gemm_m:
                x = self.randn(m, k)
                shape = f"M={m} N={n} K={k}"
                cublas = self.run("gemm_bf16[cuBLAS]", shape, partial(self._cublas, x, w))
                for fmt in formats:
                    name = f"gemm_{fmt}" if fmt in ("int8", "fp8") else f"gemm_w4a16[{fmt}]"
                    self.run(name, shape, partial(self._gemm, fmt, x, packed[fmt], n, cublas.ms))

    def _cublas(self, x: Any, w: Any, r: Result) -> None:
        (m, k), n = x.shape, w.shape[0]
        r.ms = self.time(lambda: x @ w.T)  # the baseline itself: nothing to check
        self.rate(r, n * k * 2 + m * (k + n) * 2, flops=2 * m * n * k)

    def _gemm(
        self, fmt: str, x: Any, packed: tuple[Any, ...], n: int, bf16_ms: float | None, r: Result
    ) -> None:
        from pipeserve.engine.backend import get_backend, reference
        from pipeserve.engine.triton_kernels import gemm_w4a16, gemm_w8a8, quantize

        torch = self.torch
        m, k = x.shape
        if fmt in ("int8", "fp8"):
            qw, sw = packed
            a, sa = quantize.per_token_quant(x, qw.dtype)
            gemm = gemm_w8a8.int8_gemm if fmt == "int8" else gemm_w8a8.fp8_gemm
            fn = lambda: gemm(a, sa, qw, sw, None, torch.bfloat16)
            self.check(r, fn(), reference.scaled_gemm(a, sa, qw, sw, None, torch.float32))
            weight_bytes = n * k
            # The torch backend's quantized GEMM: torch._int_mm / torch._scaled_mm plus the scaling.
            torch_gemm = getattr(get_backend("cpu"), f"{fmt}_gemm")
            self.baseline(r, f"torch {fmt} (pipeserve.engine.backend.cpu)", lambda: torch_gemm(a, sa, qw, sw))
        else:
            qw, scales, *zeros = packed
            z = zeros[0] if zeros else None
            fn = lambda: gemm_w4a16.w4a16_gemm(x, qw, scales, z)
            self.check(r, fn(), reference.w4a16_gemm(x.float(), qw, scales, z))
            weight_bytes = n * k / 2 + scales.numel() * 2 + (0 if z is None else z.numel())
            self.baseline(r, "torch dequantize + matmul", lambda: reference.w4a16_gemm(x, qw, scales, z))
        r.ms = self.time(fn)
        self.rate(r, weight_bytes + m * (k + n) * 2, flops=2 * m * n * k)
        self._gemm_targets(r, m, weight_bytes, bf16_ms, {"int8": 1.3, "fp8": 1.5}.get(fmt))

    def _gemm_targets(
        self, r: Result, m: int, weight_bytes: float, bf16_ms: float | None, speedup: float | None
    ) -> None:
        if bf16_ms and r.ms:
            r.extra["speedup_vs_cublas_bf16"] = bf16_ms / r.ms
        if m <= 16 and r.ms:
            pct = 100 * weight_bytes / (r.ms / 1e3) / self.rates.copy_bandwidth
            r.extra["pct_bandwidth_on_weights"] = pct
            self.target(r, ">= 75% bw on weight bytes", pct >= 75)
        elif m >= 2048 and speedup is not None and "speedup_vs_cublas_bf16" in r.extra:
            self.target(r, f">= {speedup}x cuBLAS bf16", r.extra["speedup_vs_cublas_bf16"] >= speedup)

    def rowwise(self) -> None:
        from pipeserve.engine.backend import cpu, reference
        from pipeserve.engine.model.rope import rope_cache
        from pipeserve.engine.quantization.kv_cache import dequantize_kv
        from pipeserve.engine.triton_kernels import activation, kv_cache, norm, quantize, rope

        torch, s = self.torch, self.s
        t, h, inter = s.tokens, s.hidden, s.intermediate
        x, res, w = self.randn(t, h), self.randn(t, h), self.randn(h)

        def norm_plain(r: Result) -> None:
            fn = lambda: norm.rms_norm(x, w, 1e-5, res)
            self.check(r, fn()[0], cpu.rms_norm(x, w, 1e-5, res)[0])
            r.ms = self.time(fn)
            self.rate(r, t * h * 2 * 4)
            self.baseline(r, "torch eager", lambda: cpu.rms_norm(x, w, 1e-5, res))

        def norm_quant(r: Result) -> None:
            fn = lambda: norm.rms_norm_quant(x, w, 1e-5, res, torch.int8)
            q, sc = fn()[:2]
            # dequantized vs the unquantized norm: half an int8 step of the row max plus one bf16 step
            self.check(
                r, q.float() * sc, cpu.rms_norm(x, w, 1e-5, res)[0].float(), tol=0.5 / 127 + 2**-7
            )
            r.ms = self.time(fn)
            self.rate(r, t * h * (2 * 3 + 1) + t * 4)
            self.baseline(r, "torch eager", lambda: cpu.rms_norm_quant(x, w, 1e-5, res, torch.int8))
            self.target(r, ">= 80% bw", r.pct_bandwidth is not None and r.pct_bandwidth >= 80)

        gate_up = self.randn(t, 2 * inter)

        def silu(r: Result) -> None:
            fn = lambda: activation.silu_and_mul(gate_up)
            self.check(r, fn(), cpu.silu_and_mul(gate_up.float()))
            r.ms = self.time(fn)
            self.rate(r, t * inter * 2 * 3)
            self.baseline(r, "torch eager", lambda: cpu.silu_and_mul(gate_up))

        def silu_quant(r: Result) -> None:
            fn = lambda: activation.silu_and_mul_quant(gate_up, torch.int8)
            q, sc = fn()
            self.check(r, q.float() * sc, cpu.silu_and_mul(gate_up).float(), tol=0.5 / 127 + 2**-7)
            r.ms = self.time(fn)
            self.rate(r, t * inter * (2 * 2 + 1) + t * 4)
            self.baseline(r, "torch eager", lambda: cpu.silu_and_mul_quant(gate_up, torch.int8))

        def per_token(r: Result) -> None:
            fn = lambda: quantize.per_token_quant(x, torch.int8)
            q, sc = fn()
            want_q, want_sc = reference.per_token_quant(x, torch.int8)
            r.max_rel_err = float((q.int() - want_q.int()).abs().max())  # in int8 steps
            r.ok = r.max_rel_err <= 1 and bool(torch.allclose(sc, want_sc, rtol=1e-6))
            r.ms = self.time(fn)
            self.rate(r, t * h * 3 + t * 4)
            self.baseline(r, "torch eager", lambda: reference.per_token_quant(x, torch.int8))

        cos_sin = rope_cache(s.head_dim, 8192, 500000.0, None, self.device)
        positions = torch.randint(0, 8192, (t,), generator=self.gen, device=self.device)

        def rotary(r: Result) -> None:
            q, k = self.randn(t, s.hq, s.head_dim), self.randn(t, s.hkv, s.head_dim)
            q2, k2 = q.float(), k.float()
            rope.apply_rope(q, k, positions, cos_sin)
            cpu.apply_rope(q2, k2, positions, cos_sin)
            self.check(r, torch.cat([q.flatten(), k.flatten()]), torch.cat([q2.flatten(), k2.flatten()]))
            r.ms = self.time(lambda: rope.apply_rope(q, k, positions, cos_sin))
            self.rate(r, t * (s.hq + s.hkv) * s.head_dim * 2 * 2)
            self.baseline(r, "torch eager", lambda: cpu.apply_rope(q, k, positions, cos_sin))

        def store(r: Result, kv: str | None) -> None:
            c = self.paged(1, t, kv)
            kn, vn = self.randn(t, s.hkv, s.head_dim), self.randn(t, s.hkv, s.head_dim)
            slots = torch.randperm(t, generator=self.gen, device=self.device)
            fn = lambda: kv_cache.store_kv(kn, vn, c["k_cache"], c["v_cache"], slots, **c["scales"])
            fn()
            rows = c["k_cache"].view(-1, s.hkv, s.head_dim)[slots]
            if kv is not None:
                rows = dequantize_kv(
                    rows, c["scales"]["k_scale"].view(-1, *c["scales"]["k_scale"].shape[2:])[slots]
                )
            # quantized: within half an int8 step of the group max / e4m3's rounding of the value
            self.check(r, rows, kn, tol={None: 0.0, "int8": 1 / 127, "fp8": 1 / 16}[kv])
            r.ms = self.time(fn)
            self.rate(r, 2 * t * s.hkv * s.head_dim * 2 + self.kv_bytes(t, kv))
            self.baseline(
                r,
                "torch index_copy_",
                lambda: reference.store_kv(kn, vn, c["k_cache"], c["v_cache"], slots, *c["scales"].values()),
            )

        self.run("rms_norm+residual", f"T={t} H={h}", norm_plain)
        self.run("rms_norm+residual+int8", f"T={t} H={h}", norm_quant)
        self.run("per_token_quant[int8]", f"T={t} H={h}", per_token)
        self.run("silu_and_mul", f"T={t} I={inter}", silu)
        self.run("silu_and_mul+int8", f"T={t} I={inter}", silu_quant)
        self.run("rope", f"T={t} Hq={s.hq} Hkv={s.hkv} D={s.head_dim}", rotary)
        for kv in (None, "int8", "fp8"):
            self.run(
                f"store_kv[{kv or 'bf16'}]",
                f"T={t} Hkv={s.hkv} D={s.head_dim}",
                partial(store, kv=kv),
            )


    def moe(self) -> None:
        from pipeserve.engine.backend import cpu
        from pipeserve.engine.triton_kernels.fused_moe import fused_moe, topk_softmax

        torch, s = self.torch, self.s
        for name, experts, top_k, hidden, inter in s.moe:
            w13 = self.randn(experts, 2 * inter, hidden, std=0.02)
            w2 = self.randn(experts, hidden, inter, std=0.02)
            for t in s.moe_tokens:

                def body(r: Result, t: int = t, experts: int = experts, top_k: int = top_k,
                         hidden: int = hidden, inter: int = inter, w13: Any = w13, w2: Any = w2) -> None:
                    x, logits = self.randn(t, hidden), self.randn(t, experts)
                    fn = lambda: fused_moe(x, logits, w13, w2, top_k, True)
                    self.check(r, fn(), cpu.fused_moe(x.float(), logits.float(), w13.float(), w2.float(),
                                                      top_k, True))
                    r.ms = self.time(fn)
                    touched = int(torch.unique(topk_softmax(logits, top_k, True)[1]).numel())
                    r.extra["experts_touched"] = touched
                    self.rate(r, touched * 3 * hidden * inter * 2 + 2 * t * hidden * 2,
                              flops=2 * t * top_k * 3 * hidden * inter)
                    self.baseline(r, "torch sort + per-expert matmuls (backend.cpu)",
                                  lambda: cpu.fused_moe(x, logits, w13, w2, top_k, True))

                self.run("fused_moe", f"{name} E={experts} k={top_k} T={t}", body)
            del w13, w2


FAMILIES = ["decode", "prefill", "gemm_int8", "gemm_fp8", "gemm_int4", "gemm_nf4", "rowwise", "moe"]


def run_suite(suite: Suite, only: list[str]) -> None:
    if "decode" in only:
        suite.decode()
    if "prefill" in only:
        suite.prefill()
    formats = [f for f in ("int8", "fp8", "int4", "nf4") if f"gemm_{f}" in only]
    if formats:
        suite.gemms(formats)
    if "rowwise" in only:
        suite.rowwise()
    if "moe" in only:
        suite.moe()


def markdown(results: list[Result], header: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "**no**"
        if isinstance(v, float):
            return f"{v:.4g}" if math.isfinite(v) else str(v)
        return str(v)

    lines = [f"# Triton kernels on {header['gpu']}", ""]
    lines += [f"- {k}: {cell(v)}" for k, v in header.items() if k != "gpu"]
    lines += [
        "",
        "| kernel | shape | check | rel err | ms | baseline | baseline ms | speedup | GB/s | % bw "
        "| TFLOP/s | % mm | target | met |",
        "|" + "---|" * 14,
    ]
    for r in results:
        check = "**error**" if r.error else cell(r.ok)
        lines.append(
            "| "
            + " | ".join(
                [r.kernel, r.shape, check]
                + [
                    cell(v)
                    for v in (
                        r.max_rel_err,
                        r.ms,
                        r.baseline,
                        r.baseline_ms,
                        r.speedup,
                        r.gb_per_s,
                        r.pct_bandwidth,
                        r.tflops,
                        r.pct_matmul,
                        r.target,
                        r.met,
                    )
                ]
            )
            + " |"
        )
    errors = [r for r in results if r.error]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {r.kernel} {r.shape}: `{r.error}`" for r in errors]
    return "\n".join(lines) + "\n"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes (the interpreter when there is no GPU)"
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="results root")
    args = parser.parse_args(argv)
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    if unknown := set(only) - set(FAMILIES):
        parser.error(f"unknown families {sorted(unknown)}; choose from {FAMILIES}")

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print(NO_GPU)
        return 0
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are first imported (below)
    import triton
    import triton.testing

    from pipeserve.bench.machine import measure
    from pipeserve.bench.report import machine_info, write_json

    device = torch.device("cuda" if cuda else "cpu")
    rates = measure(device, torch.bfloat16, **({} if cuda else {"copy_bytes": 2**24, "matmul_n": 256}))
    if cuda:
        timer = lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    else:  # the interpreter: one run, for the record only

        def timer(fn: Callable[[], Any]) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

    suite = Suite(device, Scale.tiny() if args.tiny else Scale.full(), rates, timer)
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu (TRITON_INTERPRET=1)"
    bw, mm = rates.copy_bandwidth / 1e9, rates.matmul_flops / 1e12
    print(f"{gpu}: copy {bw:.0f} GB/s, bf16 matmul {mm:.1f} TFLOP/s")
    run_suite(suite, only)

    targets = [r for r in suite.results if r.target is not None]
    checked = [r for r in suite.results if r.ok is not None]
    header = {
        "gpu": gpu,
        "shapes": "tiny" if args.tiny else "Llama-3-8B layer (32 q / 8 kv heads, head_dim 128)",
        "triton": triton.__version__,
        "torch": torch.__version__,
        "measured copy bandwidth GB/s": rates.copy_bandwidth / 1e9,
        "measured bf16 matmul TFLOP/s": rates.matmul_flops / 1e12,
        "checks passed": f"{sum(bool(r.ok) for r in checked)}/{len(checked)}",
        "targets met": f"{sum(bool(r.met) for r in targets)}/{len(targets)}",
    }
    out_dir = Path(args.out) / slug(gpu.split(" (")[0] + ("-tiny" if args.tiny else ""))
    write_json(
        out_dir / "kernels.json",
        {
            "header": header,
            "machine": machine_info(),
            "rates": rates.to_json(),
            "results": [asdict(r) | {"speedup": r.speedup} for r in suite.results],
        },
    )
    (out_dir / "kernels.md").write_text(markdown(suite.results, header))
    print(f"wrote {out_dir / 'kernels.json'} and {out_dir / 'kernels.md'}")
    return 0 if all(r.ok is not False for r in suite.results) else 1


if __name__ == "__main__":
    sys.exit(main())
