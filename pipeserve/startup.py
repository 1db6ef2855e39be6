"""How start-up reaches the user: a failure as one line naming the flag to fix (exit status 2), and
the phases of a slow start (load, KV sizing, compile, warm-up) as log lines with their durations.

Every process reports a start-up failure the same way (`fail`): the launcher and its preflight, and
the engine, which finds some problems only once torch has the device (an out-of-memory KV pool, a
device torch does not know). `explain` turns the exceptions torch and the engine raise for a bad
flag into that line; with --debug the traceback follows it. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

log = logging.getLogger("pipeserve.startup")

EXIT_STARTUP = 2  # the status of every start-up failure (argparse's for a bad flag too)
SLOW_PHASE = 3.0  # seconds: a phase expected to take longer shows a progress bar in a terminal

T = TypeVar("T")


class StartupError(Exception):
    """A problem found while starting: the message is the one line the user sees (it names the flag
    and what to do)."""


def explain(exc: BaseException, device: str = "auto") -> str:
    """The one line for an exception an engine raised while starting: the flag behind it and the
    fix where the exception says which, else the exception itself and how to see more."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, StartupError):
        return text
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text.lower():
        return (f"out of memory while starting ({text}): lower --kv-cache-gb or --gpu-memory-utilization, "
                "--max-num-seqs, or choose a smaller --quantization")
    if "KV pool needs at least one page" in text:
        return ("--kv-cache-gb is too small for one KV page of this model: raise it (or --num-pages), or "
                "lower --page-size")
    if "not compiled with CUDA" in text or "no CUDA GPUs" in text or "CUDA driver" in text:
        return f"--device {device}: this host has no usable CUDA (torch: {text}): use --device cpu"
    if "device type" in text or "Invalid device string" in text:
        return f"--device {device}: not a torch device pipeserve runs on: use cpu, cuda or cuda:N"
    return (f"the engine failed to start: {type(exc).__name__}: {text} "
            "(run with --debug for the traceback)")


def fail(prog: str, exc: BaseException, debug: bool = False, device: str = "auto") -> int:
    """Print the one line for a start-up failure (the traceback too with --debug); the exit status."""
    if debug:
        traceback.print_exception(exc)
    print(f"{prog}: error: {explain(exc, device)}", file=sys.stderr, flush=True)
    return EXIT_STARTUP


@contextlib.contextmanager
def phase(what: str, logger: logging.Logger | None = None, slow: bool = False) -> Iterator[None]:
    """Log what a start-up phase is doing, then how long it took ("loading the model ... done in
    1.2 s"), so that a slow start is never silent. A phase that may be slow (slow: a build, a load,
    a compile) also shows a ticking clock on stderr while it runs, when that is a terminal."""
    out = logger or log
    out.info("%s ...", what)
    start = time.perf_counter()
    with _clock(what) if slow and sys.stderr.isatty() else contextlib.nullcontext():
        yield
    out.info("%s: done in %.1f s", what, time.perf_counter() - start)


@contextlib.contextmanager
def _clock(what: str) -> Iterator[None]:
    """A tqdm bar of unknown length, refreshed by a thread, that shows how long `what` has run."""
    from tqdm import tqdm

    bar: Any = tqdm(desc=what, total=None, bar_format="{desc}: {elapsed}", leave=False, file=sys.stderr)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="startup-clock", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def progress(items: Iterable[T], what: str, total: int | None = None, slow: bool = True) -> Iterator[T]:
    """items, with a progress bar on stderr when it is a terminal and the phase is slow (the log
    says what each phase does either way)."""
    if not (slow and sys.stderr.isatty()):
        yield from items
        return
    from tqdm import tqdm

    bar: Any = tqdm(items, desc=what, total=total, unit="step", leave=False, file=sys.stderr)
    yield from bar
