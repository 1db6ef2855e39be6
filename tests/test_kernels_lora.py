"""The Triton LoRA kernels (shrink/expand: BGMV over gathered rows, SGMV over prefill segments) under
TRITON_INTERPRET=1 against the torch path (backend/lora_ops.py) and a per-row loop, on tiny shapes:
rows of several slots, rows without an adapter (untouched), segments of one slot, of none, and
segments longer than one tile."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeserve.engine.backend.lora_ops import add_lora as torch_add_lora
from pipeserve.engine.backend.lora_ops import add_lora_slots as torch_add_lora_slots
from pipeserve.engine.lora.rows import LoRAContext
from pipeserve.engine.triton_kernels import lora as triton_lora


def stage(name: str, array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def per_row(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            slots: np.ndarray) -> torch.Tensor:
    out = y.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] += (x[t].double() @ a[s].double()) @ b[s].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["decode", "mixed", "balanced", "one-slot"])
def test_triton_matches_torch(dtype: torch.dtype, layout: str) -> None:
    torch.manual_seed(0)
    num_slots, n, d_in, d_out = 4, 24, 40, 72
    if layout == "decode":
        lora = np.array([0, -1, 2, 2, 3, -1, 1])
        gathered, bounds, seg = lora.size, np.array([lora.size]), np.zeros(0, np.int64)
    elif layout == "mixed":  # 3 decode rows, then chunks of 20 (slot 1), 5 (none) and 9 (slot 3)
        lora = np.concatenate([[2, -1, 0], [1] * 20, [-1] * 5, [3] * 9])
        gathered, bounds, seg = 3, np.array([3, 23, 28, 37]), np.array([1, -1, 3])
    elif layout == "balanced":  # 2 decode rows, then chunks of 6 (slot 0), 5 (slot 2), 4 (none)
        lora = np.concatenate([[2, 0], [0] * 6, [2] * 5, [-1] * 4])
        gathered, bounds, seg = 2, np.array([2, 8, 13, 17]), np.array([0, 2, -1])
    else:
        lora = np.full(5, 2)
        gathered, bounds, seg = 5, np.array([5]), np.zeros(0, np.int64)
    t = lora.size
    x = torch.randn(t, d_in).to(dtype)
    a = (torch.randn(num_slots, d_in, n) * 0.3).to(dtype)
    b = (torch.randn(num_slots, n, d_out) * 0.3).to(dtype)
    y = torch.randn(t, d_out).to(dtype)
    rows = LoRAContext._rows(lora, gathered, bounds, seg, frozenset({"qkv"}), stage, "")
    # The torch path groups every row where padding stays small, else the gathered rows only.
    assert rows.group_cover == {"mixed": 3}.get(layout, t)
    expected = per_row(y, x, a, b, lora)
    got_torch, got_triton = y.clone(), y.clone()
    torch_add_lora(got_torch, x, a, b, rows)
    triton_lora.add_lora(got_triton, x, a, b, rows)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got_torch.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got_triton.double(), expected, rtol=tol, atol=tol)
    untouched = lora < 0
    assert torch.equal(got_triton[untouched], y[untouched])
    assert torch.equal(got_torch[untouched], y[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_shape_form_matches_the_grouped_path(dtype: torch.dtype) -> None:
    """add_lora_slots (what the compiled steps trace or capture: every row gathered, its slot read from
    the device, padded rows -1), Triton's and torch's, against the grouped torch path and a per-row
    loop: rows of several slots, of none, and a bucket's padded rows, untouched."""
    torch.manual_seed(1)
    num_slots, n, d_in, d_out = 3, 48, 40, 72
    lora = np.array([2, -1, 0, 2, 1, -1, -1, -1])  # 5 rows padded to a bucket of 8
    x = torch.randn(lora.size, d_in).to(dtype)
    a = (torch.randn(num_slots, d_in, n) * 0.3).to(dtype)
    b = (torch.randn(num_slots, n, d_out) * 0.3).to(dtype)
    y = torch.randn(lora.size, d_out).to(dtype)
    rows = LoRAContext._rows(lora, lora.size, np.array([lora.size]), np.zeros(0, np.int64),
                             frozenset({"qkv"}), stage, "")
    grouped, got_torch, got_triton = y.clone(), y.clone(), y.clone()
    torch_add_lora(grouped, x, a, b, rows)
    slots = torch.from_numpy(lora.astype(np.int32))
    torch_add_lora_slots(got_torch, x, a, b, slots)
    triton_lora.add_lora_slots(got_triton, x, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    expected = per_row(y, x, a, b, lora)
    for got in (grouped, got_torch, got_triton):
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
        assert torch.equal(got[lora < 0], y[lora < 0])
    torch.testing.assert_close(got_torch, grouped, rtol=tol, atol=tol)
