"""gpu-check's kernel section: every Triton kernel against its torch reference (the reference backend)
on fresh random inputs, compiled on the GPU (on the CPU: the interpreter, tiny shapes, for tests).
Every buffer a kernel allocates is poisoned first (NaN, or a code no quantizer produces), so an
element it fails to write makes the error infinite; caches are poisoned except where the reference
wrote them. One row per kernel variant: relative error max|out - ref| / max|ref| against the bound of
the precision its output is computed in (report.THRESHOLDS)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from pipeserve.engine.backend import get_backend
from pipeserve.engine.model.rope import rope_cache
from pipeserve.engine.quantization.weights import quantize_int4, quantize_nf4, quantize_per_channel

from .report import THRESHOLDS, CorrectnessRow
from .runner import Context

BF16, F16, F32, I8, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn
PRECISION = {BF16: "bf16", F16: "fp16", F32: "fp32", I8: "int8", FP8: "fp8"}
Pair = tuple[torch.Tensor, torch.Tensor]  # (kernel output, reference)
INT8_POISON = -128  # never produced: the quantizers clamp to [-127, 127]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with values a correct kernel never leaves behind: NaN for floats, -128 for int8."""
    if t.dtype == FP8:
        t.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    elif t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == I8:
        t.fill_(INT8_POISON)
    else:
        t.fill_(torch.iinfo(t.dtype).min)
    return t


@contextmanager
def poisoned() -> Iterator[None]:
    """Every torch.empty / torch.empty_like inside returns poisoned memory."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: poison_(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison_(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref|; inf when out has a non-finite element or the wrong shape."""
    if out.shape != ref.shape:
        return math.inf
    out64, ref64 = out.double(), ref.double()
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    return float((out64 - ref64).abs().max() / ref64.abs().max().clamp_min(1e-12))


