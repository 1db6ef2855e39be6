"""The CPU's many-row product: oneDNN's GEMM through torch with the weight reordered once at load
(`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`), and the measured table that says
from which row count it beats the native packed product, per weight shape, dtype and CPU class.

The packed product (backend/native.py) streams a weight at memory speed for the rows of a decode
step; a cache-blocked library GEMM wins once the product is compute-bound. Where that happens
depends on the CPU (with AMX, oneDNN's bf16 GEMM is many times any AVX-512 loop), the dtype and the
shape, so it is measured, not guessed: `pipeserve bench gemm --write-table` times both on this host
by row count and writes cpu_gemm_table.json beside this file. A host whose CPU class the table does
not hold keeps the packed product at every row count.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from . import native

log = logging.getLogger(__name__)

TABLE = Path(__file__).with_name("cpu_gemm_table.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_class(flags: str | None = None) -> str:
    """The CPU's class for the table, from its flags: amx (AMX bf16 tiles), avx512_bf16, avx512,
    avx2 (with FMA), or other."""
    words = set((flags if flags is not None else native._host()).split())
    if "amx_bf16" in words:
        return "amx"
    if "avx512_bf16" in words:
        return "avx512_bf16"
    if "avx512f" in words:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= words else "other"


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN's linear ops on the CPU, for weights of dtype: bf16 also needs
    the CPU's support (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has none)."""
    if not (torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def reorder(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """The weight [N, K] in oneDNN's blocked layout for products of about rows_hint rows."""
    out: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)
    return out


def _linear_impl(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")
    return out


def linear(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of rows x [M, K] (the weight's dtype) with a weight from reorder(); bias [N] or None.
    Under the compiler an opaque op: Inductor's own lowering of the oneDNN linear expects a weight it
    packed itself, not one already in oneDNN's layout."""
    if torch.compiler.is_compiling():
        out: torch.Tensor = torch.ops.pipeserve.onednn_linear(x, reordered, bias)
        return out
    return _linear_impl(x, reordered, bias)


_OPS = torch.library.Library("pipeserve", "FRAGMENT")  # type: ignore[no-untyped-call]
_OPS.define("onednn_linear(Tensor x, Tensor reordered, Tensor? bias) -> Tensor")  # type: ignore[no-untyped-call]
for _key in ("CPU", "MkldnnCPU"):  # a reordered weight is a MkldnnCPU tensor: the call dispatches there
    _OPS.impl("onednn_linear", _linear_impl, _key)  # type: ignore[no-untyped-call]


@torch.library.register_fake("pipeserve::onednn_linear")  # type: ignore[untyped-decorator]
def _(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], reordered.shape[0]))


@dataclass(frozen=True)
class Entry:
    dtype: str
    n: int
    k: int
    gemm_from: int | None  # the fewest rows at which the GEMM wins here and at every larger count measured


@dataclass(frozen=True)
class Table:
    cpu: str
    entries: tuple[Entry, ...]

    def gemm_from(self, n: int, k: int, dtype: torch.dtype) -> int | None:
        """From which row count a [n, k] weight of this dtype takes the GEMM (None: never), from the
        entry of the nearest measured shape (by the logs of n and k)."""
        name = next((key for key, value in DTYPES.items() if value == dtype), None)
        candidates = [e for e in self.entries if e.dtype == name]
        if not candidates:
            return None
        best = min(candidates, key=lambda e: abs(math.log(e.n / n)) + abs(math.log(e.k / k)))
        return best.gemm_from


MARGIN = 0.9  # the GEMM must take at most this much of the packed product's time to count as a win


def crossover(rows: list[int], packed_us: list[float], gemm_us: list[float]) -> int | None:
    """The fewest measured rows from which the GEMM wins (by MARGIN: on a shared machine a smaller
    lead is within a run's noise, and a win costs a second copy of the weight) at every larger
    count measured."""
    start = None
    for r, p, g in zip(reversed(rows), reversed(packed_us), reversed(gemm_us), strict=True):
        if g > MARGIN * p:
            break
        start = r
    return start


def parse(data: dict[str, Any], cpu: str) -> Table:
    """The table's entries for CPU class `cpu` (none when the file holds no measurement of it)."""
    section = data.get(cpu, {}).get("entries", ())
    entries = tuple(Entry(e["dtype"], e["n"], e["k"], e["gemm_from"]) for e in section)
    return Table(cpu, entries)


@cache
def table() -> Table:
    """This host's table, read once (and logged)."""
    cpu = cpu_class()
    data: dict[str, Any] = json.loads(TABLE.read_text()) if TABLE.is_file() else {}
    result = parse(data, cpu) if available() else Table(cpu, ())
    if result.entries:
        log.info("CPU GEMM table (%s): oneDNN from %s rows", cpu,
                 ", ".join(f"{e.dtype} {e.n}x{e.k}: {e.gemm_from}" for e in result.entries))
    else:
        log.info("CPU GEMM table: nothing measured for CPU class %s%s: the packed product at every row count",
                 cpu, "" if available() else " (no oneDNN in this torch)")
    return result
