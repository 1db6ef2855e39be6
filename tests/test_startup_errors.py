"""Bad start-ups through the real CLI: each ends with exit status 2 and ONE line (besides log records)
that names the flag to fix, and no traceback; with --debug the traceback comes too. Most fail in
argument parsing, the configs' checks or the preflight, before any process starts; one fails in the
engine process (a KV cache smaller than a page), to show that its line reaches the user the same way."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import STORIES

pytestmark = [
    pytest.mark.slow,  # real processes: a CLI per start-up
    pytest.mark.timeout(300),
    pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason=f"stories260K not found at {STORIES}"),
]
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")  # the processes' logging format
M = str(STORIES)

# (what is wrong, the command line after `pipeserve`, the flag the one line must name)
CASES: list[tuple[str, list[str], str]] = [
    ("port above 65535", ["up", "--port", "70000"], "--port"),
    ("port that would wrap onto one in use", ["serve", M, "--port", "99999"], "--port"),
    ("http port 0", ["serve", M, "--http-port", "0"], "--http-port"),
    ("negative metrics port", ["serve", M, "--metrics-port=-1"], "--metrics-port"),
    ("port not a number", ["up", "--port", "grpc"], "--port"),
    ("unknown dtype", ["serve", M, "--dtype", "int4"], "--dtype"),
    ("unknown quantization", ["serve", M, "--quantization", "int3"], "--quantization"),
    ("page size not a number", ["serve", M, "--page-size", "x"], "--page-size"),
    ("no KV cache", ["serve", M, "--kv-cache-gb", "0"], "--kv-cache-gb"),
    ("unknown device", ["serve", M, "--device", "tpu"], "--device"),
    ("CUDA device on a host without CUDA", ["serve", M, "--device", "cuda"], "--device"),
    ("GPU memory fraction above 1", ["serve", M, "--gpu-memory-utilization", "1.5"],
     "--gpu-memory-utilization"),
    ("empty pages", ["serve", M, "--page-size", "0"], "--page-size"),
    ("no sequences", ["serve", M, "--max-num-seqs", "0"], "--max-num-seqs"),
    ("no KV pages", ["serve", M, "--num-pages", "0"], "--num-pages"),
    ("tensor parallel size 0", ["serve", M, "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    ("data parallel size 0", ["serve", M, "--data-parallel-size", "0"], "--data-parallel-size"),
    ("no tokenizer workers", ["serve", M, "--tokenizer-workers", "0"], "--tokenizer-workers"),
    ("negative logprobs", ["serve", M, "--max-logprobs", "-1"], "--max-logprobs"),
    ("no start-up time", ["serve", M, "--startup-timeout", "0"], "--startup-timeout"),
    ("draft method without a draft", ["serve", M, "--speculative-method", "draft"], "--draft-model"),
    ("lookup bounds swapped", ["serve", M, "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
     "--prompt-lookup-min"),
    ("certificate without its key", ["serve", M, "--tls-cert", "cert.pem"], "--tls-cert"),
    ("context above the model's", ["serve", M, "--max-model-len", "100000"], "--max-model-len"),
    ("context 0", ["serve", M, "--max-model-len", "0"], "--max-model-len"),
    ("rope scaling that is no JSON", ["serve", M, "--rope-scaling", "linear"], "--rope-scaling"),
    ("context above what the rope scaling reaches",
     ["serve", M, "--rope-scaling", '{"rope_type": "linear", "factor": 2}', "--max-model-len", "2000"],
     "--max-model-len"),
    ("no such model", ["up", "--model", "/nonexistent/model"], "--model"),
    ("hub id not in the cache, offline", ["serve", "Qwen/Qwen2.5-0.5B-Instruct"],
     "--model Qwen/Qwen2.5-0.5B-Instruct is not in the Hugging Face cache"),
    ("no such tokenizer", ["serve", M, "--tokenizer", "/nonexistent/tokenizer"], "--tokenizer"),
    ("model given twice", ["serve", M, "--model", "/elsewhere"], "--model"),
    ("serve without a model", ["serve"], "MODEL"),
    ("a chat template that does not parse", ["serve", M, "--chat-template", "{% for m in messages %}{{ m }"],
     "--chat-template"),
    ("HTTP port equal to the gRPC port", ["serve", M, "--http-port", "{port}"], "--http-port"),
    ("gRPC port in use", ["serve", M, "--port", "{busy}"], "--port"),
    # Found by the engine process, once the model is loaded: its one line still reaches the user.
    ("KV cache smaller than a page", ["serve", M, "--kv-cache-gb", "0.000000001"], "--kv-cache-gb"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def start(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PIPESERVE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
                        "HF_HUB_CACHE": str(tmp_path / "hub")}  # empty: a hub id is not there
    return subprocess.run([sys.executable, "-m", "pipeserve.cli", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)


def fill(argv: list[str], busy: int) -> list[str]:
    port = free_port()
    out = [a.format(port=port, busy=busy) if a in ("{port}", "{busy}") else a for a in argv]
    if "--port" not in out:
        out += ["--port", str(port)]  # never the default port another server on this host may hold
    if "--http-port" not in out:
        out += ["--http-port", str(free_port())]
    return out


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize(("what", "argv", "flag"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_start_up_is_one_line_naming_the_flag(what: str, argv: list[str], flag: str, busy_port: int,
                                                    tmp_path: Path) -> None:
    out = start(fill(argv, busy_port), tmp_path)
    assert out.returncode == 2, (what, out.stdout, out.stderr)
    lines = (out.stdout + out.stderr).splitlines()
    said = [line for line in lines if line.strip() and not LOG_RECORD.match(line)]
    assert len(said) == 1, (what, said)
    assert ": error: " in said[0] and flag in said[0], (what, said[0])
    assert "Traceback" not in out.stdout + out.stderr, what


def test_debug_adds_the_traceback(tmp_path: Path) -> None:
    out = start(["serve", M, "--port", str(free_port()), "--http-port", str(free_port()),
                 "--tokenizer", "/nonexistent/tokenizer", "--debug"], tmp_path)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "Traceback" in out.stderr and last.startswith("pipeserve serve: error: --tokenizer")


def test_the_engine_process_alone_reports_one_line(tmp_path: Path) -> None:
    """`pipeserve engine` as compose runs it: a bad config is one line and exit 2 there too."""
    out = start(["engine", "--model", M, "--device", "cpu", "--kv-cache-gb", "0.000000001",
                 "--requests", f"ipc://{tmp_path}/r", "--control", f"ipc://{tmp_path}/c"], tmp_path)
    said = [line for line in out.stderr.splitlines() if not LOG_RECORD.match(line)]
    assert out.returncode == 2 and said == [
        "pipeserve engine: error: --kv-cache-gb is too small for one KV page of this model: raise it (or "
        "--num-pages), or lower --page-size"
    ], out.stderr

