"""Online output-length predictor for the `predicted` admission policy.

It learns from what the server sees anyway: each finished request's features and its output length.
Features a deployment has: a hash of the prompt prefix (system prompt / template), the client's
`app` tag, the prompt length, the sampling mode and max_tokens. Each feature key holds a streaming
histogram of output lengths (exact bins up to 16 tokens, then 8 log-spaced bins per octave, about
9% wide), so the predictor answers any quantile, also conditioned on the tokens a request has
already generated (a preempted request, or one that outgrew its reservation). A prediction uses the
finest key with enough history and backs off to coarser ones (template+app, app+length, app,
length, everything); with no history at all it answers None and the policy reserves max_tokens.

Bounded: at most `max_keys` histograms (least recently used go first); a key's counts halve once
they pass `window`, so old traffic fades. Persisted as a small JSON file, written atomically.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from pipeserve.engine.sequence import Sequence

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PREFIX_TOKENS = 32  # prompt ids hashed as the "template" feature
EXACT_BINS = 16
BINS_PER_OCTAVE = 8
MAX_LEN = 1 << 20


def _bin_edges() -> list[int]:
    """edges[i] is the smallest output length in bin i; the last edge closes the last bin."""
    edges = list(range(1, EXACT_BINS + 1))
    ratio = 2 ** (1 / BINS_PER_OCTAVE)
    while edges[-1] < MAX_LEN:
        edges.append(max(edges[-1] + 1, math.ceil(edges[-1] * ratio)))
    return edges


EDGES = _bin_edges()
NUM_BINS = len(EDGES) - 1


def bin_of(length: int) -> int:
    return min(bisect_right(EDGES, length), NUM_BINS) - 1


def prefix_hash(ids: list[int]) -> int:
    """Stable across processes (unlike hash() of a str), so it survives a restart."""
    return zlib.crc32(array("i", ids[:PREFIX_TOKENS]).tobytes())


def length_bucket(n: int) -> int:
    """Half-octave bucket: 2 x bit_length plus the bit below the leading one."""
    b = n.bit_length()
    return 2 * b + ((n >> (b - 2)) & 1 if b >= 2 else 0)


@dataclass(frozen=True, slots=True)
class Features:
    prefix: int  # prefix_hash of the prompt
    app: str
    prompt_len: int
    max_tokens: int
    sampling: str  # "greedy", or "t" + temperature in quarters

    @staticmethod
    def of(seq: Sequence) -> Features:
        p = seq.params
        sampling = "greedy" if p.temperature == 0 else f"t{min(round(p.temperature * 4), 12)}"
        return Features(prefix_hash(seq.token_ids[: min(seq.prompt_len, PREFIX_TOKENS)]), seq.app,
                        seq.prompt_len, p.max_tokens, sampling)


# Backoff levels, finest first: each maps Features to a key (a tuple of JSON scalars).
LEVELS: dict[str, Callable[[Features], tuple[object, ...]]] = {
    "full": lambda f: ("full", f.prefix, f.app, length_bucket(f.prompt_len), f.max_tokens.bit_length(),
                       f.sampling),
    "template": lambda f: ("template", f.prefix, f.app),
    "app_len": lambda f: ("app_len", f.app, length_bucket(f.prompt_len)),
    "app": lambda f: ("app", f.app),
    "len": lambda f: ("len", length_bucket(f.prompt_len)),
    "all": lambda f: ("all",),
}
DEFAULT_LEVELS = tuple(LEVELS)
PROMPT_LENGTH_ONLY = ("len", "all")  # the baseline the bench compares against


class Histogram:
    """Decayed counts of output lengths in EDGES bins; the cumulative form is cached until the next add."""

    __slots__ = ("counts", "total", "_bins", "_cum")

    def __init__(self, counts: dict[int, float] | None = None) -> None:
        self.counts: dict[int, float] = counts or {}
        self.total = sum(self.counts.values())
        self._bins: list[int] | None = None
        self._cum: list[float] = []

    def add(self, length: int, window: float) -> None:
        b = bin_of(length)
        self.counts[b] = self.counts.get(b, 0.0) + 1.0
        self.total += 1.0
        if self.total > window:
            self.counts = {k: v / 2 for k, v in self.counts.items() if v > 0.02}
            self.total = sum(self.counts.values())
        self._bins = None

    def _prepare(self) -> list[int]:
        if self._bins is None:
            self._bins = sorted(self.counts)
            self._cum = [0.0, *accumulate(self.counts[b] for b in self._bins)]
        return self._bins

    def mass_at_most(self, n: int) -> float:
        """Counts of lengths <= n, spreading each bin's counts evenly over its lengths."""
        if n < 1:
            return 0.0
        bins = self._prepare()
        b = bin_of(n)
        i = bisect_left(bins, b)
        mass = self._cum[i]
        if i < len(bins) and bins[i] == b:
            lo, hi = EDGES[b], EDGES[b + 1]
            mass += self.counts[b] * (min(n + 1, hi) - lo) / (hi - lo)
        return mass

    def quantile(self, q: float, above: int = 0) -> int:
        """The q-quantile of lengths, conditioned on length > above (caller checked there is mass)."""
        bins = self._prepare()
        base = self.mass_at_most(above)
        target = base + q * (self.total - base)
        i = min(max(bisect_left(self._cum, target) - 1, 0), len(bins) - 1)
        b = bins[i]
        lo, hi = EDGES[b], EDGES[b + 1]
        frac = (target - self._cum[i]) / self.counts[b]
        return max(min(lo + math.ceil(frac * (hi - lo)) - 1, hi - 1), lo, above + 1)


