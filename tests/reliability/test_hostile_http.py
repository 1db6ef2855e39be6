"""Hostile HTTP traffic against `pipeserve up`: bad bodies and content types, wrong paths and methods,
clients that leave mid-headers, mid-body and mid-stream, streams nobody reads, a heavy logprob
request beside a liveness probe. Every refusal is OpenAI-shaped, nothing is left behind, and the
server's log holds no traceback and no error for any of it."""

from __future__ import annotations

import socket
import threading
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a whole `pipeserve up`


def raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def request_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_hostile_http_leaves_no_traceback_and_no_state(pipeline: Any) -> None:
    start = pipeline.log_path.stat().st_size
    url = pipeline.http_url
    with httpx.Client(base_url=url, timeout=30) as http:
        for content, kind, status in ((b"{not json", "application/json", 400),
                                      (b'{"prompt": "x"}', "text/plain", 415),
                                      (b"prompt=x", "application/x-www-form-urlencoded", 415),
                                      (b'{"prompt": "x", "max_tokens": 600}', "application/json", 400)):
            response = http.post("/v1/completions", content=content, headers={"Content-Type": kind})
            assert response.status_code == status and "error" in response.json(), response.text
        assert http.get("/v1/nowhere").json()["error"]["code"] == "not_found"
        assert http.delete("/v1/completions").json()["error"]["code"] == "method_not_allowed"

    # Clients that leave: mid-headers, mid-body, before a non-streamed answer, mid-stream, unread.
    half = raw(url)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    half.close()
    body = raw(url)
    body.sendall(request_head("/v1/completions", 200) + b'{"prompt": "Once upon')
    body.close()
    # A whole non-streamed request, then the client hangs up before any answer can have come.
    long = b'{"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true}'
    gone = raw(url)
    gone.sendall(request_head("/v1/completions", len(long)) + long)
    gone.close()
    streamed = b'{"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true}'
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", content=streamed,
                         headers={"Content-Type": "application/json"}) as response:
            next(response.iter_lines())
    unread = [raw(url) for _ in range(4)]
    for sock in unread:
        sock.sendall(request_head("/v1/completions", len(streamed)) + streamed)
    for sock in unread:
        assert sock.recv(16).startswith(b"HTTP/1.1 200")  # streaming, and nobody reads on
    for sock in unread:
        sock.close()

    # A heavy logprob request beside the liveness probe: the probe keeps being answered.
    heavy = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True, "n": 8,
             "logprobs": 20}
    done = threading.Event()
    probes: list[int] = []

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            while not done.is_set():
                probes.append(http.get("/health").status_code)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=heavy) as response:
                events = sum(1 for line in response.iter_lines() if line.startswith("data: {"))
    finally:
        done.set()
        thread.join()
    assert events >= 8 and probes and set(probes) == {200}

    pipeline.wait_clean()
    with open(pipeline.log_path) as log:
        log.seek(start)
        written = log.read()
    assert "Traceback" not in written and " ERROR " not in written, written[-3000:]
