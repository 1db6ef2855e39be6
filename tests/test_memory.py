"""KV pool sizing: the CUDA arithmetic with fake numbers, and the profile step run for real on the CPU
through the same code path a CUDA engine takes (a fake allocator probe stands in for CUDA's)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.engine.backend import get_backend
from pipeserve.engine.memory import GiB, MemoryPlan, kv_budget, kv_bytes_cuda, profile_step
from pipeserve.engine.model.loader import load_model
from pipeserve.startup import StartupError

CPU = torch.device("cpu")


def test_kv_bytes_is_the_share_of_total_memory_left() -> None:
    # An 80 GB device at 0.9: 72 GB, less 16 GB of weights, 2 GB of activations, 1 GB not torch's.
    assert kv_bytes_cuda(80 * GiB, 0.9, 16 * GiB, 2 * GiB, 1 * GiB) == 53 * GiB
    assert kv_bytes_cuda(80 * GiB, 0.2, 16 * GiB, 2 * GiB, 1 * GiB) == 0  # never negative


def test_plan_line_names_every_figure() -> None:
    plan = MemoryPlan(16 * GiB, 2 * GiB, 53 * GiB, 10_000, 16, 8192)
    assert plan.max_concurrent_seqs == 10_000 // 512
    line = plan.line()
    for part in ("weights 16.00 GB", "activation peak 2.00 GB", "KV 53.00 GB", "10000 pages of 16 tokens",
                 "at most 19 concurrent sequences of 8192 tokens"):
        assert part in line
    assert "not profiled (CPU" in MemoryPlan(GiB, None, GiB, 10, 16, 32, "CPU").line()


class FakeProbe:
    """An allocator with made-up numbers; `peak` runs the step for real."""

    def __init__(self) -> None:
        self.ran = 0

    def total(self) -> int:
        return 80 * GiB

    def allocated(self) -> int:
        return 16 * GiB

    def non_torch(self) -> int:
        return GiB

    def peak(self, step: Callable[[], None]) -> int:
        step()
        self.ran += 1
        return 3 * GiB


@pytest.mark.parametrize("max_batched, max_len, rows", [(64, 256, 8), (100, 32, 5), (48, 48, 1)])
def test_cuda_path_profiles_the_largest_step(stories_dir: str, max_batched: int, max_len: int,
                                             rows: int) -> None:
    """The profile step (full prefill chunks, some shorter than a page, and a decode batch) runs on a
    real model, and the budget is the share left after it."""
    model, _ = load_model(stories_dir, get_backend("cpu"), CPU, torch.float32, max_len)
    probe = FakeProbe()
    step = partial(profile_step, model, CPU, torch.float32, 16, "auto", max_len, max_batched, rows)
    kv, peak, why = kv_budget(EngineConfig(gpu_memory_utilization=0.9), probe, step)
    assert probe.ran == 1 and peak == 3 * GiB and why == ""
    assert kv == int(80 * GiB * 0.9) - 16 * GiB - 3 * GiB - GiB


def test_profile_step_with_a_quantized_kv_cache(stories_dir: str) -> None:
    model, _ = load_model(stories_dir, get_backend("cpu"), CPU, torch.float32, 64)
    profile_step(model, CPU, torch.float32, 16, "int8", 64, 80, 4)


def test_cpu_and_explicit_sizes() -> None:
    assert kv_budget(EngineConfig(), None, None) == (GiB // 4, None, "CPU: a fixed 0.25 GB pool unless "
                                                                      "--kv-cache-gb")
    probe = FakeProbe()
    assert kv_budget(EngineConfig(kv_cache_gb=2.0), probe, lambda: None)[:2] == (2 * GiB, None)
    assert kv_budget(EngineConfig(num_pages=8), probe, lambda: None) == (0, None, "--num-pages given")
    assert probe.ran == 0  # an explicit size needs no profile
    kv, peak, why = kv_budget(EngineConfig(), probe, None)  # a tensor-parallel rank
    assert peak is None and why == "tensor parallel" and kv == int(72 * GiB) - 17 * GiB


def test_no_memory_left_names_every_figure() -> None:
    # Other processes on the GPU (60 GiB here) plus the weights and activations past the share: a
    # start-up error that says where the memory went and which flags size the pool instead.
    class Crowded(FakeProbe):
        def non_torch(self) -> int:
            return 60 * GiB

    want = (r"no GPU memory left for the KV cache: --gpu-memory-utilization 0.9 of 80.00 GB is 72.00 GB, "
            r".*weights \(16.00 GB\).*other processes.*--kv-cache-gb")
    with pytest.raises(StartupError, match=want):
        kv_budget(EngineConfig(gpu_memory_utilization=0.9), Crowded(), lambda: None)


def test_utilization_is_range_checked() -> None:
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)


def test_engine_logs_one_memory_line(stories_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    from pipeserve.engine.engine import Engine

    with caplog.at_level(logging.INFO, logger="pipeserve.engine"):
        engine = Engine(model=stories_dir, compile=False, kv_cache_gb=0.01)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:")]
    assert len(lines) == 1
    assert f"{engine.pool.num_pages} pages of 16 tokens" in lines[0]
    assert "not profiled (--kv-cache-gb given)" in lines[0]
    assert f"at most {engine.pool.num_pages // 32} concurrent sequences of 512 tokens" in lines[0]


def test_the_lora_slot_table_comes_out_of_the_budget(stories_dir: str) -> None:
    """Its size, computed before it exists, is what the table takes; the CUDA share leaves room for
    it; the CPU's fixed pool and an explicit pool size are the pool's own."""
    from pipeserve.engine.lora.shard import LoRAShard
    from pipeserve.engine.lora.slots import SlotTable, table_bytes
    from pipeserve.model_config import ModelConfig

    cfg = ModelConfig.from_dir(stories_dir)
    for dtype, slots, rank in ((torch.float32, 4, 16), (torch.bfloat16, 2, 8)):
        assert table_bytes(cfg, slots, rank, dtype) == SlotTable(cfg, slots, rank, dtype, CPU).nbytes > 0
    part = LoRAShard(cfg, 1, 2)  # a tensor-parallel rank's table: its shard of each adapter
    mine, whole = table_bytes(cfg, 4, 16, torch.float32, part), table_bytes(cfg, 4, 16, torch.float32)
    assert mine == SlotTable(cfg, 4, 16, torch.float32, CPU, part).nbytes < whole
    lora = 70 * 2**20
    cuda = EngineConfig(gpu_memory_utilization=0.9)
    with_table = kv_budget(cuda, FakeProbe(), lambda: None, lora)[0]
    assert with_table == kv_budget(cuda, FakeProbe(), lambda: None)[0] - lora
    assert kv_budget(EngineConfig(), None, None, lora)[0] == GiB // 4
    assert kv_budget(EngineConfig(kv_cache_gb=1.0), FakeProbe(), None, lora)[0] == GiB
    line = MemoryPlan(GiB, None, GiB, 10, 16, 32, "CPU", lora).line()
    assert "LoRA slot table 70.0 MB, KV 1.00 GB" in line


class SmallProbe(FakeProbe):
    """A 1 GiB device with nothing else on it, whose activation peak is what the step allocates
    (nothing a fake can see)."""

    def total(self) -> int:
        return GiB

    def allocated(self) -> int:
        return 0

    def non_torch(self) -> int:
        return 0

    def peak(self, step: Callable[[], None]) -> int:
        step()
        return 0


def test_engine_kv_pool_shrinks_by_the_lora_slot_table(stories_dir: str, caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed budget (--gpu-memory-utilization of a device, its allocator faked on the CPU): with
    --enable-lora the KV pool holds the slot table's bytes fewer, and the memory line names it."""
    from pipeserve.engine import shard
    from pipeserve.engine.engine import Engine
    from pipeserve.engine.kv.pool import kv_bytes_per_page

    monkeypatch.setattr(shard, "device_probe", lambda device: SmallProbe())
    options = {"model": stories_dir, "compile": False, "device": "cpu", "gpu_memory_utilization": 0.05,
               "max_num_batched_tokens": 256}
    with caplog.at_level(logging.INFO, logger="pipeserve.engine"):
        plain = Engine(**options)
        lora = Engine(**options, enable_lora=True, max_loras=4, max_lora_rank=16)
    assert lora.lora is not None
    table = lora.lora.table.nbytes
    page = kv_bytes_per_page(plain.model_config, torch.float32, 16, "auto", plain.config.prefix_caching)
    budget = int(GiB * 0.05)
    assert plain.pool.num_pages == budget // page
    assert lora.pool.num_pages == (budget - table) // page < plain.pool.num_pages
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:")]
    assert len(lines) == 2 and "LoRA" not in lines[0]
    assert f"LoRA slot table {table / 2**20:.1f} MB" in lines[1]
