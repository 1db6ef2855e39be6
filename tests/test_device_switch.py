"""PIPESERVE_TEST_DEVICE: tests marked `device` create their tensors, generators and engines on it, and
off the CPU every other test skips with a reason. Checked here with `meta` (a device every host has)
in a child pytest, and with the default `cpu` in this process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, TEST_DEVICE
from tests.kernel_utils import DEVICE, seeded

PROBE = "tests/test_device_switch.py"


@pytest.mark.device
def test_device_tests_create_their_tensors_on_the_test_device():
    assert DEVICE == torch.device(TEST_DEVICE)
    assert torch.zeros(2).device.type == TEST_DEVICE
    assert torch.empty(3, dtype=torch.int8).device.type == TEST_DEVICE
    assert torch.tensor([1, 2]).device.type == TEST_DEVICE
    if TEST_DEVICE != "meta":  # meta has no generators: the kernel tests' seeded draws need a real device
        gen = seeded(0)
        assert gen.device.type == TEST_DEVICE
        assert torch.randn(4, generator=gen).device.type == TEST_DEVICE


def test_other_tests_keep_the_cpu():
    # Unmarked: on the default device, whatever the variable (they skip when it is not cpu).
    assert torch.zeros(1).device.type == "cpu"


def test_the_variable_moves_device_tests_and_skips_the_rest():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PIPESERVE_TEST_DEVICE"] = "meta"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", PROBE, "-q", "-rs", "-p", "no:cacheprovider",
         "-k", "test_device_tests_create or test_other_tests_keep"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "1 passed, 1 skipped" in out, out[-3000:]
    assert "CPU-only test: PIPESERVE_TEST_DEVICE=meta runs the tests marked `device`" in out, out[-3000:]


def test_the_interpreter_follows_the_variable():
    # conftest turns the Triton interpreter on for cpu only: a cuda run compiles the kernels.
    assert (os.environ.get("TRITON_INTERPRET") == "1") == (TEST_DEVICE == "cpu")
