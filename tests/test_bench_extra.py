"""The `pipeserve[bench]` extra: serving runs without matplotlib and rich, and the benchmark commands
without them print how to install them instead of a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeserve import cli

REPO = Path(__file__).resolve().parent.parent

# A meta-path finder ahead of every other: importing the extra's packages fails as if they were not
# installed (find_spec returns None, import raises ModuleNotFoundError).
BLOCK = """
import sys
BLOCKED = {blocked!r}

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Block())
"""

SERVING = [
    "pipeserve.launcher",
    "pipeserve.local_cluster",
    "pipeserve.gateway.server",
    "pipeserve.gateway.client",
    "pipeserve.tokenizer.worker",
    "pipeserve.detokenizer.worker",
    "pipeserve.engine.process",
    "pipeserve.engine",
]


@pytest.mark.parametrize("argv", [["roofline"], ["simulate"], ["bench", "offline"], ["bench", "reliability"]])
def test_bench_commands_without_the_extra_say_how_to_install_it(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: not importable
    assert cli.main([*argv, "--help"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pipeserve {' '.join(argv)} needs matplotlib: pip install 'pipeserve[bench]'"]


def test_pipeserve_bench_without_the_extra_in_a_fresh_interpreter() -> None:
    code = BLOCK.format(blocked=list(cli.BENCH_EXTRA)) + """
from pipeserve.cli import main
sys.exit(main(["bench", "serve", "--target", "127.0.0.1:1"]))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    expected = "pipeserve bench serve needs matplotlib, rich, aiohttp: pip install 'pipeserve[bench]'"
    assert proc.stderr.strip() == expected
    assert proc.stdout == ""


def test_serving_commands_do_not_need_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in cli.BENCH_EXTRA:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--help"])  # argparse: usage on stdout, exit 0
    assert exit_.value.code == 0 and "--tokenizer-workers" in capsys.readouterr().out


def test_bench_commands_with_the_extra_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.missing_bench_extra() == []
    assert cli.main(["roofline", "--model", "llama-2-7b", "--gpu", "H100-SXM", "--batch", "1"]) == 0
    assert "llama-2-7b" in capsys.readouterr().out.lower()


@pytest.mark.timeout(120)
def test_serving_modules_import_and_serve_without_matplotlib_or_rich() -> None:
    """Every serving module imports with the extra blocked, and a gateway starts and answers health
    (the engine side is not running, so it says NOT_SERVING)."""
    code = BLOCK.format(blocked=list(cli.BENCH_EXTRA)) + f"""
import importlib, tempfile
for name in {SERVING!r}:
    importlib.import_module(name)
from pipeserve.config import Addresses, GatewayConfig
from pipeserve.gateway.client import Client
from pipeserve.gateway.server import Gateway
import asyncio

async def main():
    gateway = Gateway(GatewayConfig(port=0), Addresses.under(tempfile.mkdtemp()))
    port = await gateway.start()
    status = await asyncio.to_thread(lambda: Client(f"127.0.0.1:{{port}}").health(timeout=5))
    await gateway.stop(0)
    print("health", status)

asyncio.run(main())
assert not any(m.split(".")[0] in {list(cli.BENCH_EXTRA)!r} for m in sys.modules), "the extra got imported"
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "health NOT_SERVING"
