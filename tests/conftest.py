"""Shared test set-up: the test device ($PIPESERVE_TEST_DEVICE) and with it the Triton interpreter,
the one place that locates the shared assets (stories260K, the traces), and tiny random Hugging Face
checkpoints built on the fly (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator

# The device of the tests marked `device` (the kernel tests and the engine tests that make sense on a
# GPU): cpu (the default), where Triton kernels run under its interpreter, or cuda, where they compile;
# every other test skips there (`make test-gpu`). The one place that reads the variable.
TEST_DEVICE = os.environ.get("PIPESERVE_TEST_DEVICE", "cpu")
# Must precede the first `import triton` anywhere in the test process.
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from pipeserve.config import EngineConfig  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
# $PIPESERVE_SHARED, else a `shared` folder beside the checkout; exported so that the code under test
# (bench's trace and model defaults) and its subprocesses look in the same place.
SHARED = pathlib.Path(os.environ.get("PIPESERVE_SHARED", REPO.parent / "shared"))
os.environ["PIPESERVE_SHARED"] = str(SHARED)
STORIES = SHARED / "models" / "stories260K"
TRACES = SHARED / "data" / "traces"


@dataclasses.dataclass
class SharedGpuEngineConfig(EngineConfig):
    """EngineConfig with a 1 GB KV pool unless a test sizes it: for `device` tests on a GPU."""

    kv_cache_gb: float | None = 1.0


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch (and the native kernels, which take torch's thread
    count) runs on its share of the cores: every worker on every core oversubscribes them, and the
    OpenMP barriers of a step then wait on descheduled threads (tiny models' steps ran 10-50x slower).
    Tests that exercise several threads set their count themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Off the CPU only the tests marked `device` run; the others are CPU-only by nature."""
    if TEST_DEVICE == "cpu":
        return
    reason = f"CPU-only test: PIPESERVE_TEST_DEVICE={TEST_DEVICE} runs the tests marked `device`"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("device") is None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _on_test_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A `device` test off the CPU creates its tensors there: torch's default device for the test."""
    if TEST_DEVICE == "cpu" or request.node.get_closest_marker("device") is None:
        yield
        return
    import torch
    from torch.utils import _device

    # torch caches the factory functions its default device applies to on first use: built while a
    # test had torch.empty patched (poisoned allocations), the cache would hold the patch, and the
    # real torch.empty would allocate on the CPU in every later test. Build it now, unpatched.
    _device._device_constructors.cache_clear()
    _device._device_constructors()
    # Test engines share one GPU across the xdist workers: each sizes its KV pool explicitly, where
    # the default (90% of the GPU) would leave the others nothing.
    from pipeserve.engine import llm

    monkeypatch.setattr(llm, "EngineConfig", SharedGpuEngineConfig)
    torch.set_default_device(TEST_DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(None)
        # Hand the test's cached blocks back to the GPU, which the other workers' engines share: a
        # worker holding what its last test freed left the others out of memory.
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def png_panels(path: pathlib.Path) -> int:
    """How many panels bench.report.plot_panels drew into this PNG, from its IHDR size (each panel is
    PANEL_INCHES x DPI pixels); fails when it is not a PNG of whole panels."""
    from pipeserve.bench.report import DPI, PANEL_INCHES

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    panel_width, panel_height = round(PANEL_INCHES[0] * DPI), round(PANEL_INCHES[1] * DPI)
    assert height == panel_height and width % panel_width == 0, (width, height)
    return width // panel_width


@pytest.fixture(scope="session", autouse=True)
def _demo_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the demo model out of the user's home directory."""
    os.environ.setdefault("PIPESERVE_CACHE", str(tmp_path_factory.mktemp("pipeserve-cache")))


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """One torch thread for a module's tests (pytest.mark.usefixtures), restored after: tiny models
    are latency-bound, and on a shared 2-core machine a second intra-op thread only waits."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def stories_dir() -> str:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (set PIPESERVE_SHARED to the assets folder)")
    return str(STORIES)


@pytest.fixture(scope="session")
def traces_dir() -> pathlib.Path:
    if not TRACES.is_dir():
        pytest.skip(f"traces not found at {TRACES} (set PIPESERVE_SHARED to the assets folder)")
    return TRACES


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model("llama" | "qwen2" | "mistral", **config overrides) -> checkpoint dir."""
    import torch

    from tests.models import build_tiny_model

    cache: dict[tuple, str] = {}

    def make(kind: str = "llama", **overrides) -> str:
        key = (kind, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            # A checkpoint is host data: built on the CPU whatever device a `device` test runs on.
            with torch.device("cpu"):
                cache[key] = build_tiny_model(str(tmp_path_factory.mktemp(kind)), kind, **overrides)
        return cache[key]

    return make
