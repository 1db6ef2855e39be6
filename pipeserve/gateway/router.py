"""Data parallelism: the gateway's view of each engine and the choice of the engine a request runs on.

The gateway routes, not the tokenizer: it alone hears every engine (heartbeats with their counters
on `status`, process deaths from the supervisor) and it owns every stream, so the aborts and the
failures of a request go to the engine it chose without another hop. The choice is made before
tokenization, so prefix affinity works on what the gateway has: the request's leading text (or its
ids, a page at a time) and its cache_salt, hashed block by block into a chain as the engine's prefix
cache hashes pages. Two prompts that share their first k blocks share their first k chain hashes,
and the engine that last took the longest matching chain most likely still holds those pages
(text blocks are an approximation of token pages: the same text tokenizes the same way).

Load is what vLLM's data-parallel front end uses, waiting x 4 + running from each engine's own
report, plus x 4 for each request routed to it since that report (still queued in a tokenizer or
the engine's socket), so that a burst between two heartbeats spreads instead of piling onto the
engine that looked idle. A request follows its prefix unless the owner's load exceeds the least
loaded live engine's by more than the balance threshold; otherwise, and when nothing matches, it
goes to the least loaded live engine (the lowest index on a tie).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

BLOCK_CHARS = 64  # text per affinity block (a 16-token page is roughly this much English)
MAX_BLOCKS = 32  # leading blocks hashed per request: enough to tell shared system prompts apart
MAX_OWNERS = 1 << 16  # chain hashes remembered (LRU), across all engines
WAITING_WEIGHT = 4


@dataclass
class EngineView:
    """What the gateway knows of one engine."""

    boot: int = 0  # its incarnation (EngineInfo.boot); 0 before its first heartbeat
    seen: float = float("-inf")  # monotonic time of its last heartbeat
    fresh_after: float = float("-inf")  # heartbeats at or before this do not count (a restart)
    down: bool = False  # the supervisor said it died and has not said it is back
    stats: dict[str, int] = field(default_factory=dict)  # its counters, as last reported
    tensor_parallel_size: int = 1
    routed_since_report: int = 0
    routed: int = 0  # requests routed to it, ever (the per-engine share)
    live: bool = False  # as of the gateway's last health check

    def is_live(self, now: float, timeout: float) -> bool:
        return not self.down and self.fresh_after < self.seen and now - self.seen < timeout

    def load(self) -> int:
        waiting = self.stats.get("waiting", 0) + self.routed_since_report
        return WAITING_WEIGHT * waiting + self.stats.get("running", 0)


def prefix_blocks(
    salt: str, text: str | None = None, ids: np.ndarray | None = None, page: int = 16
) -> list[bytes]:
    """The chain hashes of a prompt's leading whole blocks: BLOCK_CHARS of text, or `page` ids; each
    hash covers the salt and every block before it, so equal chains mean equal prefixes."""
    if text is not None:
        data = text.encode()
        step = BLOCK_CHARS
    else:
        assert ids is not None
        data = np.ascontiguousarray(ids, dtype="<i4").tobytes()
        step = 4 * page
    out, parent = [], hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for start in range(0, min(len(data) // step, MAX_BLOCKS) * step, step):
        parent = hashlib.blake2b(parent + data[start : start + step], digest_size=16).digest()
        out.append(parent)
    return out


class Router:
    """Picks the engine for each request among the live ones (see the module docstring)."""

    def __init__(self, engines: int, balance_threshold: int) -> None:
        self.engines = [EngineView() for _ in range(engines)]
        self.balance_threshold = balance_threshold
        self.owners: OrderedDict[bytes, int] = OrderedDict()  # chain hash -> engine that last took it

    def report(self, engine: int, stats: dict[str, int]) -> None:
        """An engine's counters, from its heartbeat (sent after it drained its inputs, so it settles
        the requests routed since the previous one)."""
        view = self.engines[engine]
        view.stats.update(stats)
        view.routed_since_report = 0

    def pick(self, blocks: list[bytes], copies: int = 1) -> int:
        """The engine for a request with these prefix blocks; at least one engine must be live.
        copies: the engine requests it becomes (the OpenAI `n`), each queued there until the next
        report."""
        live = [i for i, view in enumerate(self.engines) if view.live]
        assert live, "routing with no live engine"
        least = min(live, key=lambda i: self.engines[i].load())
        chosen = least
        holder = None
        for block in blocks:
            owner = self.owners.get(block)
            if owner is None:
                break
            holder = owner
        if holder is not None and self.engines[holder].live:
            if self.engines[holder].load() - self.engines[least].load() <= self.balance_threshold:
                chosen = holder
        for block in blocks:
            self.owners[block] = chosen
            self.owners.move_to_end(block)
        while len(self.owners) > MAX_OWNERS:
            self.owners.popitem(last=False)
        view = self.engines[chosen]
        view.routed_since_report += copies
        view.routed += 1
        return chosen

    def forget(self, engine: int) -> None:
        """An engine restarted with an empty cache: its prefixes are held nowhere any more."""
        for block in [block for block, owner in self.owners.items() if owner == engine]:
            del self.owners[block]
        self.engines[engine].stats.clear()
        self.engines[engine].routed_since_report = 0
