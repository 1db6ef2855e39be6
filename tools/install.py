"""Install pipeserve into a virtual environment, keeping the torch that is already there; or build
the wheelhouse such an install reads on a host without network.

    python3 tools/install.py venv VENV [--extras dev,bench] [--wheelhouse DIR] [--torch-version V] \\
        [--editable]
    python3 tools/install.py wheelhouse DIR [--python-version 3.12] [--extras ...]

`venv`'s rule (the Makefile's `serve`, `gpu-check`, `test`, ... and the Dockerfile use it):
- A torch that is already installed is kept, with its Triton: in VENV, or, when the interpreter
  running this script has a CUDA build of torch (an NVIDIA PyTorch container, a GPU host's system
  Python), there: VENV is then created with --system-site-packages so that it sees that torch.
  torch and triton are never installed or upgraded then: they are left out of what pip is asked for
  and pinned to their installed versions in a constraints file, so a dependency that wants another
  version fails to resolve instead of replacing them.
- Only without any torch is `torch==--torch-version` installed (pip then takes a CPU build where one
  lies on disk, as on the CI machine).
- With a wheelhouse (`make wheelhouse`: a folder of wheels) every other package, the build backend
  included, comes from it with --no-index: nothing is downloaded (an air-gapped host).
- Runtime dependencies always; the extras named by --extras besides (dev, bench, ray).
- Triton only where it runs: with a CUDA torch (which brings its own) or when an extra named asks for
  it (dev: the tests interpret the kernels on the CPU). With a CPU torch the CPU serving path never
  imports it, so it is left out: pip resolves everything once (--dry-run --report), then installs
  that set without Triton, --no-deps (xgrammar declares Triton for its GPU bitmask kernel only; on
  CPU logits it uses its own C++ one). `pip check` then names Triton as xgrammar's missing dependency.
- --no-compile: pip writes no bytecode for the ~10,000 modules it installs; Python writes it on
  first import for the modules a process imports (what uv does by default). An image whose venv the
  server cannot write (the Dockerfile's) leaves it out and compiles at build time.

`wheelhouse` downloads wheels of every runtime dependency (and of --extras) except torch and triton,
and of the build backend, for one Python version and manylinux x86-64, whatever this machine runs.

Standard library only: it runs before anything is installed."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEPT = ("torch", "triton", "pytorch-triton")

# Run with the interpreter being probed: its torch, CUDA and Triton, or nulls.
PROBE = """
import importlib.metadata as md, importlib.util, json
out = {"torch": None, "cuda": None, "triton": None, "triton_dist": None}
try:
    out["torch"] = md.version("torch")
    import torch
    out["cuda"] = torch.version.cuda
except Exception:
    pass
for dist in ("triton", "pytorch-triton"):
    try:
        out["triton"], out["triton_dist"] = md.version(dist), dist
        break
    except md.PackageNotFoundError:
        pass
if out["triton"] is None and importlib.util.find_spec("triton") is not None:
    out["triton"] = "module"
print(json.dumps(out))
"""


def probe(python: str) -> dict[str, str | None]:
    out = subprocess.run([python, "-c", PROBE], stdout=subprocess.PIPE, text=True, check=True)
    result: dict[str, str | None] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def requirement_name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement ("Foo_Bar[x]>=1" -> "foo-bar")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


PYPROJECT = os.path.join(ROOT, "pyproject.toml")


def optional_requirements(extras: list[str], pyproject: str = PYPROJECT) -> list[str]:
    """The requirements of `extras` alone, as pyproject.toml states them."""
    with open(pyproject, "rb") as f:
        optional = tomllib.load(f)["project"].get("optional-dependencies", {})
    found: list[str] = []
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"install.py: pyproject.toml has no extra {extra!r} "
                             f"(it has {', '.join(optional)})")
        found += optional[extra]
    return found


def requirements(extras: list[str], pyproject: str = PYPROJECT) -> list[str]:
    """The runtime dependencies and those of `extras`, as pyproject.toml states them."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    return [*project["dependencies"], *optional_requirements(extras, pyproject)]


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


# What `pip download --platform` may take for a Linux x86-64 host (newest first).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64", "linux_x86_64")
BUILD_BACKEND = ("setuptools>=68", "wheel")  # pyproject.toml's [build-system]: to build the checkout offline


def _wheel_of(folder: str, name: str) -> str | None:
    """The wheel of distribution `name` in `folder` (wheel names start with the escaped name)."""
    return next((n for n in os.listdir(folder)
                 if n.endswith(".whl") and requirement_name(n.split("-")[0]) == requirement_name(name)), None)


