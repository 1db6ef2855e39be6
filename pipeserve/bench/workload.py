"""When requests arrive and how long they are: gamma/Poisson arrivals and the Azure LLM traces."""

from __future__ import annotations

import argparse
import csv
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np


class BatchSizes(argparse.Action):
    """`--batch 1 8 32`, the one spelling of a list of batch sizes across the benchmarks; commas
    ("1,8,32") are taken too, as the older `--batch-sizes` and `--batches` spellings wrote them."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="+", metavar="N", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            sizes = [int(part) for value in values for part in str(value).split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentError(self, f"batch sizes are integers: {' '.join(values)}") from None
        if not sizes or min(sizes) < 1:
            raise argparse.ArgumentError(self, "batch sizes are integers >= 1")
        setattr(namespace, self.dest, sizes)


def shared_dir() -> Path:
    """Models and traces: $PIPESERVE_SHARED, else a `shared` folder beside the checkout."""
    env = os.environ.get("PIPESERVE_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared"


def default_trace_paths() -> list[Path]:
    return sorted((shared_dir() / "data" / "traces").glob("*.csv"))


def trace_paths(given: Sequence[str] | None, command: str) -> list[Path]:
    """--trace files, else the shared traces; SystemExit with one line saying what is missing."""
    paths = [Path(p) for p in given] if given else default_trace_paths()
    if not paths:
        raise SystemExit(f"{command}: no trace: pass --trace FILE.csv (columns TIMESTAMP, ContextTokens, "
                         f"GeneratedTokens), or set PIPESERVE_SHARED to a folder with data/traces/*.csv")
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"{command}: --trace {path}: no such file")
    return paths


def checkpoint(given: str | None, command: str, default: str = "stories260K") -> str:
    """--model as a local checkpoint dir (a hub id is downloaded or taken from the HF cache), else the
    shared `default` model; SystemExit with one line saying what is missing."""
    from pipeserve import hub

    if given:
        try:
            path = hub.resolve(given)
        except hub.ModelNotFound as exc:
            raise SystemExit(f"{command}: --model {exc}") from None
    else:
        path = str(shared_dir() / "models" / default)
        if not os.path.isdir(path):
            raise SystemExit(f"{command}: no --model given and the default {default} is not at {path}: pass "
                             "--model DIR (a Hugging Face checkpoint) or a hub id, or set PIPESERVE_SHARED")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"{command}: --model {path} has no config.json: not a Hugging Face checkpoint")
    return path


def gamma_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets in seconds of `n` arrivals at `rate` per second, the first at 0. Gaps are gamma with
    shape = burstiness and scale = 1 / (rate x burstiness): mean 1 / rate, squared coefficient of
    variation 1 / burstiness (1 is Poisson, below 1 burstier; vLLM's convention). An infinite rate
    sends everything at once."""
    if n < 0 or rate <= 0 or burstiness <= 0:
        raise ValueError(f"need n >= 0, rate > 0 and burstiness > 0, got {n}, {rate}, {burstiness}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # s after the first request of the loaded trace, after rate scaling
    prompt_tokens: int
    output_tokens: int
    app: str  # the trace file's stem: one application per file


def load_trace(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    max_context: int | None = None,
    rate_scale: float = 1.0,
    window_s: float | None = None,
    max_requests: int | None = None,
) -> list[TraceRequest]:
    """Read `TIMESTAMP, ContextTokens, GeneratedTokens` CSVs and merge them on their wall clock
    (files recorded over the same hour keep their real overlap), sorted by arrival.

    rate_scale: arrivals come rate_scale times faster (offsets divided by it).
    max_context: when the longest prompt + output of the loaded files exceeds it, every length is
        scaled by the same factor (floored, at least 1), so the mix keeps its shape and every request
        fits: prompt + output <= max_context.
    window_s, max_requests: keep requests arriving before window_s, then at most the first max_requests.
    """
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if max_context is not None and max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rows: list[tuple[float, int, int, str]] = []
    for path in paths:
        path = Path(path)
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                t = datetime.fromisoformat(row["TIMESTAMP"]).replace(tzinfo=UTC).timestamp()
                rows.append((t, int(row["ContextTokens"]), int(row["GeneratedTokens"]), path.stem))
    if not rows:
        return []
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    longest = max(p + o for _, p, o, _ in rows)
    factor = 1.0 if max_context is None or longest <= max_context else max_context / longest
    out = []
    for t, prompt, output, app in rows:
        arrival = (t - t0) / rate_scale
        if window_s is not None and arrival >= window_s:
            break
        if factor < 1.0:
            prompt, output = max(1, math.floor(prompt * factor)), max(1, math.floor(output * factor))
        out.append(TraceRequest(arrival, prompt, output, app))
        if max_requests is not None and len(out) >= max_requests:
            break
    return out