class OutputLengthPredictor:
    def __init__(self, levels: Iterable[str] = DEFAULT_LEVELS, min_count: int = 16, max_keys: int = 4096,
                 window: float = 2000.0) -> None:
        self.levels = tuple(levels)
        unknown = set(self.levels) - set(LEVELS)
        if unknown or not self.levels:
            raise ValueError(f"levels must be a non-empty subset of {list(LEVELS)}, got {self.levels}")
        self._keyfns = [LEVELS[name] for name in self.levels]
        self.min_count, self.max_keys, self.window = min_count, max_keys, window
        self._hists: OrderedDict[tuple[object, ...], Histogram] = OrderedDict()
        self.num_updates = 0

    def __len__(self) -> int:
        return len(self._hists)

    def predict(self, f: Features, q: float, above: int = 0) -> int | None:
        """The q-quantile of the output length given that it exceeds `above` tokens, from the finest
        key with at least min_count such observations; None without enough history anywhere."""
        for keyfn in self._keyfns:
            key = keyfn(f)
            h = self._hists.get(key)
            if h is not None and h.total - h.mass_at_most(above) >= self.min_count:
                self._hists.move_to_end(key)
                return h.quantile(q, above)
        return None

    def update(self, f: Features, output_len: int) -> None:
        if output_len < 1:
            return
        for keyfn in self._keyfns:
            key = keyfn(f)
            h = self._hists.get(key)
            if h is None:
                h = self._hists[key] = Histogram()
                if len(self._hists) > self.max_keys:
                    self._hists.popitem(last=False)
            else:
                self._hists.move_to_end(key)
            h.add(output_len, self.window)
        self.num_updates += 1

    # -- persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "exact_bins": EXACT_BINS, "bins_per_octave": BINS_PER_OCTAVE,
                "levels": list(self.levels), "min_count": self.min_count, "max_keys": self.max_keys,
                "window": self.window, "num_updates": self.num_updates,
                "keys": [[list(k), {str(b): round(c, 4) for b, c in h.counts.items()}]
                         for k, h in self._hists.items()]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OutputLengthPredictor:
        scheme = (data.get("version"), data.get("exact_bins"), data.get("bins_per_octave"))
        if scheme != (FORMAT_VERSION, EXACT_BINS, BINS_PER_OCTAVE):
            raise ValueError(f"predictor file has format {scheme}, expected "
                             f"{(FORMAT_VERSION, EXACT_BINS, BINS_PER_OCTAVE)}")
        pred = cls(data["levels"], data["min_count"], data["max_keys"], data["window"])
        pred.num_updates = int(data.get("num_updates", 0))
        for key, counts in data["keys"][-pred.max_keys :]:
            pred._hists[tuple(key)] = Histogram({int(b): float(c) for b, c in counts.items()
                                                 if 0 <= int(b) < NUM_BINS and float(c) > 0})
        return pred

    def save(self, path: str | os.PathLike[str]) -> None:
        """Atomic: a reader (or a crash mid-write) never sees half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None, **defaults: Any) -> OutputLengthPredictor:
        """The predictor saved at `path`; a fresh one (built with `defaults`) when there is no
        file or it cannot be read: a bad file costs history, never the server."""
        if path is None or not Path(path).is_file():
            return cls(**defaults)
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable predictor file %s: %s", path, e)
            return cls(**defaults)
