"""An engine on the CPU keeps freed host blocks for reuse: a step's large activations do not come back
as fresh pages (page faults) every step. Its packed weights and KV pool lie on transparent huge pages."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

ALLOCATE = textwrap.dedent("""
    import resource, torch
    from pipeserve.engine import host_memory

    def faults():
        # 40 MB blocks, freed at once: above the largest threshold glibc adjusts itself to (32 MB),
        # as a long fp32 prefill chunk's MLP activations are.
        for _ in range(2):  # the first round may grow the heap
            torch.ones(10 << 20).sum()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            torch.ones(10 << 20).sum()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    default = faults()
    assert host_memory.keep_freed_memory()
    print(default, faults())
""")


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", ALLOCATE], capture_output=True, text=True, timeout=120,
                         check=True)
    default, kept = map(int, out.stdout.split()[-2:])
    # 10 allocations of 40 MB: 10,240 pages each when they go back to the kernel on free.
    assert default > 10 * 10240 // 2
    assert kept < 200


def test_the_cpu_engine_sets_it_at_start(tiny_model, caplog):
    from pipeserve.engine import LLM

    with caplog.at_level("INFO", logger="pipeserve.engine.host_memory"):
        LLM(tiny_model(), device="cpu", dtype="float32", num_pages=16, step_executor="eager")
    assert any("kept for reuse" in r.getMessage() for r in caplog.records)


def _mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def _advised(address: int) -> bool:
    """Whether madvise(MADV_HUGEPAGE) marked the mapping ("hg" among its VmFlags)."""
    return "hg" in _mapping_fields(address).get("VmFlags", "").split()


def _need_huge_pages() -> None:
    from pipeserve.engine.host_memory import transparent_huge_pages

    mode = transparent_huge_pages()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode} on this host")


def test_huge_page_tensors_are_zeroed_aligned_and_advised():
    import torch

    from pipeserve.engine.host_memory import ALIGN, huge_page_tensors

    _need_huge_pages()
    sizes = [(1000, torch.float32), (3, torch.bfloat16), (300_000, torch.bfloat16), (7, torch.int8)]
    tensors = huge_page_tensors(sizes)
    spans = []
    for t, (numel, dtype) in zip(tensors, sizes, strict=True):
        assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0 and not t.any()
        assert _advised(t.data_ptr())
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))  # no overlap
    last = tensors[2]
    del tensors
    last.fill_(1.5)  # the mapping lives as long as one of its tensors
    assert last.float().sum().item() == 1.5 * 300_000


def test_packed_weights_and_the_cpu_kv_pool_lie_on_huge_pages(tiny_model):
    import torch
    from torch import nn

    from pipeserve.engine import LLM
    from pipeserve.engine.backend import native
    from pipeserve.engine.backend.cpu_linear import CpuLinear, use_cpu_linears

    _need_huge_pages()
    if not native.available():
        pytest.skip("the native kernels are not built on this host")
    model = nn.Sequential(nn.Linear(512, 768), nn.Linear(768, 512, dtype=torch.bfloat16))
    weights = [m.weight.detach().clone() for m in model]
    assert use_cpu_linears(model) == 2
    for linear, weight in zip(model, weights, strict=True):
        assert isinstance(linear, CpuLinear) and _advised(linear.packed.data_ptr())
        assert torch.equal(linear.packed, native.pack_weight(weight))
    llm = LLM(tiny_model(), device="cpu", dtype="float32", num_pages=16, step_executor="eager")
    kv = llm.engine.pool.kv
    assert kv is not None and _advised(kv.data_ptr()) and not kv.any()
