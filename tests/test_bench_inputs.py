"""Benchmarks take their inputs as flags (--model, --trace), work on a user's own model and trace,
and say in one line what is missing, wherever the repository's shared assets are."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from pipeserve.bench import offline, quant
from pipeserve.bench.workload import checkpoint, trace_paths

TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2023-11-16 18:15:{i:02d}.000,{20 + 3 * i},{4 + i % 5}\n" for i in range(12)
)


@pytest.fixture
def no_shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PIPESERVE_SHARED pointing at an empty folder: the defaults are missing."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PIPESERVE_SHARED", str(empty))
    return empty


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_missing_inputs_are_one_line(no_shared: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no trace: pass --trace FILE.csv"):
        trace_paths(None, "cmd")
    with pytest.raises(SystemExit, match="--trace .*missing.csv: no such file"):
        trace_paths([str(tmp_path / "missing.csv")], "cmd")
    with pytest.raises(SystemExit, match="no --model given and the default stories260K is not at"):
        checkpoint(None, "cmd")
    with pytest.raises(SystemExit, match="cmd: --model .*no such directory"):
        checkpoint(str(tmp_path / "nope"), "cmd")
    with pytest.raises(SystemExit, match="has no config.json"):
        checkpoint(str(tmp_path), "cmd")
    with pytest.raises(SystemExit, match="pipeserve bench offline: no trace"):
        offline.main(parse(offline, ["--no-hf"]))
    with pytest.raises(SystemExit, match="pipeserve bench quant: no --model given"):
        quant.main(parse(quant, ["--gpu", "off"]))


def test_offline_runs_on_a_users_own_model_and_trace(no_shared: Path, tmp_path: Path, stories_dir: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = shutil.copytree(stories_dir, tmp_path / "my-model")
    trace = tmp_path / "my-trace.csv"
    trace.write_text(TRACE)
    out = tmp_path / "offline.json"
    args = parse(offline, ["--model", str(model), "--trace", str(trace), "--num-requests", "4",
                           "--repeats", "1", "--batch-size", "2", "--no-hf", "--overhead-requests", "2",
                           "--overhead-context", "32", "--json", str(out)])
    assert offline.main(args) == 0
    result = json.loads(out.read_text())
    assert result["traces"] == [str(trace)]
    (entry,) = result["models"]
    assert entry["model"] == str(model) and entry["pipeserve_tok_s"] > 0
    assert "my-model" in capsys.readouterr().out
