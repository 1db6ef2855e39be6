"""tools/install.py and `make wheelhouse`: the wheelhouse holds every runtime dependency but torch and
triton; an install from it with --no-index into a fresh venv that already has torch keeps that torch
and runs `pipeserve --version`; the built distribution puts only `pipeserve` at the top level."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("install_tool", ROOT / "tools" / "install.py")
assert spec is not None and spec.loader is not None
install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install)


def test_requirement_names_are_normalised() -> None:
    assert install.requirement_name("Foo_Bar.baz[x]>=1; python_version<'4'") == "foo-bar-baz"
    assert install.requirement_name("lm-eval[api,hf]>=0.4.5") == "lm-eval"


def test_runtime_requirements_leave_out_the_extras() -> None:
    runtime = {install.requirement_name(r) for r in install.requirements([])}
    assert {"torch", "triton", "pyzmq", "fastapi", "xgrammar"} <= runtime
    assert not runtime & {"ray", "pytest", "mypy", "lm-eval", "matplotlib", "rich"}
    dev = {install.requirement_name(r) for r in install.requirements(["dev", "bench", "ray"])}
    assert {"pytest", "ray", "matplotlib", "lm-eval"} <= dev
    with pytest.raises(SystemExit, match="no extra"):
        install.requirements(["gpu"])


def test_the_wheel_puts_only_pipeserve_at_the_top_level(tmp_path: Path) -> None:
    """What `pip install .` puts into site-packages is the wheel's content."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("pipeserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
    assert top == {"pipeserve", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top


def _index_reachable(tmp: Path) -> bool:
    out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp),
                          "--only-binary=:all:", "--python-version", "3.12", "--platform",
                          "manylinux2014_x86_64", "msgpack"], capture_output=True, text=True, timeout=180)
    return out.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_offline_install_from_the_wheelhouse_keeps_torch(tmp_path: Path) -> None:
    """`make wheelhouse` for this machine's Python, then a fresh venv holding torch and triton (as a
    GPU host's would) gets the project and its missing dependencies from the wheelhouse alone."""
    import torch
    import triton

    if not _index_reachable(tmp_path / "probe"):
        pytest.skip("pip cannot reach the package index")
    wheelhouse = tmp_path / "wheelhouse"
    python_version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    out = subprocess.run(["make", "-C", str(ROOT), "wheelhouse", f"WHEELHOUSE={wheelhouse}",
                          f"PY={sys.executable}", f"PYTHON_VERSION={python_version}"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    wheels = sorted(p.name for p in wheelhouse.glob("*.whl"))
    names = {install.requirement_name(w.split("-")[0]) for w in wheels}
    assert not names & {"torch", "triton"} and not any(n.startswith("nvidia") for n in names), wheels
    runtime = {install.requirement_name(r) for r in install.requirements([])} - {"torch", "triton"}
    assert runtime <= names, runtime - names
    assert {"setuptools", "wheel"} <= names  # the build backend, to build the checkout offline

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    # The host's torch stack, installed beforehand from this machine's own sources.
    stack = [f"torch=={torch.__version__}", f"triton=={triton.__version__}"]
    subprocess.run([python, "-m", "pip", "install", "-q", *stack], check=True, timeout=900)
    before = install.probe(python)

    out = subprocess.run([sys.executable, str(ROOT / "tools" / "install.py"), "venv", str(venv),
                          "--wheelhouse", str(wheelhouse)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "keeping torch" in out.stdout
    assert all("--no-index" in line for line in out.stdout.splitlines() if line.startswith("+ "))
    assert install.probe(python) == before  # torch and triton untouched
    version = subprocess.run([str(venv / "bin" / "pipeserve"), "--version"], capture_output=True, text=True,
                             timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("pipeserve 0."), version
    # The installed distribution's own files: only the package and its metadata at the top level.
    paths = "import json, sysconfig; print(json.dumps(sysconfig.get_paths()))"
    site = json.loads(subprocess.run([python, "-c", paths], capture_output=True, text=True,
                                     check=True).stdout)["purelib"]
    record = next(Path(site).glob("pipeserve-*.dist-info")) / "RECORD"
    top = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    assert top == {"pipeserve", record.parent.name, ".."}, top  # "..": the console script in bin/
    shutil.rmtree(venv)


def _dry_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base: dict, inside: dict,
              wheelhouse: bool, extras: str = "dev") -> tuple[list[list[str]], list[str]]:
    """Run `install.py venv` with pip and venv recorded instead of run: (commands, constraints). A
    --dry-run's report says pip would install xgrammar, its Triton and msgpack."""
    commands: list[list[str]] = []
    constraints: list[str] = []
    venv = tmp_path / "venv"
    house = tmp_path / "wheelhouse"
    if wheelhouse:
        house.mkdir()
        (house / "msgpack-1.0-py3-none-any.whl").write_bytes(b"")

    def probe(python: str) -> dict:
        return dict(base if python == sys.executable else inside)

    def run(cmd: list[str]) -> None:
        commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "python").write_text("")
        if "-c" in cmd:
            constraints.extend(Path(cmd[cmd.index("-c") + 1]).read_text().split())
        if "--report" in cmd:
            items = [{"metadata": {"name": n, "version": v}}
                     for n, v in (("xgrammar", "0.2.8"), ("triton", "3.6.0"), ("msgpack", "1.2.4"))]
            Path(cmd[cmd.index("--report") + 1]).write_text(json.dumps({"install": items}))

    monkeypatch.setattr(install, "probe", probe)
    monkeypatch.setattr(install, "run", run)
    assert install.main(["venv", str(venv), "--wheelhouse", str(house), "--extras", extras]) == 0
    return commands, constraints


def test_a_cuda_torch_of_the_base_python_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = {"torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0", "triton_dist": "triton"}
    commands, constraints = _dry_venv(tmp_path, monkeypatch, cuda, cuda, wheelhouse=True)
    assert commands[0][1:] == ["-m", "venv", "--system-site-packages", str(tmp_path / "venv")]
    pips = [c for c in commands if c[1:4] == ["-m", "pip", "install"]]
    assert len(pips) == 2 and all("--no-index" in c for c in pips)  # the wheelhouse only
    asked = {install.requirement_name(a) for c in pips for a in c if a[0].isalpha() and "==" not in a}
    assert not asked & {"torch", "triton"} and {"pyzmq", "pytest"} <= asked
    assert constraints == ["torch==2.11.0+cu130", "triton==3.6.0"] * 2
    assert pips[1][-2:] == ["--no-deps", str(ROOT)]  # the project last, its dependencies already in


def test_without_torch_the_pinned_one_is_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    none = {"torch": None, "cuda": None, "triton": None, "triton_dist": None}
    commands, _ = _dry_venv(tmp_path, monkeypatch, none, none, wheelhouse=False)
    assert commands[0][1:] == ["-m", "venv", str(tmp_path / "venv")]
    assert commands[1][-1] == "torch==2.13.0"
    assert not any("--no-index" in c for c in commands)


CPU_TORCH = {"torch": "2.13.0+cpu", "cuda": None, "triton": None, "triton_dist": None}


def test_a_cpu_torch_gets_no_triton(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime install on a CPU host: one resolution (--dry-run), then exactly what it chose but
    Triton, --no-deps; the project last."""
    commands, _ = _dry_venv(tmp_path, monkeypatch, CPU_TORCH, CPU_TORCH, wheelhouse=False, extras="")
    pips = [c for c in commands if c[1:4] == ["-m", "pip", "install"]]
    assert len(pips) == 3
    dry, deps, project = pips
    assert "--dry-run" in dry
    assert not any(install.requirement_name(a) == "triton" for a in dry if a[0].isalpha())
    assert "xgrammar>=0.2.5,<0.3" in dry
    assert deps[-3:] == ["--no-deps", "xgrammar==0.2.8", "msgpack==1.2.4"]
    assert project[-2:] == ["--no-deps", str(ROOT)]


def test_the_tests_extra_brings_triton_to_a_cpu_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dev asks for Triton (the tests interpret its kernels on the CPU): pip resolves as usual."""
    commands, _ = _dry_venv(tmp_path, monkeypatch, CPU_TORCH, CPU_TORCH, wheelhouse=False, extras="dev")
    pips = [c for c in commands if c[1:4] == ["-m", "pip", "install"]]
    assert len(pips) == 2 and not any("--dry-run" in c for c in pips)
    assert "triton>=3.3" in pips[0] and "--no-deps" not in pips[0]


def test_no_compile_reaches_every_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(install, "probe", lambda python: dict(CPU_TORCH))
    monkeypatch.setattr(install, "run", commands.append)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    assert install.main(["venv", str(tmp_path / "venv"), "--no-compile", "--extras", "dev"]) == 0
    assert commands and all("--no-compile" in c for c in commands)
