"""The HTTP side of `pipeserve bench reliability` (and of tests/reliability/test_hostile_http.py):
hostile traffic against the OpenAI API of a running `pipeserve up`.

- bad requests: wrong bodies, content types, paths, methods and parameters, each expected to get an
  OpenAI-shaped error with its status and naming the field the client sent (`param`) or the code;
- clients that leave: mid-headers, mid-body, before a non-streamed answer, mid-stream, and streams
  nobody reads (then the pipeline must hold no state for them);
- slow headers: connections sending their headers a byte at a time, closed at --http-header-timeout;
- heavy logprob streams (n choices x top-20 logprobs) beside a liveness probe: /health latency;
- the server's log over all of it: no traceback, no ERROR line.
"""

from __future__ import annotations

import json
import select
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pipeserve.config import GatewayConfig
from pipeserve.local_cluster import LocalCluster

JSON = "application/json"
PROMPT = "Once upon a time"


@dataclass
class HttpCase:
    name: str
    method: str
    path: str
    body: bytes
    content_type: str
    status: int  # expected
    param: str | None = None  # the error must name this field (OpenAI's "param")
    code: str | None = None  # or carry this code


@dataclass
class HttpCaseResult:
    name: str
    expected: str
    got: str
    passed: bool
    ms: float


def _body(**fields: Any) -> bytes:
    return json.dumps({"prompt": PROMPT, "max_tokens": 2} | fields).encode()


def http_cases(context_len: int) -> list[HttpCase]:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    post = "POST"
    return [
        HttpCase("not JSON", post, "/v1/completions", b"{not json", JSON, 400),
        HttpCase("text/plain body", post, "/v1/completions", _body(), "text/plain", 415,
                 code="unsupported_media_type"),
        HttpCase("form body", post, "/v1/completions", b"prompt=x", "application/x-www-form-urlencoded", 415,
                 code="unsupported_media_type"),
        HttpCase("no content type", post, "/v1/completions", _body(), "", 415, code="unsupported_media_type"),
        HttpCase("unknown path", "GET", "/v1/nowhere", b"", "", 404, code="not_found"),
        HttpCase("wrong method", "DELETE", "/v1/completions", b"", "", 405, code="method_not_allowed"),
        HttpCase("prompt missing", post, "/v1/completions", b'{"max_tokens": 2}', JSON, 400, "prompt"),
        HttpCase("empty prompt list", post, "/v1/completions", _body(prompt=[]), JSON, 400, "prompt"),
        HttpCase("token id out of range", post, "/v1/completions", _body(prompt=[1, -5]), JSON, 400,
                 "prompt"),
        HttpCase("max_tokens beyond the context", post, "/v1/completions", _body(max_tokens=context_len + 1),
                 JSON, 400, "max_tokens"),
        HttpCase("max_tokens negative", post, "/v1/completions", _body(max_tokens=-1), JSON, 400,
                 "max_tokens"),
        HttpCase("n 0", post, "/v1/completions", _body(n=0), JSON, 400, "n"),
        HttpCase("temperature a string", post, "/v1/completions", _body(temperature="hot"), JSON, 400,
                 "temperature"),
        HttpCase("logprobs above the limit", post, "/v1/completions", _body(logprobs=1000), JSON, 400,
                 "logprobs"),
        HttpCase("unknown model", post, "/v1/completions", _body(model="no-such-model"), JSON, 404, "model"),
        HttpCase("chat: messages missing", post, "/v1/chat/completions", b'{"max_tokens": 2}', JSON, 400,
                 "messages"),
        HttpCase("chat: top_logprobs without logprobs", post, "/v1/chat/completions",
                 json.dumps(chat | {"top_logprobs": 2}).encode(), JSON, 400, "top_logprobs"),
        HttpCase("chat: a role that is no role", post, "/v1/chat/completions",
                 json.dumps(chat | {"messages": [{"role": "wizard", "content": "hi"}]}).encode(), JSON, 400,
                 "messages"),
        HttpCase("served (control)", post, "/v1/completions", _body(), JSON, 200),
    ]


def run_http_cases(url: str, context_len: int) -> list[HttpCaseResult]:
    results = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for case in http_cases(context_len):
            headers = {"Content-Type": case.content_type} if case.content_type else {}
            start = time.perf_counter()
            response = http.request(case.method, case.path, content=case.body or None, headers=headers)
            ms = (time.perf_counter() - start) * 1e3
            try:
                error = response.json().get("error") or {}
            except ValueError:
                error = {"unparsed": response.text[:100]}
            expected = f"{case.status} {case.param or case.code or ''}".strip()
            got = f"{response.status_code} {error.get('param') or error.get('code') or ''}".strip()
            named = (case.param is None or error.get("param") == case.param) and (
                case.code is None or error.get("code") == case.code)
            shaped = case.status == 200 or {"message", "type", "code"} <= set(error)
            results.append(HttpCaseResult(case.name, expected, got,
                                          response.status_code == case.status and named and shaped, ms))
    return results


