"""The CPU backend: torch tuned for the CPU. Same results as the reference backend (reference.py,
up to float rounding), different means:

- Decode attention and the KV store run the native kernels (native.py) where they are built; the
  torch path below serves quantized caches, prefill chunks and hosts without a C++ compiler.
- Attention gathers whole pages with index_select into persistent workspaces (fresh buffers every
  layer cost as much again in page faults) and runs SDPA with 4-D inputs, the only ones that reach
  the CPU flash kernel: decode as one masked call over the batch, with the query heads that share a
  KV head folded into that head's rows; prefill as one call per chunk (padding a batch to the
  longest chunk costs more than the calls), attending a whole-prompt chunk to its fresh K/V instead
  of reading its pages back. head_dim under 16 is zero-padded to 16 for long contexts.
- Values every layer of a step derives alike (decode page index and mask, rope rows) are built once
  per step (step_memo.StepMemo).
- RoPE runs whole-width ops on q and k as one view; RMSNorm takes torch's fused kernel in fp32.
- W8A8 GEMMs run on real int8 / fp8 math (torch._int_mm, torch._scaled_mm).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.engine.quantization.kv_cache import dequantize_kv

from . import native, reference
from .base import Backend, NormOut, NormQuantOut, QuantOut
from .cpu_linear import use_cpu_linears
from .lora_ops import add_lora, add_lora_slots  # noqa: F401 - an op of this backend (collected from vars())
from .step_memo import StepMemo

_WORKSPACE: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A persistent scratch tensor of `shape`, grown (never shrunk) as needed: gathering into fresh
    memory every layer costs twice the copy itself (page faults on each new allocation)."""
    numel = math.prod(shape)
    buf = _WORKSPACE.get((name, dtype, device))
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = _WORKSPACE[name, dtype, device] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def page_index(block_tables: torch.Tensor, max_len: int, page_size: int) -> tuple[torch.Tensor, int]:
    """The pages covering max_len tokens of every row, flattened, and their count per row."""
    pages = (max_len + page_size - 1) // page_size
    return block_tables[:, :pages].reshape(-1), pages


# The compiled step's opaque ops (gather_pages, store_kv), declared to the dispatcher directly:
# torch.library.custom_op's Python wrapper costs more per call than these small ops themselves.
_OPS = torch.library.Library("pipeserve", "FRAGMENT")  # type: ignore[no-untyped-call]
_OPS.define("gather_pages(Tensor cache, Tensor index, str name) -> Tensor")  # type: ignore[no-untyped-call]
_OPS.define("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "  # type: ignore[no-untyped-call]
            "Tensor(c!)? k_scale, Tensor(d!)? v_scale) -> ()")


