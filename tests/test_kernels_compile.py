"""Every Triton kernel the engine can select compiles for the GPUs it serves on (Hopper sm_90, Ampere
sm_80), checked on a machine without one, under two Triton versions: the venv's and TRITON_GPU_HOST,
the one current GPU stacks ship (installed by pip into a cache folder outside the repository).

The interpreter accepts programs a GPU rejects (tl.dot tiles under 16, accumulator types, layout
errors only the compiler sees), so the suite also runs Triton's real compiler down to a cubin (ptxas
ships with triton). A child process without TRITON_INTERPRET calls each launcher on tiny CPU tensors
with a stand-in driver that reports the target and compiles instead of launching; autotuned GEMMs
compile every config they declare. The matrix: every activation dtype (bf16, fp16, fp32), KV cache
format (model dtype, int8, fp8), head size of the supported model families (8: stories260K, 64:
Llama-3.2-1B / Qwen2-0.5B, 128: Llama-3 / Mistral / Mixtral / Qwen2-7B / Qwen3-MoE), weight format
(W8A8 int8 / fp8, W4A16 int4 / nf4, dense and MoE), split and unsplit variants (see _cases for which
axes are crossed). The fp8 (e4m3) variants compile for sm_90 only: Triton has no e4m3 below sm_89,
where their launchers refuse to run. Each compiled kernel's shared memory must fit the target.
Compiled kernels land in Triton's on-disk cache (keyed by version, target and source), so only the
first run pays for the compiler (about 600 compiles per version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TRITON_GPU_HOST = "3.6.0"
# Shared memory per block (opt-in maximum) of each target.
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
# Triton has no e4m3 (tl.float8e4nv) below sm_89: the fp8 variants are not compiled for sm_80, where
# their launchers refuse to run (triton_kernels/common.check_fp8).
FP8_MIN_ARCH = 89
# pip errors that mean the index is out of reach (the only reason to skip the pinned version).
OFFLINE = ("No matching distribution", "Could not find a version", "NewConnectionError",
           "Network is unreachable", "Temporary failure in name resolution", "Connection refused",
           "Max retries exceeded", "ProxyError", "Read timed out")

# serial: two compiler children take both cores of a small host
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def triton_at(version: str) -> Path:
    """A folder holding triton==version (no dependencies: it needs none beyond the venv's), installed
    once with pip --target into ~/.cache/pipeserve; skips when pip cannot reach the index."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipeserve"
    target = cache / f"triton-{version}"
    if (target / "triton" / "__init__.py").is_file():
        return target
    staging = cache / f"triton-{version}.{os.getpid()}.partial"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
         "--target", str(staging), f"triton=={version}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        if any(s in proc.stderr for s in OFFLINE):
            pytest.skip(f"pip cannot reach an index with triton=={version}: {proc.stderr.strip()[-300:]}")
        raise AssertionError(f"pip install triton=={version} failed:\n{proc.stderr[-2000:]}")
    try:
        staging.rename(target)  # atomic: a concurrent run either sees the whole folder or none
    except OSError:
        if not (target / "triton" / "__init__.py").is_file():
            raise
    return target


class Matrix:
    """This file run as a child process without the interpreter, compiling the matrix for every
    target under the Triton found first on `extra_path` (None: the venv's)."""

    def __init__(self, extra_path: Path | None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_DEFAULT_FP_FUSION"] = "1"
        # The pinned Triton first on sys.path, ahead of the venv's site-packages; the checkout next.
        paths = [*([] if extra_path is None else [str(extra_path)]), str(REPO), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *map(str, SHARED_LIMIT)], cwd=REPO, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def report(self, timeout: float) -> dict[str, Any]:
        """The child's JSON report (see _compile_everything)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        assert self.proc.returncode == 0, err[-4000:]
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module")
def matrices() -> Iterator[dict[str, Matrix | str]]:
    """Both versions' children, started together (the compiles are CPU-bound and single-threaded);
    for the pinned version, the reason to skip instead where pip cannot reach the index."""
    runs: dict[str, Matrix | str] = {"venv": Matrix(None)}
    try:
        runs[TRITON_GPU_HOST] = Matrix(triton_at(TRITON_GPU_HOST))
    except pytest.skip.Exception as skip:
        runs[TRITON_GPU_HOST] = str(skip)
    yield runs
    for run in runs.values():
        if isinstance(run, Matrix):
            run.stop()


def check(report: dict[str, Any]) -> None:
    assert not report["failed"], json.dumps(report["failed"], indent=1)[:6000]
    assert report["unsupported"] and all(
        name.startswith("sm_80 ") and "float8" in name for name in report["unsupported"])
    for arch, limit in SHARED_LIMIT.items():
        kernels = [k for k in report["kernels"] if k["arch"] == arch]
        # Every jit kernel of the package compiled for every target, with every autotune config.
        assert {k["kernel"] for k in kernels} == set(report["all_kernels"]), (
            arch, set(report["all_kernels"]) - {k["kernel"] for k in kernels})
        assert len(kernels) >= 250, (arch, len(kernels))
        over = [k for k in kernels if k["shared"] > limit]
        assert not over, f"shared memory over sm_{arch}'s {limit} B: {json.dumps(over[:10], indent=1)}"


@pytest.mark.timeout(3000)
def test_matrix_compiles_under_venv_triton(matrices: dict[str, Matrix | str]) -> None:
    run = matrices["venv"]
    assert isinstance(run, Matrix)
    check(run.report(timeout=2900))


@pytest.mark.timeout(3000)
def test_matrix_compiles_under_gpu_host_triton(matrices: dict[str, Matrix | str]) -> None:
    run = matrices[TRITON_GPU_HOST]
    if isinstance(run, str):
        pytest.skip(run)
    report = run.report(timeout=2900)
    assert report["triton"] == TRITON_GPU_HOST, report["triton"]
    check(report)


# ---------------------------------------------------------------------------------------------------
# The child process.


def _cases() -> list[tuple[str, bool, Any]]:
    """(name, every autotune config?, call) for every kernel variant the engine can launch. Each axis
    is covered whole; axes are crossed where they change the same code (a KV format with every head
    size and dtype; autotune configs with both weight formats), not where they do not (the output
    dtype of a GEMM is its epilogue's store: one config per extra dtype)."""
    import torch

    from pipeserve.engine.backend.lora_ops import LoRARows
    from pipeserve.engine.model.rope import rope_cache
    from pipeserve.engine.triton_kernels import (
        activation,
        decode_attention,
        fused_moe,
        gemm_w4a16,
        gemm_w8a8,
        kv_cache,
        lora,
        norm,
        prefill_attention,
        quantize,
        rope,
    )

    bf16, f16, f32, i8, fp8 = torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn
    dtypes = (bf16, f16, f32)
    cases: list[tuple[str, bool, Any]] = []

    def add(name: str, call: Any, every_config: bool = False) -> None:
        cases.append((name, every_config, call))

    # Attention and the KV store: KV format x head size (with its GQA group) in bf16, every KV format
    # at head size 128 in fp16 and fp32; both decode variants (one split writes the output, several
    # go through the merge kernel) and prefill.
    heads = {8: (8, 8), 64: (32, 8), 128: (28, 4)}  # head_dim: (q heads, kv heads)
    for dt in dtypes:
        for kv in (None, i8, fp8):
            for d, (hq, hkv) in heads.items():
                if dt != bf16 and d != 128:
                    continue
                pages, page_size = 4, 16
                cache = torch.zeros(pages, page_size, hkv, d, dtype=kv or dt)
                group = min(8, d)
                scales = {} if kv is None else {
                    "k_scale": torch.zeros(pages, page_size, hkv, d // group, dtype=f16),
                    "v_scale": torch.zeros(pages, page_size, hkv, d // group, dtype=f16),
                }  # fmt: skip
                tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([40, 64], dtype=torch.int32)
                tag = f"{dt} kv={kv} d={d}"
                for splits in (1, 3):
                    add(f"decode {tag} splits={splits}",
                        lambda c=cache, s=scales, t=tables, n=lens, k=splits, dt=dt, hq=hq, d=d:
                        decode_attention.decode_attention(torch.zeros(2, hq, d, dtype=dt), c, c, t, n, 0.1,
                                                          **s, num_splits=k))
                add(f"prefill {tag}",
                    lambda c=cache, s=scales, t=tables, n=lens, dt=dt, hq=hq, d=d:
                    prefill_attention.prefill_attention(torch.zeros(50, hq, d, dtype=dt), c, c, t,
                                                        torch.tensor([0, 20, 50], dtype=torch.int32), n, 30,
                                                        64, 0.1, 32, **s))
                add(f"store_kv {tag}",
                    lambda c=cache, s=scales, dt=dt, hkv=hkv, d=d: kv_cache.store_kv(
                        torch.zeros(3, hkv, d, dtype=dt), torch.zeros(3, hkv, d, dtype=dt), c, c,
                        torch.arange(3), *s.values()))
        for d, (hq, hkv) in heads.items():
            add(f"rope {dt} d={d}",
                lambda dt=dt, hq=hq, hkv=hkv, d=d: rope.apply_rope(
                    torch.zeros(4, hq, d, dtype=dt), torch.zeros(4, hkv, d, dtype=dt),
                    torch.zeros(4, dtype=torch.int64), rope_cache(d, 16, 1e4, None)))

        # Pointwise kernels: a q/k-norm-sized and a Llama-3-8B-sized row (their BLOCK and warps follow
        # the width).
        for hidden in (128, 4096):
            x, w = torch.zeros(4, hidden, dtype=dt), torch.ones(hidden, dtype=dt)
            add(f"rms_norm {dt} {hidden}", lambda x=x, w=w: norm.rms_norm(x, w, 1e-5))
            add(f"rms_norm residual {dt} {hidden}", lambda x=x, w=w: norm.rms_norm(x, w, 1e-5, x))
            for q in (i8, fp8):
                add(f"rms_norm_quant {q} {dt} {hidden}", lambda x=x, w=w, q=q: norm.rms_norm_quant(x, w, 1e-5,
                                                                                                 None, q))
                add(f"rms_norm_quant residual {q} {dt} {hidden}",
                    lambda x=x, w=w, q=q: norm.rms_norm_quant(x, w, 1e-5, x, q))
                add(f"per_token_quant {q} {dt} {hidden}", lambda x=x, q=q: quantize.per_token_quant(x, q))
        g = torch.zeros(4, 2 * 14336, dtype=dt)
        add(f"silu_and_mul {dt}", lambda g=g: activation.silu_and_mul(g))
        for q in (i8, fp8):
            add(f"silu_and_mul_quant {q} {dt}", lambda g=g, q=q: activation.silu_and_mul_quant(g, q))

    # GEMMs: every autotune config unsplit with a bf16 output, split-K (fp32 atomics) and the other
    # output / activation dtypes with one config each.
    n, k = 512, 1024
    for m, split_k in ((16, 2), (256, 1)):
        a8, af = torch.zeros(m, k, dtype=i8), torch.zeros(m, k, dtype=fp8)
        sa, sw = torch.ones(m, 1), torch.ones(n)
        for out in dtypes if split_k == 1 else (bf16,):
            every = split_k == 1 and out == bf16
            for bias in (None, torch.zeros(n, dtype=out)):
                add(f"int8 gemm M={m} out={out} bias={bias is not None}",
                    lambda a=a8, sa=sa, sw=sw, sk=split_k, o=out, b=bias: gemm_w8a8.int8_gemm(
                        a, sa, torch.zeros(n, k, dtype=i8), sw, b, o, split_k=sk), every and bias is None)
            add(f"{fp8} gemm M={m} out={out}",
                lambda a=af, sa=sa, sw=sw, sk=split_k, o=out: gemm_w8a8.fp8_gemm(
                    a, sa, torch.zeros(n, k, dtype=fp8), sw, None, o, split_k=sk), every)
        for dt in dtypes if split_k == 1 else (bf16,):
            for zeros in (torch.zeros(k // 128, n, dtype=torch.uint8), None):
                add(f"w4a16 {dt} M={m} nf4={zeros is None}",
                    lambda z=zeros, mm=m, sk=split_k, dt=dt: gemm_w4a16.w4a16_gemm(
                        torch.zeros(mm, k, dtype=dt), torch.zeros(k // 8, n, dtype=torch.int32),
                        torch.ones(k // 128, n, dtype=dt), z, split_k=sk), split_k == 1 and dt == bf16)

    # Fused MoE (routing, alignment, both grouped GEMMs) at decode- and prefill-sized token counts
    # (their tiles differ).
    e, hid, inter = 8, 256, 128
    for tokens in (4, 512):
        for dt in dtypes:
            add(f"fused moe {dt} T={tokens}",
                lambda t=tokens, dt=dt: fused_moe.fused_moe(
                    torch.zeros(t, hid, dtype=dt), torch.zeros(t, e, dtype=dt),
                    torch.zeros(e, 2 * inter, hid, dtype=dt), torch.zeros(e, hid, inter, dtype=dt), 2, True))
            for zeros in (torch.zeros(e, 2, 2 * inter, dtype=torch.uint8), None):
                add(f"fused moe w4a16 {dt} nf4={zeros is None} T={tokens}",
                    lambda t=tokens, z=zeros, dt=dt: fused_moe.fused_moe_w4a16(
                        torch.zeros(t, hid, dtype=dt), torch.zeros(t, e, dtype=dt),
                        torch.zeros(e, hid // 8, 2 * inter, dtype=torch.int32),
                        torch.ones(e, 2, 2 * inter, dtype=dt), z,
                        torch.zeros(e, inter // 8, hid, dtype=torch.int32), torch.ones(e, 1, hid, dtype=dt),
                        None if z is None else torch.zeros(e, 1, hid, dtype=torch.uint8), 2, True))
        for dt in (bf16, f16):
            for q in (i8, fp8):
                add(f"fused moe {q} {dt} T={tokens}",
                    lambda t=tokens, q=q, dt=dt: fused_moe.fused_moe_w8a8(
                        torch.zeros(t, hid, dtype=dt), torch.zeros(t, e, dtype=dt),
                        torch.zeros(e, 2 * inter, hid, dtype=q), torch.ones(e, 2 * inter),
                        torch.zeros(e, hid, inter, dtype=q), torch.ones(e, hid), 2, True))
    # Batched LoRA: gathered (decode) rows and prefill segments in one step, a qkv-sized stack of
    # rank-16 factors (3 x 16) over a 4096-wide layer.
    i32 = torch.int32
    rows = LoRARows(slots=torch.tensor([0, -1, 2, 1], dtype=i32), num_gathered=4, group_rows=None,
                    group_mask=None, group_slots=None, group_first=False, group_len=0, segments=[],
                    seg_bounds=torch.tensor([4, 40, 70], dtype=i32),
                    seg_slots=torch.tensor([3, 0], dtype=i32), max_seg_len=36)
    for dt in dtypes:
        add(f"lora {dt}", lambda dt=dt: lora.add_lora(
            torch.zeros(70, 6144, dtype=dt), torch.zeros(70, 4096, dtype=dt),
            torch.zeros(4, 4096, 48, dtype=dt), torch.zeros(4, 48, 6144, dtype=dt), rows))
    return cases


def _jit_kernels() -> list[str]:
    """The name of every top-level jit kernel (a launched program, not a helper) in the package."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import pipeserve.engine.triton_kernels as pkg

    names = []
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, obj in vars(module).items():
            jit = obj if isinstance(obj, JITFunction) else getattr(obj, "fn", None)  # autotuners wrap one
            if isinstance(jit, JITFunction) and name.endswith("kernel") and jit.__module__ == module.__name__:
                names.append(jit.fn.__name__)
    return sorted(set(names))


def _compile_everything(archs: list[int]) -> dict[str, Any]:  # runs in the child process
    import traceback

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from pipeserve.engine.triton_kernels.common import prune_by_m

    class StandIn:
        """Just enough of a driver for JITFunction.run to compile (warmup) for one target."""

        arch = 90

        def get_current_device(self) -> int:
            return self.arch  # kernels are cached per device: one "device" per target

        def get_current_stream(self, device: int) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", self.arch, 32)

    stand_in = StandIn()
    driver.set_active(stand_in)
    compiled: list[dict[str, Any]] = []
    current: dict[str, Any] = {"case": "", "every_config": False}
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        tiles = {k: v for k, v in kwargs.items() if k.startswith("BLOCK_")}
        compiled.append({"arch": stand_in.arch, "case": current["case"], "kernel": self.fn.__name__,
                         "tiles": tiles, "warps": kernel.metadata.num_warps,
                         "stages": kernel.metadata.num_stages, "shared": kernel.metadata.shared})
        return kernel

    def every_config(self, *args, grid, warmup=False, **kwargs):
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        configs = self.configs if current["every_config"] else prune_by_m(self.configs, self.nargs)[:1]
        for config in configs:
            self.fn.run(*args, grid=grid, warmup=True, **kwargs, **config.all_kwargs())
        self.nargs = None

    JITFunction.run = compile_only
    Autotuner.run = every_config

    failed, unsupported = {}, []
    for arch in archs:
        stand_in.arch = arch
        for name, every_config, call in _cases():
            if arch < FP8_MIN_ARCH and "float8" in name:
                unsupported.append(f"sm_{arch} {name}")
                continue
            current["case"], current["every_config"] = name, every_config
            try:
                call()
            except Exception:
                failed[f"sm_{arch} {name}"] = traceback.format_exc()[-3000:]
    return {"compiled": len(compiled), "failed": failed, "unsupported": unsupported, "kernels": compiled,
            "all_kernels": _jit_kernels(), "triton": triton.__version__}


if __name__ == "__main__":
    print(json.dumps(_compile_everything([int(a) for a in sys.argv[1:]] or [90])))
