"""The CPU backend's native kernels, built once per source and host with the C++ compiler and loaded
through ctypes: the paged KV store and decode attention (csrc/paged_attention.cpp), the product
with an fp32 or bf16 weight packed at load time (csrc/packed_gemm.cpp; fp32 accumulation), and a
whole step of a dense fp32 or bf16 model built from them, LoRA adapters included (csrc/decode_step.cpp,
driven by engine/executor/native.py). Which instructions the products use follows from the host's
flags at build time (`isa()`, logged when the library loads).

Decode attention in torch must first copy every row's pages into one tensor (index_select) and then
run SDPA over it with a mask; the native kernel reads each key and value once, straight from its
page, with no copy, no mask and one call per layer. The source is plain C++ (no torch headers), so
the build takes about a second; the library lands in the project cache, named by a hash of the
source, the flags and the host's CPU features (`-march=native`: a cache shared between machines
must not hand one host another's instructions), and later processes load it directly. Without a
compiler (`g++`, or `$CXX`) the backend keeps its torch path: `available()` says which.

Library GEMMs (MKL) repack the weight on every call, which for the few to a few dozen rows of a
decode step costs more than the product; the packed product takes the weight packed once
(backend/cpu_linear.py packs the model's linear layers).

Every kernel is also a torch op (`pipeserve::native_decode_attention`, `pipeserve::native_store_kv`,
`pipeserve::native_packed_linear`) so a compiled step calls them as opaque ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pipeserve.config import cache_dir
from pipeserve.engine.host_memory import huge_page_tensors

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_attention.cpp", "packed_gemm.cpp", "decode_step.cpp",
                                          "rowwise.cpp", "prompt_attention.cpp"))
HEADERS = (CSRC / "vec_math.h", CSRC / "simd.h", CSRC / "amx.h", CSRC / "scratch.h")
PANEL = 16  # output columns per panel of a packed weight (packed_gemm.cpp's kLanes)
# The reductions (dot products, softmax sums) vectorize only when they may be reordered. Not
# -ffast-math: a library linked with it switches the whole process to flush denormals to zero.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_GROUP = 64  # query heads per KV head (the kernel's kMaxGroup)

_lib: ctypes.CDLL | None = None
_tried = False


def compiler() -> str | None:
    """The host's C++ compiler ($CXX, else g++), which builds these kernels and Inductor's code."""
    return shutil.which(os.environ.get("CXX") or "g++")


def _host() -> str:
    """What -march=native compiles for: the CPU's feature flags where Linux lists them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def _build(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The library for these sources, flags and host, compiled unless the cache has it."""
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(source + " ".join((compiler, *flags, _host())).encode()).hexdigest()[:16]
    target = Path(cache_dir()) / "native" / f"kernels-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: concurrent engines never load a partial file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run([compiler, *flags, "-o", str(partial), *map(str, SOURCES)], check=True,
                       capture_output=True, text=True)
        os.replace(partial, target)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    compiler_path = compiler()
    if compiler_path is None:
        log.warning("no C++ compiler (g++, or $CXX) on this host: the cpu backend's attention runs on "
                    "torch ops")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler_path)))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        log.warning("building the native CPU kernels failed; attention runs on torch ops: %s", detail)
        return None
    _lib = _declare(lib)
    log.info("native CPU kernels: %s", isa())
    return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library's functions with their C signatures."""
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.pipeserve_decode_attention.argtypes = [i32, ptr, i64, ptr, ptr, i32, i32, i32, ptr, i64, ptr, i32,
                                               i32, f32, i32, ptr, i32]
    lib.pipeserve_decode_attention.restype = None
    lib.pipeserve_store_kv.argtypes = [i32, ptr, ptr, i64, i64, ptr, ptr, ptr, i32, i64]
    lib.pipeserve_store_kv.restype = None
    lib.pipeserve_prompt_attention_supported.argtypes = [i32]
    lib.pipeserve_prompt_attention_supported.restype = i32
    lib.pipeserve_prompt_attention.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i32, i32,
                                               i32, f32, i32]
    lib.pipeserve_prompt_attention.restype = None
    lib.pipeserve_pack_weight.argtypes = [ptr, i64, i64, ptr]
    lib.pipeserve_pack_weight.restype = None
    lib.pipeserve_packed_linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.pipeserve_packed_linear.restype = None
    lib.pipeserve_pack_weight_bf16.argtypes = [ptr, i64, i64, ptr]
    lib.pipeserve_pack_weight_bf16.restype = None
    lib.pipeserve_packed_linear_bf16.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.pipeserve_packed_linear_bf16.restype = None
    lib.pipeserve_isa.argtypes = []
    lib.pipeserve_isa.restype = i32
    lib.pipeserve_decode_step.argtypes = [ptr, f32, f32, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr,
                                          i64, ptr, i32, ptr, ptr, ptr, ptr, i32]
    lib.pipeserve_decode_step.restype = None
    lib.pipeserve_rms_norm_rows.argtypes = [i32, ptr, i64, ptr, i64, ptr, f32, ptr, ptr, i64, i64, i32]
    lib.pipeserve_rms_norm_rows.restype = None
    lib.pipeserve_silu_and_mul_rows.argtypes = [i32, ptr, i64, ptr, i64, i64, i32]
    lib.pipeserve_silu_and_mul_rows.restype = None
    lib.pipeserve_rope_rows.argtypes = [i32, ptr, i64, i32, i32, ptr, i64, ptr, i64, i32, i32]
    lib.pipeserve_rope_rows.restype = None
    return lib