def _gather_impl(cache: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
    """Whole pages copied by index_select into the workspace `name`. Opaque to the compiler on
    purpose: its own gather loops, into fresh buffers, ran several times slower than this (each
    fresh multi-MB buffer is page-faulted in again)."""
    out = workspace(name, (index.shape[0], *cache.shape[1:]), cache.dtype, cache.device)
    torch.index_select(cache, 0, index, out=out)
    return out


@torch.library.register_fake("pipeserve::gather_pages")  # type: ignore[untyped-decorator]
def _(cache: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
    return cache.new_empty((index.shape[0], *cache.shape[1:]))


_OPS.impl("gather_pages", _gather_impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int,
                 scale: torch.Tensor | None = None, name: str | None = None,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """[P, S, H, D] cache and [B, max_pages] tables -> [B, max_len, H, D] (positions past a
    request's length hold whatever page 0 holds; callers mask them). A quantized cache comes with
    its scale [P, S, H, D // group] and is returned dequantized in fp32. With `name`, the pages land
    in that persistent workspace (valid until the next gather into the same name). `index`: the
    page_index of these tables, when the caller has it already."""
    page_size = cache.shape[1]
    if index is None:
        index, pages = page_index(block_tables, max_len, page_size)
    else:
        pages = index.shape[0] // block_tables.shape[0]
    # index_select copies whole pages (int32 indices as they are); advanced indexing
    # (cache[tables]) goes element by element.
    out: torch.Tensor
    if torch.compiler.is_compiling():
        out = torch.ops.pipeserve.gather_pages(cache, index, name or "gather")
    elif name is None:
        out = cache.index_select(0, index)
    else:
        out = workspace(name, (index.shape[0], *cache.shape[1:]), cache.dtype, cache.device)
        torch.index_select(cache, 0, index, out=out)
    if scale is not None:
        out = dequantize_kv(out, scale.index_select(0, index))
    return out.view(block_tables.shape[0], pages * page_size, *cache.shape[2:])[:, :max_len]


# The CPU flash kernel is slower at head_dim 8 than at 16; zero channels change no score, and below
# ~128 keys the padding costs more than it saves.
_MIN_HEAD_DIM, _PAD_MIN_KEYS = 16, 128


_CAUSAL_BLOCK = 64  # query rows per SDPA call over a long causal prompt


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> [B, Lq, Hq, D] in fp32 (bf16 for bf16 inputs, which
    SDPA's CPU kernel accumulates in fp32 itself, as transformers runs a bf16 model's attention, with
    no upcast copies); causal when mask is None. 4-D inputs on purpose: on the CPU, SDPA takes its
    flash kernel only for those (3-D: math path). docs/engine.md has the measurements."""
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == "cpu"):
        q, k, v = q.float(), k.float(), v.float()
    dim = q.shape[-1]
    if q.device.type == "cpu" and dim < _MIN_HEAD_DIM and k.shape[1] >= _PAD_MIN_KEYS:
        q, k, v = (F.pad(x, (0, _MIN_HEAD_DIM - dim)) for x in (q, k, v))
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    length = q.shape[1]
    if (mask is None and q.device.type == "cpu" and q.dtype == torch.float32 and length >= 2 * _CAUSAL_BLOCK
            and k.shape[1] == length):
        # Causal over a long fp32 prompt: query blocks, each against the keys up to its end with a
        # mask, where the flash kernel's own causal path is the slower one in fp32 (in bf16 it is the
        # faster one, and needs no block copies or masks).
        out = torch.empty(qt.shape[:-1] + (vt.shape[-1],), dtype=q.dtype, device=q.device)
        pos = torch.arange(length, device=q.device)
        for lo in range(0, length, _CAUSAL_BLOCK):
            hi = min(length, lo + _CAUSAL_BLOCK)
            out[:, :, lo:hi] = F.scaled_dot_product_attention(
                qt[:, :, lo:hi], kt[:, :, :hi], vt[:, :, :hi], attn_mask=pos[None, :hi] <= pos[lo:hi, None],
                scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=True)
    return out.transpose(1, 2)[..., :dim]


_DECODE_PLAN = StepMemo()


def _decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, page_size: int,
                 sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Page index and additive key mask [Bd, 1, 1, max_len] of a decode batch (SDPA would turn a
    boolean mask into this one in every layer)."""
    key_pos = torch.arange(max_len, device=seq_lens.device)
    allowed = key_pos < seq_lens[:, None]
    if sliding_window is not None:
        allowed &= key_pos > seq_lens[:, None] - 1 - sliding_window
    mask = torch.zeros(allowed.shape, device=seq_lens.device).masked_fill_(~allowed, float("-inf"))
    return page_index(block_tables, max_len, page_size)[0], mask[:, None, None, :]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, max_seq_len: int | None = None, *,
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [Bd, Hq, D], one query per request at position seq_len - 1.

    The query heads that share a KV head go in as that head's query rows ([Bd, Hkv, G, D]): one
    pass over each gathered KV head instead of G."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if native.supports_decode(q, k_cache, k_scale):
        return native.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
    return torch_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                                  max_seq_len, k_scale=k_scale, v_scale=v_scale)


def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, max_seq_len: int | None = None, *,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention on torch ops alone: quantized caches, hosts without the native kernels, and
    comparisons with them."""
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    page_size = k_cache.shape[1]
    def plan() -> tuple[torch.Tensor, torch.Tensor]:
        return _decode_plan(block_tables, seq_lens, max_len, page_size, sliding_window)

    if torch.compiler.is_compiling():  # the memo is host-side state; the compiler shares the plan itself
        index, mask = plan()
    else:
        index, mask = _DECODE_PLAN.get((block_tables, seq_lens), (max_len, page_size, sliding_window), plan)
    k = gather_pages(k_cache, block_tables, max_len, k_scale, "k", index)
    v = gather_pages(v_cache, block_tables, max_len, v_scale, "v", index)
    batch, heads, dim = q.shape
    rows = q.float().view(batch, k.shape[2], heads // k.shape[2], dim)
    out = F.scaled_dot_product_attention(rows, k.float().transpose(1, 2), v.float().transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    # reshape: CUDA's attention kernels may return their output in another layout than the CPU's.
    return out.reshape(batch, heads, dim).to(q.dtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor,
                      max_q_len: int, max_seq_len: int, scale: float,
                      sliding_window: int | None = None, *, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None,
                      new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [Tp, Hq, D]: chunk i holds rows cu_q_lens[i]:cu_q_lens[i+1], at positions ending at seq_len-1.
    new_kv: the chunks' own K/V rows [Tp, Hkv, D] as store_kv just wrote them; a chunk that is a whole
    prompt attends to those directly instead of reading its pages back (an unquantized cache of the
    same dtype only, where the two are equal).

    One SDPA call per chunk: a padded [Bp, max_q, max_seq] batch costs Bp * max_q * max_seq
    whatever the lengths, and mixed prompt lengths make most of that padding. A bf16 chunk takes
    the AMX prompt kernel where it is built (native.prompt_attention: it skips the
    key blocks past each query block, which SDPA's flash kernel computes and masks); otherwise a
    chunk that is a whole prompt takes SDPA's causal path with no mask, and a later chunk of a prompt
    SDPA with a mask. The lengths are read on the host."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    out = torch.empty_like(q)
    starts, lens = cu_q_lens.tolist(), seq_lens.tolist()
    if new_kv is not None and (k_scale is not None or new_kv[0].dtype != k_cache.dtype):
        new_kv = None
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        if new_kv is not None and hi - lo == seq_len:
            k, v = new_kv[0][None, lo:hi], new_kv[1][None, lo:hi]
        else:
            k = gather_pages(k_cache, block_tables[i : i + 1], seq_len, k_scale, "k")
            v = gather_pages(v_cache, block_tables[i : i + 1], seq_len, v_scale, "v")
        if sliding_window is None and native.supports_prompt_attention(q[lo:hi], k[0], v[0]):
            native.prompt_attention(q[lo:hi], k[0], v[0], scale, out[lo:hi])
            continue
        mask = None
        if hi - lo != seq_len or sliding_window is not None:
            q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)[:, None]
            key_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = key_pos <= q_pos
            if sliding_window is not None:
                mask &= key_pos > q_pos - sliding_window
        out[lo:hi] = _sdpa(q[None, lo:hi], k, v, mask, scale)[0].to(q.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> NormOut:
    """reference.rms_norm, with torch's fused kernel where it does the same arithmetic (fp32)."""
    if x.dim() == 2 and native.supports_rows(x, weight, residual) and weight.is_contiguous():
        return native.rms_norm(x, weight, eps, residual)  # one pass per row instead of five
    if not (x.dtype == torch.float32 and weight.dtype == torch.float32):
        return reference.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
    out = F.rms_norm(x, weight.shape, weight, eps)
    return out if residual is None else (out, x)


_ROTATION = StepMemo()  # the last rope cache's table: caches are built once per model, never written


def _rotation_table(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """[max_pos, 2, rot_dim] (cos|cos, -sin|sin), so that rope is x * cos + roll(x, rot_dim / 2) * sin:
    whole-width ops (the half-width ones run at a third of the speed). torch.roll, not index_select
    with the swapped column order: on the last dimension index_select goes element by element (20x
    slower on a 2048-token prefill)."""
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
    return torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)


_ROWS = StepMemo()


def _rows(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = table.index_select(0, positions)
    return rows[:, None, 0], rows[:, None, 1]


def _heads_together(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hkv, D] view when k's heads directly follow q's in memory (they do
    when both are slices of one fused qkv projection): one set of ops instead of two."""
    if q.dtype != k.dtype or q.stride() != k.stride() or q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hkv, D], rotated in place at their positions (in fp32, as HF)."""
    if q.shape[0] == 0:
        return
    if (native.supports_rows(q, k) and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
            and all(native.rows_packed(x) for x in (q, k))):
        joint = _heads_together(q, k)  # one pass over both when k's heads follow q's
        for x in (q, k) if joint is None else (joint,):
            native.apply_rope(x, positions, cos_sin_cache)
        return
    # Memos and pointer checks are host-side; under the compiler, which fuses the ops anyway, no.
    compiling = torch.compiler.is_compiling()
    if compiling:
        # The table of the positions' rows alone: of the whole cache, the compiled step would
        # rebuild every row, every step.
        table = _rotation_table(cos_sin_cache.index_select(0, positions))
        cos, sin = table[:, None, 0], table[:, None, 1]
    else:
        table = _ROTATION.get((cos_sin_cache,), None, lambda: _rotation_table(cos_sin_cache))
        cos, sin = _ROWS.get((positions, cos_sin_cache), None, lambda: _rows(table, positions))
    rot = table.shape[-1]
    joint = None if compiling else _heads_together(q, k)
    for x in (q, k) if joint is None else (joint,):
        part = x[..., :rot]
        xf = part.float()
        swapped = torch.roll(xf, rot // 2, -1).mul_(sin)
        if xf.dtype == x.dtype:  # fp32: in place
            part.mul_(cos).add_(swapped)
        else:
            part.copy_(xf.mul_(cos).add_(swapped))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul with one temporary, not two (natively: none, one pass)."""
    if x.dim() == 2 and native.supports_rows(x):
        return native.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None,
                   quant_dtype: torch.dtype = torch.int8) -> NormQuantOut:
    return reference.quantized_norm(rms_norm(x, weight, eps, residual), quant_dtype)


def silu_and_mul_quant(x: torch.Tensor, quant_dtype: torch.dtype = torch.int8) -> QuantOut:
    return reference.per_token_quant(silu_and_mul(x), quant_dtype)


def _aligned(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t [R, C] zero-padded up to multiples of rows and cols. CUDA's int8 and fp8 GEMMs take only
    aligned sizes; zero columns add nothing to a dot product and padded rows are cut from the output.
    Through uint8, as fp8 has no pad kernel (its zero is the zero byte)."""
    pad_r, pad_c = -t.shape[0] % rows, -t.shape[1] % cols
    if not (pad_r or pad_c):
        return t
    return F.pad(t.view(torch.uint8), (0, pad_c, 0, pad_r)).view(t.dtype)


def _int_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int8 a [M, K] x w [N, K]^T -> int32 [M, N]. CUDA's kernel wants M > 16 (decode-sized batches
    are padded) and K, N multiples of 8."""
    m, n = a.shape[0], w.shape[0]
    if not a.is_cuda:
        return torch._int_mm(a, w.t())
    a, w = _aligned(a, 1, 8), _aligned(w, 8, 8)
    if m <= 16:
        a = F.pad(a, (0, 0, 0, 17 - m))
    return torch._int_mm(a, w.t())[:m, :n]


def int8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    c = _int_mm(a, w).float() * a_scale * w_scale
    return (c if bias is None else c + bias.float()).to(out_dtype)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    # Row-wise scaled fp8 on CUDA only writes bf16, with K and N multiples of 16; the CPU kernel
    # writes fp32 as well, at any size.
    n = w.shape[0]
    w_scale = w_scale.float().view(1, -1)
    if a.device.type != "cpu" and out_dtype == torch.float32:
        # An fp32 model's products in fp32 (each fp8 product is exact there, as in the fp8 kernels'
        # fp32 accumulators), where the scaled product would round them to bf16.
        c = torch.mm(a.float(), w.float().t()) * a_scale.float() * w_scale
        return c if bias is None else c + bias.float()
    acc_dtype = torch.float32
    if a.device.type != "cpu":
        acc_dtype = torch.bfloat16
        a, w = _aligned(a, 1, 16), _aligned(w, 16, 16)
        w_scale = F.pad(w_scale, (0, w.shape[0] - n), value=1.0)
    c = torch._scaled_mm(a, w.t(), scale_a=a_scale.float(), scale_b=w_scale, out_dtype=acc_dtype)[:, :n]
    return (c if bias is None else c + bias.to(acc_dtype)).to(out_dtype)


def moe(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool, hidden: int,
        expert_mlp: reference.ExpertMLP) -> torch.Tensor:
    """reference.moe sort-based: the token/expert pairs sorted by expert, the rows gathered once,
    expert_mlp(e, rows) on each expert's contiguous slice, the routing weights applied to its rows and
    the top-k summed in one reduction. The per-expert counts are read on the host (cheap on the CPU,
    where there is no device to stall)."""
    weights, ids = reference.moe_route(router_logits, top_k, renormalize)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=router_logits.shape[1]).tolist()
    rows = x.index_select(0, order // top_k)
    out = torch.empty(order.shape[0], hidden, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = expert_mlp(e, rows[start : start + n])
            start += n
    out.mul_(weights.flatten().index_select(0, order)[:, None])
    pairs = torch.empty_like(out).index_copy_(0, order, out)
    return pairs.view(x.shape[0], top_k, hidden).sum(1).to(x.dtype)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """Each expert's GEMMs in the model's dtype."""
    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(rows, w13[e])), w2[e])

    return moe(x, router_logits, top_k, renormalize, w2.shape[1], mlp)


def fused_moe_w8a8(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   w2: torch.Tensor, w2_scale: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """Each expert's MLP on real int8 / fp8 GEMMs, its inputs quantized per token."""
    gemm = int8_gemm if w13.dtype == torch.int8 else fp8_gemm

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        a, a_scale = reference.per_token_quant(rows, w13.dtype)
        h = gemm(a, a_scale, w13[e], w13_scale[e], out_dtype=torch.float32)
        b, b_scale = silu_and_mul_quant(h, w2.dtype)
        return gemm(b, b_scale, w2[e], w2_scale[e], out_dtype=torch.float32)

    return moe(x, router_logits, top_k, renormalize, w2_scale.shape[1], mlp)


@torch.library.register_fake("pipeserve::store_kv")  # type: ignore[untyped-decorator]
def _(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    return None


_OPS.impl("store_kv", reference.store_kv, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """reference.store_kv; under the compiler as one opaque op that writes the cache in place (traced
    as plain torch, the write into the pool's one tensor is rewritten as a copy of the whole pool)."""
    if native.supports_store(k, v, k_cache, k_scale):
        native.store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        torch_store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def torch_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """store_kv on torch ops alone."""
    if torch.compiler.is_compiling():
        torch.ops.pipeserve.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# Where the reference is already what the CPU runs best.
per_token_quant, w4a16_gemm = reference.per_token_quant, reference.w4a16_gemm
fused_moe_w4a16 = reference.fused_moe_w4a16

def prepare_model(model: nn.Module) -> None:
    """Large fp32 linear layers take the packed native product (where the kernels are built)."""
    use_cpu_linears(model)


# Inductor compiles this backend's ops on the CPU; its per-step memos (host-side state) would be
# frozen into a captured CUDA graph, so on CUDA its steps run eager.
BACKEND = Backend.collect("cpu", vars(), prepare_model=prepare_model, compiled_step=(("cpu", "inductor"),),
                          native_step=True)
