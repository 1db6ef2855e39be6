"""`pipeserve serve MODEL` as vLLM users type it: the model positionally (for `up` too), the help that
says what is served, and the "serving" line naming every endpoint, each of which answers; the server
runs with its context doubled by --rope-scaling, which every process honours."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipeserve.cli import COMMANDS, main
from pipeserve.gateway.client import Client
from pipeserve.launcher import add_arguments, configs
from pipeserve.local_cluster import free_port
from tests.conftest import REPO, STORIES

pytestmark = [
    pytest.mark.slow,  # real processes: a CLI per start-up
    pytest.mark.timeout(240),
    pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason=f"stories260K not found at {STORIES}"),
]


def test_help_says_up_and_serve_serve_grpc_and_http(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    for name in ("serve", "up"):
        line = next(line for line in usage.splitlines() if line.split()[:1] == [name])
        assert "gRPC" in line and "HTTP" in line, line
    assert COMMANDS["serve"][0] == COMMANDS["up"][0]  # one launcher


def test_the_model_is_positional_for_up_and_serve() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(STORIES), "--port", str(free_port()), "--http-port", str(free_port())])
    args.prog = "pipeserve up"
    engine, _ = configs(args)
    assert engine.model == str(STORIES) and engine.served_model_name == "stories260K"


def test_serve_names_every_endpoint_and_each_answers(tmp_path: Path) -> None:
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port()}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeserve.cli", "serve", str(STORIES), "--device", "cpu",
             "--tokenizer-workers", "1", "--port", str(ports["grpc"]), "--http-port", str(ports["http"]),
             "--metrics-port", str(ports["metrics"]),
             "--rope-scaling", '{"rope_type": "linear", "factor": 2}', "--max-model-len", "1024",
             "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
        )
    try:
        deadline = time.monotonic() + 180
        while not (serving := [ln for ln in log_path.read_text().splitlines() if " serving " in ln]):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        line = serving[0]
        assert re.search(rf"serving stories260K: gRPC 127\.0\.0\.1:{ports['grpc']}, OpenAI HTTP "
                         rf"http://127\.0\.0\.1:{ports['http']}/v1 .*metrics http://127\.0\.0\.1:"
                         rf"{ports['metrics']}/metrics", line), line
        text = log_path.read_text()
        for phase in ("loading ", "sizing and allocating the KV cache", "compiling and warming up"):
            assert re.search(rf"{phase}.*: done in \d+\.\d s", text), phase
        with Client(f"127.0.0.1:{ports['grpc']}") as client:
            info = client.model_info()
            assert info.name == "stories260K" and info.context_length == 1024
            # Past the trained 512 positions: the tokenizer's limit and the engine's are the scaled ones.
            long = client.generate("Once upon a time", max_tokens=600, temperature=0.0, ignore_eos=True)
            assert len(long.token_ids) == 600
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/v1/models", timeout=10) as r:
            assert json.load(r)["data"][0]["id"] == "stories260K"
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10) as r:
            assert r.status == 200
        # A schema that does not compile (the engine's compilation finds it): a 400 before any stream.
        bad = {"name": "x", "schema": {"type": "object", "required": 5}}
        body = {"model": "stories260K", "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": "Once"}],
                "response_format": {"type": "json_schema", "json_schema": bad}}
        post = urllib.request.Request(f"http://127.0.0.1:{ports['http']}/v1/chat/completions",
                                      json.dumps(body).encode(), {"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=30)
        assert refused.value.code == 400
        assert "json_schema is invalid" in json.load(refused.value)["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
