"""tools/gpu_wheels.py: the wheels a lent GPU host lacks are pipeserve's runtime requirements and
theirs less the host image's packages, so that no import fails there for a package nobody carried
(fastapi's opentelemetry and xgrammar's tvm-ffi once did)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "tools" / "gpu_wheels.py"
spec = importlib.util.spec_from_file_location("gpu_wheels", SCRIPT)
assert spec is not None and spec.loader is not None
gpu_wheels = importlib.util.module_from_spec(spec)
sys.modules["gpu_wheels"] = gpu_wheels
spec.loader.exec_module(gpu_wheels)


def test_the_host_gets_every_runtime_requirement_it_lacks():
    image = gpu_wheels.image_packages()
    carried = gpu_wheels.lacking(image)
    assert {"torch", "triton", "transformers", "numpy", "pytest"} <= image
    assert not {"torch", "triton", "transformers", "numpy"} & carried.keys()  # never carried
    # What earlier runs lacked: the gateway's and structured outputs' imports, the tests' schemas.
    assert {"pyzmq", "fastapi", "opentelemetry-api", "xgrammar", "apache-tvm-ffi", "grpcio",
            "grpcio-health-checking", "jsonschema"} <= carried.keys()
    for requirement in gpu_wheels.requirements("pipeserve"):
        name = gpu_wheels.canonical(requirement.name)
        assert name in image or name in carried, name
        if name in carried:  # the carried version meets pipeserve's own pin
            assert requirement.specifier.contains(carried[name], prereleases=True), (name, carried[name])


def test_requirements_resolve_for_the_host_not_this_machine():
    """Markers are evaluated for CPython 3.12 on Linux x86-64, whatever runs the script."""
    assert gpu_wheels.HOST["python_version"] == "3.12"
    names = {gpu_wheels.canonical(r.name) for r in gpu_wheels.requirements("xgrammar")}
    assert "triton" in names  # xgrammar asks for triton on Linux x86-64 only
