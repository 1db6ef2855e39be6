"""What every kernel launcher needs: interpreter detection, dtype mapping, tile sizes and an autotune
wrapper that falls back to one fixed config under TRITON_INTERPRET=1 (autotune needs a GPU driver)."""
# Triton reads a jit function's parameter annotations as its signature: its parameters stay untyped.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"


from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (Triton's own setting, not ours to choose)."""
    return bool(triton.knobs.runtime.interpret)


_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.int8: tl.int8,
    torch.float8_e4m3fn: tl.float8e4nv,
}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return _TL_DTYPES[dtype]


def compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype for tl.dot: the activations' half type on a GPU; fp32 under the interpreter,
    whose bf16 arithmetic and bf16 dots are wrong."""
    if interpreting() or dtype == torch.float32:
        return tl.float32
    return tl_dtype(dtype)


def dot_precision(compute: tl.dtype) -> str:
    """fp32 dots default to tf32 on a GPU; keep them exact (they only run for fp32 models)."""
    return "ieee" if compute == tl.float32 else "tf32"


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, int(triton.next_power_of_2(n)))


# Triton's e4m3 type (tl.float8e4nv) needs Ada or Hopper; Ampere has only e5m2 and e4b15.
FP8_MIN_CAPABILITY = (8, 9)


@cache
def capability(device_index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device_index)
    return major, minor


def check_fp8(dtype: torch.dtype | None, device: torch.device) -> None:
    """ValueError, at the launch that would need it, where an fp8 (e4m3) kernel cannot compile: a
    CUDA GPU below sm_89 (with CUDA graphs the engine meets it warming up, before it serves)."""
    if dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    major, minor = capability(device.index if device.index is not None else torch.cuda.current_device())
    if (major, minor) < FP8_MIN_CAPABILITY:
        raise ValueError(f"fp8 (e4m3) kernels need a GPU of sm_89 or newer (Ada, Hopper); this one is "
                         f"sm_{major}{minor}: use int8 (--kv-cache-dtype int8, --quantization w8a8-int8)")


@cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 on the CPU, where the interpreter runs programs
    one after another and extra ones only cost time."""
    if device.type != "cuda":
        return 1
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


class Fixed:
    """Launches a jit kernel with one config: the interpreter's stand-in for triton.autotune.
    `config` is a plain attribute so tests can pin another config (e.g. split-K)."""

    def __init__(self, fn: Any, config: triton.Config) -> None:
        self.fn = fn
        self.config = config

    def __getitem__(
        self, grid: Callable[[dict[str, Any]], tuple[int, ...]] | tuple[int, ...]
    ) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            meta = {**dict(zip(self.fn.arg_names, args, strict=False)), **kwargs, **self.config.kwargs}
            resolved = grid(meta) if callable(grid) else grid
            return self.fn[resolved](*args, **kwargs, **self.config.kwargs)

        return launch


def autotune(
    configs: list[triton.Config], key: list[str], interpret_config: triton.Config, **kwargs: Any
) -> Callable[[Any], Any]:
    """triton.autotune on a GPU, Fixed(interpret_config) under the interpreter."""

    def wrap(fn: Any) -> Any:
        if interpreting():
            return Fixed(fn, interpret_config)
        return triton.autotune(configs=configs, key=key, **kwargs)(fn)

    return wrap


@triton.jit
def tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order for GEMMs: GROUP_M row tiles sweep the columns together, so the weight
    tiles they share stay in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = pid // width * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


def gemm_configs(shapes: list[tuple[int, int, int, int, int]]) -> list[triton.Config]:
    """Autotune configs from (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


GEMM_INTERPRET_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2})


def gemm_autotune(shapes: list[tuple[int, int, int, int, int]], key: list[str],
                  prune: Callable[..., list[triton.Config]] | None = None) -> Callable[[Any], Any]:
    """Autotuning for a GEMM kernel with gemm_grid's launch grid: tile heights pruned by M (and by
    `prune`, when given, first), the split-K output zeroed between trials."""

    def early_prune(configs: list[triton.Config], named_args: dict[str, Any],
                    **kwargs: Any) -> list[triton.Config]:
        return prune_by_m(prune(configs, named_args, **kwargs) if prune else configs, named_args, **kwargs)

    return autotune(gemm_configs(shapes), key=["M_BUCKET", "N", "K", "SPLIT_K", *key],
                    interpret_config=GEMM_INTERPRET_CONFIG,
                    prune_configs_by={"early_config_prune": early_prune}, reset_to_zero=["c_ptr"])


@triton.jit
def gemm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output rows rm, columns rn and K split (gemm_grid's launch)."""
    pid_m, pid_n = tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, tl.program_id(1)


@triton.jit
def gemm_store(c_ptr, c, rm, rn, M, N, stride_cm, SPLIT_K: tl.constexpr):
    """Write an output tile, or add it atomically (fp32) when K is split."""
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c_ptrs, c, mask=mask)


def gemm_output(m: int, n: int, dtype: torch.dtype, split_k: int, device: torch.device) -> torch.Tensor:
    """The GEMM's output buffer: fp32 zeros to accumulate split-K partial sums into, else `dtype`."""
    if split_k > 1:
        return torch.zeros(m, n, dtype=torch.float32, device=device)
    return torch.empty(m, n, dtype=dtype, device=device)


def m_bucket(m: int) -> int:
    """Autotune key for the token count: powers of two, so a new batch size does not retune."""
    return min(pow2(m, 16), 8192)


def split_k_for(m: int, n: int, k: int, device: torch.device, min_k_per_split: int = 512) -> int:
    """Decode-sized GEMMs have too few output tiles to fill the GPU: split K across programs
    (partial sums added atomically in fp32) until there are about two tiles per SM."""
    if m > 64 or interpreting():
        return 1
    tiles = triton.cdiv(n, 64)
    return max(1, min(8, int(triton.cdiv(2 * sm_count(device), tiles)), k // min_k_per_split))


def gemm_grid(meta: dict[str, Any]) -> tuple[int, int]:
    return (
        triton.cdiv(meta["M"], meta["BLOCK_M"]) * triton.cdiv(meta["N"], meta["BLOCK_N"]),
        meta["SPLIT_K"],
    )


def prune_by_m(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """Tune only tile heights that suit the token count (a 16-token GEMM never wants 128-row tiles)."""
    m = named_args.get("M", kwargs.get("M", 1))
    lo, hi = (16, 32) if m <= 32 else (32, 128) if m <= 256 else (64, 256)
    return [c for c in configs if lo <= c.kwargs["BLOCK_M"] <= hi] or configs