def dequant(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.double() * scale.double()


@dataclass
class Case:
    name: str
    precision: str  # a key of THRESHOLDS
    run: Callable[[], Pair]


@dataclass
class Sizes:
    """Shapes of the cases: GPU-sized, or tiny for the interpreter."""

    tokens: int
    hidden: int
    inter: int
    heads: tuple[int, int, int]  # q heads, kv heads, head_dim
    seq_lens: tuple[int, ...]
    page_size: int
    gemm: tuple[int, int]  # N, K
    gemm_m: tuple[int, ...]
    experts: tuple[int, int, int, int]  # experts, top_k, hidden, inter
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def for_device(cls, device: torch.device) -> Sizes:
        if device.type == "cuda":
            return cls(64, 4096, 14336, (32, 8, 128), (1, 17, 300, 1100), 16, (4096, 4096), (1, 16, 512),
                       (8, 2, 1024, 512), (BF16, F32))
        # The interpreter's bf16 arithmetic is wrong (it truncates): fp32 activations only.
        return cls(5, 64, 48, (4, 2, 16), (1, 5, 19), 4, (48, 256), (3,), (4, 2, 64, 96), (F32,))


def kernel_cases(device: torch.device, seed: int = 0) -> list[Case]:
    """Every kernel variant, inputs drawn from one generator on `device`."""
    tri, ref = get_backend("triton"), get_backend("reference")
    sizes = Sizes.for_device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = F32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    cases: list[Case] = []
    hq, hkv, d = sizes.heads
    t, h = sizes.tokens, sizes.hidden
    n, k = sizes.gemm

    # The paged KV cache: the reference store writes every request's K/V; the rest stays poisoned.
    def paged(dtype: torch.dtype, kv: torch.dtype | None) -> dict[str, torch.Tensor]:
        ps, lens = sizes.page_size, sizes.seq_lens
        pages = [-(-n // ps) for n in lens]
        num_pages = sum(pages) + 1
        perm = torch.randperm(num_pages, generator=gen, device=device)
        tables = torch.full((len(lens), max(pages)), int(perm[-1]), dtype=torch.int32, device=device)
        slots, start = [], 0
        for i, (n, p) in enumerate(zip(lens, pages, strict=True)):
            tables[i, :p] = perm[start:start + p]
            start += p
            pos = torch.arange(n, device=device)
            slots.append(tables[i, pos // ps].long() * ps + pos % ps)
        slot_mapping = torch.cat(slots)
        shape = (num_pages, ps, hkv, d)
        cache = {name: poison_(torch.empty(shape, dtype=kv or dtype, device=device)) for name in ("k", "v")}
        scales: dict[str, torch.Tensor] = {}
        if kv is not None:
            scales = {f"{name}_scale": poison_(torch.empty(*shape[:-1], d // 8, dtype=F16, device=device))
                      for name in ("k", "v")}
        k, v = randn(len(slot_mapping), hkv, d, dtype=dtype), randn(len(slot_mapping), hkv, d, dtype=dtype)
        ref.store_kv(k, v, cache["k"], cache["v"], slot_mapping, scales.get("k_scale"), scales.get("v_scale"))
        return {"k_cache": cache["k"], "v_cache": cache["v"], **scales, "block_tables": tables,
                "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device), "slots": slot_mapping,
                "k": k, "v": v}

    def cache_values(c: dict[str, torch.Tensor], which: str) -> torch.Tensor:
        """The written slots of one cache, dequantized."""
        flat = c[f"{which}_cache"].flatten(0, 1)[c["slots"]]
        if f"{which}_scale" not in c:
            return flat
        s = c[f"{which}_scale"].flatten(0, 1)[c["slots"]]
        return (flat.double().unflatten(-1, (s.shape[-1], -1)) * s.double()[..., None]).flatten(-2)

    for dtype in sizes.dtypes:
        for kv in (None, I8, FP8):
            tag = f"{PRECISION[dtype]} kv={PRECISION.get(kv, 'same') if kv else 'same'}"
            qkey = PRECISION[dtype]

            def store(dtype: torch.dtype = dtype, kv: torch.dtype | None = kv) -> Pair:
                want = paged(dtype, kv)
                got = {**want}
                for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
                    if name in want:
                        got[name] = poison_(torch.empty_like(want[name]))
                tri.store_kv(want["k"], want["v"], got["k_cache"], got["v_cache"], want["slots"],
                             got.get("k_scale"), got.get("v_scale"))
                return (torch.cat([cache_values(got, "k"), cache_values(got, "v")]),
                        torch.cat([cache_values(want, "k"), cache_values(want, "v")]))

            cases.append(Case(f"store_kv {tag}", PRECISION[kv] if kv else qkey, store))

            def decode(dtype: torch.dtype = dtype, kv: torch.dtype | None = kv,
                       splits: int | None = None, window: int | None = None) -> Pair:
                c = paged(dtype, kv)
                q = randn(len(sizes.seq_lens), hq, d, dtype=dtype)
                args = (q, c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"], d ** -0.5, window)
                scales: dict[str, Any] = {k: c[k] for k in ("k_scale", "v_scale") if k in c}
                with poisoned():
                    out = tri.decode_attention(*args, **scales) if splits is None else \
                        decode_kernel(*args, **scales, num_splits=splits)
                return out, ref.decode_attention(*args, **scales)

            cases.append(Case(f"decode_attention {tag}", qkey, decode))
            cases.append(Case(f"decode_attention {tag} 4 splits", qkey, partial(decode, splits=4)))
            cases.append(Case(f"decode_attention {tag} window 7", qkey, partial(decode, window=7)))

            def prefill(dtype: torch.dtype = dtype, kv: torch.dtype | None = kv,
                        window: int | None = None) -> Pair:
                c = paged(dtype, kv)
                lens = sizes.seq_lens
                q_lens = [max(1, n // 2) if i % 2 else n for i, n in enumerate(lens)]  # chunks after a prefix
                cu = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
                q = randn(sum(q_lens), hq, d, dtype=dtype)
                args = (q, c["k_cache"], c["v_cache"], c["block_tables"], cu, c["seq_lens"], max(q_lens),
                        max(lens), d ** -0.5, window)
                scales: dict[str, Any] = {k: c[k] for k in ("k_scale", "v_scale") if k in c}
                with poisoned():
                    out = tri.prefill_attention(*args, **scales)
                return out, ref.prefill_attention(*args, **scales)

            cases.append(Case(f"prefill_attention {tag}", qkey, prefill))
            cases.append(Case(f"prefill_attention {tag} window 7", qkey, partial(prefill, window=7)))

        key = PRECISION[dtype]

        def norm(dtype: torch.dtype = dtype, residual: bool = False) -> Pair:
            x, w = randn(t, h, dtype=dtype), randn(h, dtype=dtype, scale=0.5)
            r = randn(t, h, dtype=dtype) if residual else None
            with poisoned():
                out = tri.rms_norm(x, w, 1e-5, r)
            want = ref.rms_norm(x, w, 1e-5, r)
            if residual:
                return torch.cat([o.flatten() for o in out]), torch.cat([o.flatten() for o in want])
            return out, want  # type: ignore[return-value]

        cases.append(Case(f"rms_norm {key}", key, norm))
        cases.append(Case(f"rms_norm residual {key}", key, partial(norm, residual=True)))

        def silu(dtype: torch.dtype = dtype) -> Pair:
            x = randn(t, 2 * sizes.inter, dtype=dtype)
            with poisoned():
                out = tri.silu_and_mul(x)
            return out, ref.silu_and_mul(x)

        cases.append(Case(f"silu_and_mul {key}", key, silu))

        def rope(dtype: torch.dtype = dtype) -> Pair:
            q, k = randn(t, hq, d, dtype=dtype), randn(t, hkv, d, dtype=dtype)
            positions = torch.randint(0, 4096, (t,), generator=gen, device=device)
            cs = rope_cache(d, 4096, 5e5, None, device)
            q2, k2 = q.clone(), k.clone()
            tri.apply_rope(q, k, positions, cs)
            ref.apply_rope(q2, k2, positions, cs)
            return torch.cat([q.flatten(), k.flatten()]), torch.cat([q2.flatten(), k2.flatten()])

        cases.append(Case(f"apply_rope {key}", key, rope))

        for q_dtype in (I8, FP8):
            qkey = PRECISION[q_dtype]

            def quant(op: str, dtype: torch.dtype = dtype, q_dtype: torch.dtype = q_dtype) -> Pair:
                if op == "silu_and_mul_quant":
                    args: tuple[object, ...] = (randn(t, 2 * sizes.inter, dtype=dtype),)
                elif op == "per_token_quant":
                    args = (randn(t, h, dtype=dtype),)
                else:
                    args = (randn(t, h, dtype=dtype), randn(h, dtype=dtype, scale=0.5), 1e-5, None)
                with poisoned():
                    codes, scale = getattr(tri, op)(*args, q_dtype)[:2]
                want_codes, want_scale = getattr(ref, op)(*args, q_dtype)[:2]
                return dequant(codes, scale), dequant(want_codes, want_scale)

            for op in ("per_token_quant", "rms_norm_quant", "silu_and_mul_quant"):
                cases.append(Case(f"{op} {key} -> {qkey}", qkey, partial(quant, op)))

        # Weight-only 4-bit GEMMs: the same packed weights on both sides; fp32 activations take exact
        # (ieee) dots, bounded as tf32 all the same.
        for m in sizes.gemm_m:
            for fmt in ("int4", "nf4"):
                def w4(m: int = m, fmt: str = fmt, dtype: torch.dtype = dtype) -> Pair:
                    a, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype, scale=0.05)
                    packed = quantize_int4(w) if fmt == "int4" else (*quantize_nf4(w), None)
                    with poisoned():
                        out = tri.w4a16_gemm(a, *packed)
                    return out, ref.w4a16_gemm(a, *packed)

                cases.append(Case(f"w4a16_gemm {fmt} {key} M={m}", "tf32" if dtype == F32 else key, w4))

    # W8A8 GEMMs on the same codes: exact int8 / fp32 sums, output rounded to bf16.
    for m in sizes.gemm_m:
        for q_dtype in (I8, FP8):
            def w8(m: int = m, q_dtype: torch.dtype = q_dtype) -> Pair:
                out_dtype = BF16 if device.type == "cuda" else F32
                a, a_scale = ref.per_token_quant(randn(m, k), q_dtype)
                w, w_scale = quantize_per_channel(randn(n, k, scale=0.05), q_dtype)
                bias = randn(n, dtype=out_dtype)
                op = "int8_gemm" if q_dtype == I8 else "fp8_gemm"
                with poisoned():
                    out = getattr(tri, op)(a, a_scale, w, w_scale, bias, out_dtype)
                return out, getattr(ref, op)(a, a_scale, w, w_scale, bias, out_dtype)

            precision = "bf16" if device.type == "cuda" else "fp32"
            cases.append(Case(f"{PRECISION[q_dtype]}_gemm M={m}", precision, w8))

    cases += moe_cases(device, sizes, randn, gen)
    return cases


def decode_kernel(*args: object, **kwargs: object) -> torch.Tensor:
    """The decode kernel with its split count forced (the backend op picks its own)."""
    from pipeserve.engine.triton_kernels.decode_attention import decode_attention

    return decode_attention(*args, **kwargs)  # type: ignore[arg-type]


def moe_cases(device: torch.device, sizes: Sizes, randn: Callable[..., torch.Tensor],
              gen: torch.Generator) -> list[Case]:
    """The fused MoE: routing, alignment and both grouped GEMMs, float and quantized experts, at a
    decode-sized and a prefill-sized token count."""
    from pipeserve.engine.quantization.experts import W4A16Experts, W8A8Experts

    tri, ref = get_backend("triton"), get_backend("reference")
    e, top_k, hidden, inter = sizes.experts
    cases = []
    for tokens in sorted({2, sizes.tokens * 4}):
        for method in ("float", "int8", "fp8", "int4", "nf4"):
            def moe(method: str = method, tokens: int = tokens) -> Pair:
                dtype = sizes.dtypes[0]
                x = randn(tokens, hidden, dtype=dtype)
                logits = randn(tokens, e, dtype=dtype)
                w13, w2 = randn(e, 2 * inter, hidden, dtype=dtype, scale=0.05), randn(e, hidden, inter,
                                                                                      dtype=dtype, scale=0.05)
                weights: tuple[Any, ...]
                if method == "float":
                    name, weights = "fused_moe", (w13, w2)
                elif method in ("int8", "fp8"):
                    q = W8A8Experts(w13, w2, top_k, True, I8 if method == "int8" else FP8, ref)
                    name, weights = "fused_moe_w8a8", (q.w13, q.w13_scale, q.w2, q.w2_scale)
                else:
                    q4 = W4A16Experts(w13, w2, top_k, True, method, ref)
                    name, weights = "fused_moe_w4a16", (q4.w13, q4.w13_scales, q4.w13_zeros, q4.w2,
                                                        q4.w2_scales, q4.w2_zeros)
                with poisoned():
                    out = getattr(tri, name)(x, logits, *weights, top_k, True)
                return out, getattr(ref, name)(x, logits, *weights, top_k, True)

            dkey = PRECISION[sizes.dtypes[0]]
            precision = {"int8": "int8 twice", "fp8": "fp8"}.get(method, dkey)
            cases.append(Case(f"fused_moe {method} {dkey} T={tokens}", precision, moe))
    return cases


def check_case(case: Case) -> CorrectnessRow:
    """Run one case; an exception is a failed row with its reason."""
    try:
        out, want = case.run()
        err = rel_error(out, want)
    except Exception as exc:  # one broken kernel must not hide the others
        return CorrectnessRow(f"kernel {case.name}", False, None, THRESHOLDS[case.precision],
                              f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    return CorrectnessRow.measured(f"kernel {case.name}", err, THRESHOLDS[case.precision],
                                   "unwritten or non-finite output" if math.isinf(err) else "")


def run(ctx: Context) -> None:
    device = torch.device(ctx.device)
    for case in kernel_cases(device):
        ctx.row(check_case(case))
