"""One `pipeserve up` on stories260K shared by the reliability suite (pipeserve/bench/reliability.py holds
the scenarios; these tests run them small and assert). The fault tests kill processes, so they
live in test_zz_faults.py and run last."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeserve.local_cluster import LocalCluster
from tests.conftest import STORIES


def start(log_path: Path, *flags: str, **kwargs: Any) -> LocalCluster:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (set PIPESERVE_SHARED to the assets folder)")
    return LocalCluster(log_path, str(STORIES), *flags, **kwargs)


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with start(tmp_path_factory.mktemp("reliability") / "up.log") as pipe:
        yield pipe


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for the name localhost, and its key (PEM files)."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True, timeout=30)
    return cert, key
