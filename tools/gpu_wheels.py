"""Wheels of what a lent GPU host lacks, to carry with the checkout (the host has no network).

    .venv/bin/python tools/gpu_wheels.py [DIR]       # default .whl (git-ignored); then
    tools/gpu_run.sh OUT --wheels DIR ...            # installs them into a private folder there
    .venv/bin/python tools/gpu_wheels.py --list      # the packages only

The packages: pipeserve's runtime requirements and theirs, as they resolve for the host (CPython 3.12,
Linux x86-64), except those the host's image has (tools/gpu_image_packages.txt), whose own
requirements the image has too; plus grpcio, which the image has older than the generated health
stubs need, and the device tests' jsonschema. Each at the version this environment has installed,
fetched with `pip download --no-deps` (pip's resolver would pull torch) for manylinux x86-64.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
HOST = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
        "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
ALWAYS = ("grpcio",)  # in the image, but older than the generated stubs accept
TESTS = ("jsonschema",)  # the structured-output device tests validate against schemas with it
PLATFORMS = ("manylinux1_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in
                                                             (17, 24, 26, 27, 28, 31, 34, 35)))


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def image_packages(path: Path = HERE / "gpu_image_packages.txt") -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {canonical(line) for line in lines if line and not line.startswith("#")}


def requirements(name: str) -> list[Requirement]:
    """name's requirements that apply on the host (no extras)."""
    found = (Requirement(r) for r in metadata.requires(name) or [])
    return [r for r in found if r.marker is None or r.marker.evaluate(HOST)]


def lacking(image: set[str]) -> dict[str, str]:
    """name -> installed version of every package the host lacks, in name order."""
    todo = [Requirement(n) for n in (*ALWAYS, *TESTS)] + requirements("pipeserve")
    found: dict[str, str] = {}
    while todo:
        name = canonical(todo.pop().name)
        if name in found or (name in image and name not in ALWAYS):
            continue
        found[name] = metadata.version(name)
        todo += requirements(name)
    return dict(sorted(found.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=".whl", help="where the wheels go")
    parser.add_argument("--list", action="store_true", help="print the packages, download nothing")
    args = parser.parse_args()
    packages = lacking(image_packages())
    if args.list:
        print("\n".join(f"{name}=={version}" for name, version in packages.items()))
        return 0
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in packages.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", args.dir,
                        f"{name}=={version}"], check=True)
    print(f"{len(packages)} wheels in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