# ---- clients that leave ---------------------------------------------------------------------------
def raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def request_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def disconnects(url: str, unread: int = 4) -> int:
    """Clients that leave at every point of a request; how many left."""
    half = raw(url)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    half.close()
    body = raw(url)
    body.sendall(request_head("/v1/completions", 200) + b'{"prompt": "Once upon')
    body.close()
    long = json.dumps({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}).encode()
    gone = raw(url)
    gone.sendall(request_head("/v1/completions", len(long)) + long)
    gone.close()
    streamed = json.dumps({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", content=streamed, headers={"Content-Type": JSON}) as resp:
            next(resp.iter_lines())
    socks = [raw(url) for _ in range(unread)]
    for sock in socks:
        sock.sendall(request_head("/v1/completions", len(streamed)) + streamed)
    for sock in socks:
        if not sock.recv(16).startswith(b"HTTP/1.1 200"):  # streaming, and nobody reads on
            raise RuntimeError("an unread stream did not start")
    for sock in socks:
        sock.close()
    return 4 + unread


def slow_headers(url: str, connections: int, seconds: float) -> dict[str, float]:
    """connections sending their headers a byte every 0.5 s for up to `seconds`: how many the server
    ended (closed, or answered with a refusal), and after how long."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 400
    open_ = {raw(url): 0 for _ in range(connections)}
    ended: list[float] = []
    start = time.monotonic()
    for byte in head:
        if not open_ or time.monotonic() - start > seconds:
            break
        for sock in list(open_):
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                pass  # closed under us: select sees it below
        time.sleep(0.5)
        readable, _, _ = select.select(list(open_), [], [], 0)
        for sock in readable:  # an answer or the end of the connection: the server ended it
            ended.append(time.monotonic() - start)
            del open_[sock]
            sock.close()
    for sock in open_:
        sock.close()
    return {"connections": connections, "closed": len(ended),
            "closed_after_s_max": max(ended) if ended else float("nan")}


# ---- heavy logprobs beside a probe ----------------------------------------------------------------
@dataclass
class HeavyResult:
    streams: int
    n: int
    tokens: int
    events: list[int] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    health_not_ok: int = 0  # probes answered with anything but 200

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.health_ms)
        return {"probes": len(ordered), "p50_ms": statistics.median(ordered),
                "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_ms": ordered[-1]}


def heavy_beside_probe(url: str, streams: int = 2, n: int = 24, tokens: int = 440) -> HeavyResult:
    """streams streamed completions of n choices with top-20 logprobs, read fully, while /health is
    probed every 50 ms."""
    heavy = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True, "n": n,
             "logprobs": 20}
    result = HeavyResult(streams, n, tokens)
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while not done.is_set():
                start = time.perf_counter()
                result.health_not_ok += http.get("/health").status_code != 200
                result.health_ms.append((time.perf_counter() - start) * 1e3)
                time.sleep(0.05)

    def stream() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            with http.stream("POST", "/v1/completions", json=heavy) as response:
                result.events.append(sum(1 for line in response.iter_lines() if line.startswith("data: {")))

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        workers = [threading.Thread(target=stream) for _ in range(streams)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        done.set()
        prober.join()
    return result


# ---- the whole HTTP scenario ----------------------------------------------------------------------
def run(cluster: LocalCluster, heavy_streams: int = 2, heavy_n: int = 24, heavy_tokens: int = 440,
        slow_connections: int = 8) -> dict[str, Any]:
    """Every HTTP case against cluster; the figures `bench reliability` reports."""
    start = cluster.log_path.stat().st_size
    url = cluster.http_url
    context_len = int(httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"])
    cases = run_http_cases(url, context_len)
    figures: dict[str, Any] = {
        "tried": len(cases), "passed": sum(c.passed for c in cases),
        "failed": [vars(c) for c in cases if not c.passed],
    }
    figures["disconnects"] = disconnects(url)
    figures["disconnect_state_left"] = cluster.wait_clean()
    timeout = cluster_header_timeout(cluster)
    figures["slow_headers"] = slow_headers(url, slow_connections, timeout + 3.0)
    heavy = heavy_beside_probe(url, heavy_streams, heavy_n, heavy_tokens)
    figures["heavy"] = {"streams": heavy.streams, "n": heavy.n, "tokens": heavy.tokens,
                        "events": heavy.events, "health": heavy.summary(),
                        "health_not_ok": heavy.health_not_ok}
    figures["state_left"] = cluster.wait_clean()
    with open(cluster.log_path) as log:
        log.seek(start)
        written = log.read()
    figures["log_tracebacks"] = written.count("Traceback")
    figures["log_errors"] = sum(" ERROR " in line for line in written.splitlines())
    return figures


def cluster_header_timeout(cluster: LocalCluster) -> float:
    """The --http-header-timeout the cluster runs with (its flags, else the default)."""
    argv = cluster.proc.args if isinstance(cluster.proc.args, list) else []
    if "--http-header-timeout" in argv:
        return float(argv[argv.index("--http-header-timeout") + 1])
    return GatewayConfig().http_header_timeout