def _metadata(wheel: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return z.read(name).decode()


def wheelhouse(args: argparse.Namespace) -> int:
    """Walk the dependencies from the project's, one round of `pip download --no-deps` per level,
    reading each wheel's Requires-Dist with the target's markers, and never entering torch or triton:
    their own dependencies (the CUDA libraries among them) come with the host's torch, and pip's
    resolver would fetch a multi-gigabyte torch wheel just to read its metadata."""
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.markers import default_environment  # type: ignore[assignment]
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]

    env = {**default_environment(), "python_version": args.python_version,
           "python_full_version": f"{args.python_version}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    target = ["--only-binary=:all:", "--python-version", args.python_version, "--implementation", "cp",
              *[flag for p in PLATFORMS for flag in ("--platform", p)]]
    os.makedirs(args.dir, exist_ok=True)
    seen: set[str] = set()
    level = [*requirements(args.extras), *BUILD_BACKEND]
    while level:
        wanted = {}
        for text in level:
            req = Requirement(text)
            name = requirement_name(req.name)
            if name in KEPT or name in seen or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            wanted[name] = str(Requirement(text.split(";")[0]))  # the extras' own deps come below
            seen.add(name)
        if not wanted:
            break
        run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
             "--dest", args.dir, *target, *wanted.values()])
        level = []
        for text in wanted.values():
            req = Requirement(text)
            wheel = _wheel_of(args.dir, req.name)
            if wheel is None:
                raise SystemExit(f"install.py: pip downloaded no wheel for {text}")
            for line in _metadata(os.path.join(args.dir, wheel)).splitlines():
                if not line.startswith("Requires-Dist:"):
                    continue
                dep = Requirement(line.split(":", 1)[1].strip())
                wanted_extras = req.extras or {""}
                if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e}) for e in wanted_extras):
                    dep.marker = None
                    level.append(str(dep))
    wheels = [n for n in os.listdir(args.dir) if n.endswith(".whl")]
    assert not any(_wheel_of(args.dir, name) for name in KEPT), "torch or triton got in"
    print(f"install.py: {len(wheels)} wheels for Python {args.python_version} (no torch, no triton) "
          f"in {args.dir}")
    return 0


def resolve(pip: list[str], options: list[str], wanted: list[str]) -> list[tuple[str, str]]:
    """(name, version) of every package pip would install for `wanted`, nothing installed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        run([*pip, *options, "--dry-run", "--report", report, *wanted])
        with open(report) as f:
            items = json.load(f)["install"]
    return [(item["metadata"]["name"], item["metadata"]["version"]) for item in items]


def venv(args: argparse.Namespace) -> int:
    python = os.path.join(args.venv, "bin", "python")
    if not os.path.exists(python):
        base = probe(sys.executable)
        shared = base["torch"] is not None and base["cuda"] is not None
        if shared:
            print(f"install.py: {sys.executable} has torch {base['torch']} (CUDA {base['cuda']}): "
                  f"{args.venv} sees it (--system-site-packages)", flush=True)
        run([sys.executable, "-m", "venv", *(["--system-site-packages"] if shared else []), args.venv])
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q",
           *(["--no-compile"] if args.no_compile else []), *shlex.split(args.pip_args)]
    offline = os.path.isdir(args.wheelhouse) and any(n.endswith(".whl") for n in os.listdir(args.wheelhouse))
    source = ["--no-index", "--find-links", args.wheelhouse] if offline else []

    found = probe(python)
    if found["torch"] is None:
        if offline:
            print(f"install.py: no torch here and {args.wheelhouse} has none (it never holds torch): "
                  f"install torch first, or pip tries the index for torch=={args.torch_version}", flush=True)
        run([*pip, f"torch=={args.torch_version}"])
        found = probe(python)
    else:
        print(f"install.py: keeping torch {found['torch']} (CUDA {found['cuda'] or 'none'}) and triton "
              f"{found['triton'] or 'none'}: neither is installed nor upgraded", flush=True)

    # Pin what is kept; leave it out of what pip is asked for.
    pins = [f"torch=={found['torch']}"]
    if found["triton_dist"] is not None:
        pins.append(f"{found['triton_dist']}=={found['triton']}")
    kept = {"torch"} | ({"triton"} if found["triton"] is not None else set())
    wanted = [r for r in requirements(args.extras) if requirement_name(r) not in kept]
    # Triton without a CUDA torch only when an extra asks for it (see the module's docstring).
    asked = {requirement_name(r) for r in optional_requirements(args.extras)}
    no_triton = found["triton"] is None and found["cuda"] is None and "triton" not in asked
    if no_triton:
        wanted = [r for r in wanted if requirement_name(r) != "triton"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(pins) + "\n")
    try:
        if no_triton:
            resolved = resolve(pip, [*source, "-c", f.name], wanted)
            left = [f"{name}=={version}" for name, version in resolved if requirement_name(name) not in KEPT]
            print(f"install.py: torch {found['torch']} has no CUDA: Triton is left out (the CPU engine never "
                  f"imports it); {len(left)} packages installed as resolved, --no-deps", flush=True)
            if left:
                run([*pip, *source, "-c", f.name, "--no-deps", *left])
        else:
            run([*pip, *source, "-c", f.name, *wanted])
        if not args.deps_only:
            target = ["-e", ROOT] if args.editable else [ROOT]
            run([*pip, *source, "-c", f.name, "--no-deps", *target])
    finally:
        os.unlink(f.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def extras(p: argparse.ArgumentParser) -> None:
        p.add_argument("--extras", type=lambda v: [e for e in v.split(",") if e], default=[],
                       help="comma-separated extras besides the runtime dependencies")

    p = commands.add_parser("venv", help="install into a virtual environment (created if missing)")
    p.add_argument("venv")
    extras(p)
    p.add_argument("--wheelhouse", default=os.path.join(ROOT, "wheelhouse"),
                   help="install from this folder with --no-index when it holds wheels")
    p.add_argument("--torch-version", default="2.13.0", help="the torch installed when there is none")
    p.add_argument("--editable", action="store_true", help="install the checkout in editable mode")
    p.add_argument("--deps-only", action="store_true",
                   help="the dependencies, not the project (a Docker layer)")
    p.add_argument("--no-compile", action="store_true",
                   help="no bytecode at install time: Python writes it on first import (a writable venv)")
    p.add_argument("--pip-args", default="", help="extra pip options, e.g. '--find-links DIR'")
    p.set_defaults(run=venv)
    p = commands.add_parser("wheelhouse", help="download the wheels an offline install needs")
    p.add_argument("dir")
    p.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    extras(p)
    p.set_defaults(run=wheelhouse)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