def available() -> bool:
    """Whether the native kernels are built and loaded."""
    return _load() is not None


def isa() -> str:
    """Which instructions the packed products run, as the build for this host's CPU flags chose."""
    lib = _load()
    if lib is None:
        return "not built"
    bits = lib.pipeserve_isa()
    fp32 = "AVX-512F" if bits & 1 else "AVX2 FMA" if bits & 8 else "portable loops"
    bf16 = ("AVX512-BF16 dot products" if bits & 2 else "AVX2 FMA (widened to fp32)" if bits & 8
            else "portable loops")
    if bits & 4:
        bf16 += " (one row), AMX tiles (more)"
    return f"fp32 products on {fp32}, bf16 products on {bf16}"


def rows_packed(x: torch.Tensor) -> bool:
    """[T, H, D] whose rows may be strided but whose heads and channels are packed."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def supports_decode(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether decode_attention takes these inputs (an unquantized, contiguous CPU cache)."""
    return (q.device.type == "cpu" and k_scale is None and k_cache.dtype in CACHE_DTYPES
            and k_cache.is_contiguous() and q.shape[1] // k_cache.shape[2] <= MAX_GROUP and available())


def supports_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether prompt_attention takes these rows (q [Tq, Hq, D], k and v [Tk, Hkv, D], Tk >= Tq): bf16
    on the CPU, heads and channels packed, a head_dim the AMX kernel takes (AMX built and granted
    here), not under the compiler."""
    lib = _lib if available() else None
    return (lib is not None and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.bfloat16
            and all(rows_packed(x) for x in (q, k, v)) and q.shape[1] % k.shape[1] == 0
            and k.shape == v.shape and k.shape[0] >= q.shape[0] and not torch.compiler.is_compiling()
            and bool(lib.pipeserve_prompt_attention_supported(q.shape[2])))


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     out: torch.Tensor) -> None:
    """Causal attention of one prompt's last Tq positions, q [Tq, Hq, D], over its keys and values
    k, v [Tk, Hkv, D] (the whole prompt when Tq == Tk), into out [Tq, Hq, D] (bf16, rows may be
    strided). Call when supports_prompt_attention(q, k, v)."""
    lib = _lib
    assert lib is not None and rows_packed(out) and out.shape == q.shape and out.dtype == torch.bfloat16
    length, heads, dim = q.shape
    lib.pipeserve_prompt_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                   v.stride(0), out.data_ptr(), out.stride(0), length, k.shape[0], heads,
                                   k.shape[1], dim, scale, torch.get_num_threads())


def supports_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   k_scale: torch.Tensor | None) -> bool:
    return (k.device.type == "cpu" and k_scale is None and k_cache.dtype in CACHE_DTYPES
            and k.dtype == k_cache.dtype == v.dtype and k_cache.is_contiguous()
            and rows_packed(k) and rows_packed(v) and available())


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packed_numel(n: int, k: int, dtype: torch.dtype) -> int:
    """Elements of a packed [n, k] weight: fp32 as ceil(n / 16) panels of [k, 16]; bf16 as ceil(n / 16)
    panels of [ceil(k / 32) * 16, 16, 2] (pairs of k per output column)."""
    panels = -(-n // PANEL) * PANEL
    return panels * k if dtype == torch.float32 else panels * -(-k // 32) * 32


def pack_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """An fp32 or bf16 CPU weight [N, K] in packed_linear's layout (packed_numel), flat, in its dtype,
    zeros past N and K; written into out (flat, contiguous, that size and dtype) where given.
    Call when available()."""
    lib = _lib
    assert lib is not None and weight.dtype in PACKED_DTYPES and weight.device.type == "cpu"
    w = weight.detach().contiguous()
    n, k = w.shape
    numel = packed_numel(n, k, w.dtype)
    packed = torch.empty(numel, dtype=w.dtype) if out is None else out
    assert packed.shape == (numel,) and packed.dtype == w.dtype and packed.is_contiguous()
    pack = lib.pipeserve_pack_weight if w.dtype == torch.float32 else lib.pipeserve_pack_weight_bf16
    pack(w.data_ptr(), n, k, packed.data_ptr())
    return packed


def pack_weights(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """pack_weight of each, all in one region on transparent huge pages (engine/host_memory.py): a
    decode step streams a model's packed weights, and one core reads huge pages faster."""
    regions = huge_page_tensors([(packed_numel(w.shape[0], w.shape[1], w.dtype), w.dtype) for w in weights])
    return [pack_weight(w, out) for w, out in zip(weights, regions, strict=True)]


def _packed_linear_impl(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                        n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    lib = _lib
    assert lib is not None
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    if out is None:
        out = torch.empty((rows, n), dtype=torch.float32)
    assert out.shape == (rows, n) and out.dtype == torch.float32 and out.is_contiguous()
    fn = lib.pipeserve_packed_linear if packed.dtype == torch.float32 else lib.pipeserve_packed_linear_bf16
    fn(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
       out.data_ptr(), rows, n, k, torch.get_num_threads())
    return out


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of rows x [M, K] with the weight [n, K] that pack_weight packed (fp32 or bf16), in
    fp32 (rows taken as fp32; a bf16 weight's product rounds them to bf16); bias [n] fp32,
    contiguous, or None. out: a contiguous fp32 [M, n] to write (eager only), else a new tensor."""
    if torch.compiler.is_compiling():
        assert out is None, "the compiled op returns a new tensor"
        compiled: torch.Tensor = torch.ops.pipeserve.native_packed_linear(x, packed, bias, n)
        return compiled
    return _packed_linear_impl(x, packed, bias, n, out)


def _decode_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    lib = _lib
    assert lib is not None
    qf = q if q.dtype == torch.float32 else q.float()
    if not rows_packed(qf):
        qf = qf.contiguous()
    batch, heads, dim = qf.shape
    out = torch.empty((batch, heads, dim), dtype=torch.float32)
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()
    assert tables.stride(1) == 1 and lens.is_contiguous()
    lib.pipeserve_decode_attention(
        CACHE_DTYPES[k_cache.dtype], qf.data_ptr(), qf.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.shape[1], k_cache.shape[2], dim, tables.data_ptr(), tables.stride(0), lens.data_ptr(), batch,
        heads, scale, window, out.data_ptr(), torch.get_num_threads())
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _store_impl(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    lib = _lib
    assert lib is not None
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    k, v = (x if rows_packed(x) else x.contiguous() for x in (k, v))
    assert slots.is_contiguous()
    lib.pipeserve_store_kv(k.element_size(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0),
                           k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k.shape[0],
                           k.shape[1] * k.shape[2])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] in q's dtype; each row attends to its first seq_len keys (the last
    sliding_window of them, when set). Call when supports_decode()."""
    window = sliding_window or 0
    if torch.compiler.is_compiling():
        out: torch.Tensor = torch.ops.pipeserve.native_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, window)
        return out
    return _decode_impl(q, k_cache, v_cache, block_tables, seq_lens, scale, window)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Rows [T, Hkv, D] into the cache [P, S, Hkv, D] at their slots. Call when supports_store()."""
    if k.shape[0] == 0:
        return
    if torch.compiler.is_compiling():
        torch.ops.pipeserve.native_store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        _store_impl(k, v, k_cache, v_cache, slot_mapping)


# Declared to the dispatcher directly (torch.library.custom_op's wrapper costs more per call).
_OPS = torch.library.Library("pipeserve", "FRAGMENT")  # type: ignore[no-untyped-call]
_OPS.define("native_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "  # type: ignore[no-untyped-call]
            "Tensor seq_lens, float scale, int window) -> Tensor")
_OPS.define("native_store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "  # type: ignore[no-untyped-call]
            "Tensor slot_mapping) -> ()")
_OPS.define("native_packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor")  # type: ignore[no-untyped-call]
_OPS.impl("native_decode_attention", _decode_impl, "CPU")  # type: ignore[no-untyped-call]
_OPS.impl("native_packed_linear", _packed_linear_impl, "CPU")  # type: ignore[no-untyped-call]
_OPS.impl("native_store_kv", _store_impl, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("pipeserve::native_decode_attention")  # type: ignore[untyped-decorator]
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
      seq_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("pipeserve::native_packed_linear")  # type: ignore[untyped-decorator]
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


@torch.library.register_fake("pipeserve::native_store_kv")  # type: ignore[untyped-decorator]
def _(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
      slot_mapping: torch.Tensor) -> None:
    return None


# Row-wise kernels for the per-op path (rowwise.cpp): eager steps only, fp32 or bf16 rows packed in
# their last dimension. Under the compiler the torch ops stay (Inductor fuses them itself).
ROW_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supports_rows(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the row-wise kernels take these tensors: all of x's dtype (fp32 or bf16) on the CPU,
    channels contiguous, not compiling, the library built."""
    return (not torch.compiler.is_compiling() and x.dtype in ROW_DTYPES
            and all(t is None or (t.dtype == x.dtype and t.device.type == "cpu" and t.stride(-1) == 1)
                    for t in (x, *others))
            and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of rows x [T, n] (after residual is added: then (normed, x + residual)), in x's dtype.
    Call when supports_rows(x, weight, residual) and x, residual are 2-D, weight contiguous."""
    lib = _lib
    assert lib is not None and x.dim() == 2 and weight.is_contiguous()
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype)
    resid = None if residual is None else torch.empty((rows, n), dtype=x.dtype)
    lib.pipeserve_rms_norm_rows(ROW_DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                                None if residual is None else residual.data_ptr(),
                                0 if residual is None else residual.stride(0), weight.data_ptr(), eps,
                                out.data_ptr(), None if resid is None else resid.data_ptr(), rows, n,
                                torch.get_num_threads())
    return out if resid is None else (out, resid)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :inter]) * x[:, inter:] of rows x [T, 2 * inter], in x's dtype. Call when
    supports_rows(x), x 2-D."""
    lib = _lib
    assert lib is not None and x.dim() == 2
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    lib.pipeserve_silu_and_mul_rows(ROW_DTYPES[x.dtype], x.data_ptr(), x.stride(0), out.data_ptr(), rows,
                                    inter, torch.get_num_threads())
    return out


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate-half RoPE of x [T, H, D] in place (rows strided, heads packed), row t at positions[t] of
    the fp32 table [max_pos, rot_dim] (cos then sin). Call when supports_rows(x) and rows_packed(x)."""
    lib = _lib
    assert lib is not None and rows_packed(x) and cos_sin_cache.is_contiguous()
    assert cos_sin_cache.dtype == torch.float32
    pos = positions.long().contiguous()  # no copy when already int64 and contiguous
    lib.pipeserve_rope_rows(ROW_DTYPES[x.dtype], x.data_ptr(), x.stride(0), x.shape[1], x.shape[2],
                            cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), pos.data_ptr(), x.shape[0],
                            cos_sin_cache.shape[1], torch.get_num_threads())
