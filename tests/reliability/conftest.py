"""One `pipeserve up` on stories260K shared by the reliability suite (services/bench/reliability.py
holds the scenarios; these tests run them small and assert). The fault tests kill processes, so
they live in test_zz_faults.py and run last."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench.reliability import Pipeline
from tests.conftest import STORIES


def start(log_path: Path, *flags: str, **kwargs) -> Pipeline:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (set PIPESERVE_SHARED to the shared/ folder)")
    return Pipeline(log_path, str(STORIES), *flags, **kwargs)


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    pipe = start(tmp_path_factory.mktemp("reliability") / "up.log")
    yield pipe
    pipe.stop()
