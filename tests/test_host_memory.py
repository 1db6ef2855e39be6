"""An engine on the CPU keeps freed host blocks for reuse: a step's large activations do not come back
as fresh pages (page faults) every step."""

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
