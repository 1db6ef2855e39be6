"""`pipeserve up` in a subprocess, with probes into its processes and its metrics.

The one process harness: the end-to-end tests, the reliability tests and the benchmarks that need
a whole pipeline (`pipeserve bench reliability`, `pipeserve bench soak`) all start the server this
way, exactly as an operator would, so that they exercise the launcher's supervision (restarts,
ordered shutdown) too. Use it as a context manager, or call stop().
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from pipeserve.gateway.client import Client
from pipeserve.launcher import children_of

ROOT = Path(__file__).resolve().parents[1]
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# Per-request counts the engine reports (pipeserve_engine{name=...}); all 0 when nothing is left.
ENGINE_STATE = ("running", "waiting", "pages_used", "requests", "detok_requests")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape(port: int) -> dict[str, float]:
    """Prometheus metrics served on 127.0.0.1:port, by sample name with labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


class LocalCluster:
    """Starts `pipeserve up` (its output in log_path) and returns once its health says SERVING."""

    def __init__(
        self,
        log_path: Path,
        model: str | None,
        *flags: str,
        workers: int = 2,
        device: str = "cpu",
        startup: float = 120.0,
        security: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """model None: the demo model. flags go to `pipeserve up`; security to the Client (TLS root
        certificate and server name, API key) when the flags make the gateway require it; env adds
        to the environment (e.g. a Hugging Face cache)."""
        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.http_url = f"http://127.0.0.1:{self.http_port}"  # the OpenAI-compatible API
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log: IO[str] = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        argv = [
            *(["--model", model] if model else []),
            *["--device", device, "--port", str(self.port), "--metrics-port", str(self.metrics_port)],
            *["--http-port", str(self.http_port)],
            *["--tokenizer-workers", str(workers), *flags],
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeserve.cli", "up", *argv],
            cwd=ROOT,
            env=os.environ | (env or {}),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.security = security or {}
        self.client = Client(self.target, **self.security)
        self.health_seen: list[str] = []  # every status observed during start-up, in order
        try:
            self.wait(self._serving, startup, "SERVING")
        except BaseException:
            self.stop()
            raise
        self.children_at_serving = self.children()

    def _serving(self) -> bool:
        status = self.client.health(timeout=1)
        if not self.health_seen or status != self.health_seen[-1]:
            self.health_seen.append(status)
        return status == "SERVING"

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def wait(self, predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise RuntimeError(f"pipeserve up exited while waiting for {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached in {timeout} s:\n{self.tail()}")
            time.sleep(0.05)

    # ---- processes ------------------------------------------------------------------------------
    def children(self) -> dict[int, str]:
        """pid -> subcommand ("engine", "tokenizer", ...) of the launcher's live children."""
        return children_of(self.proc.pid)

    def pids(self, name: str) -> list[int]:
        return sorted(pid for pid, sub in self.children().items() if sub == name)

    def processes(self) -> dict[str, int]:
        """Every process of the pipeline by name: launcher, engine, detokenizer, gateway and
        tokenizer-0..N-1 (numbered in pid order, i.e. start order)."""
        out, tokenizers = {"launcher": self.proc.pid}, 0
        for pid, sub in sorted(self.children().items()):
            if sub == "tokenizer":
                sub, tokenizers = f"tokenizer-{tokenizers}", tokenizers + 1
            out[sub] = pid
        return out

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of each process (see processes()), in MiB, read from /proc."""
        out: dict[str, float] = {}
        for name, pid in self.processes().items():
            try:
                out[name] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES / 2**20
            except (FileNotFoundError, IndexError):
                continue
        return out

    # ---- metrics --------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port)

    def engine(self, name: str) -> float:
        """One of the engine's gauges as the gateway last heard it (running, steps, pages_used, ...)."""
        return self.metrics()[f'pipeserve_engine{{name="{name}"}}']

    def settled_engine(self, name: str, changed_from: float, quiet: float = 1.5,
                       timeout: float = 20.0) -> float:
        """An engine counter once it moved off `changed_from` and then held for `quiet` seconds (three
        heartbeats): the count after the work that moved it, not a heartbeat's stale reading."""
        seen = {"value": changed_from, "since": time.monotonic()}

        def settled() -> bool:
            value, now = self.engine(name), time.monotonic()
            if value != seen["value"]:
                seen.update(value=value, since=now)
            return value != changed_from and now - seen["since"] >= quiet

        self.wait(settled, timeout, f"engine counter {name} settled")
        return seen["value"]

    def state(self) -> dict[str, float]:
        """Every per-request count the pipeline holds: gateway streams and aborted ids awaiting the
        engine, engine requests/pages, detokenizer states (as last reported)."""
        m = self.metrics()
        return {
            "gateway_inflight": m["pipeserve_gateway_inflight"],
            "gateway_aborting": m["pipeserve_gateway_aborting"],
            **{name: m.get(f'pipeserve_engine{{name="{name}"}}', math.nan) for name in ENGINE_STATE},
        }

    def wait_engines(self, count: int, timeout: float = 120.0) -> None:
        """Until every one of `count` data-parallel engines is live (health is SERVING as soon as one
        is; the others join as they finish loading)."""

        def live() -> bool:
            m = self.metrics()
            return all(m.get(f'pipeserve_engine_serving{{engine="{i}"}}') == 1 for i in range(count))

        self.wait(live, timeout, f"{count} engines serving")

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no stream is open and the engine runs nothing, waits for nothing and holds no page."""

        def idle() -> bool:
            m = self.metrics()
            return (
                m["pipeserve_gateway_inflight"] == 0
                and m['pipeserve_engine{name="running"}'] == 0
                and m['pipeserve_engine{name="waiting"}'] == 0
                and m['pipeserve_engine{name="pages_used"}'] == 0
            )

        self.wait(idle, timeout, "idle engine with every page free")

    def wait_clean(self, timeout: float = 30.0) -> dict[str, float]:
        """Until no request state is left anywhere (stricter than wait_idle: aborts awaiting the
        engine and detokenizer states count too); the last state seen, all zeros."""
        last: dict[str, float] = {}

        def clean() -> bool:
            last.update(self.state())
            return not any(last.values())

        try:
            self.wait(clean, timeout, "no request state left")
        except TimeoutError as exc:
            raise TimeoutError(f"request state left: {last}") from exc
        return last

    def stop(self) -> int:
        """SIGTERM (the launcher's ordered shutdown), SIGKILL after 60 s; the launcher's exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()
        self.log.close()
        return self.proc.returncode
