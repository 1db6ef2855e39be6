"""Host staging used in turns, so that writing a step's inputs never races the upload of an earlier
step's.

A non-blocking host-to-device copy only enqueues the copy: the host returns at once and the device
reads the pinned host memory when the stream reaches it. Writing the same host buffer again for the
next step is safe only once that copy has run. Most steps end in a blocking readback that drains the
stream, but not all (a step of partial prefill chunks samples nothing; a tensor-parallel rank 0 may
send the next step's plan while the device is still running the last one), so the host cannot rely
on it. Each set of host buffers is therefore used in turn: before a set is written again, the event
recorded when its last step ended must have completed. With two sets that event normally has (a step
later, the copies of the step before have long run), so checking it is a query, not a wait; only a
host that gets two steps ahead of the device waits, which is exactly the case that would have raced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class Event(Protocol):
    """What is used of torch.cuda.Event (a fake in tests)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Turns(Generic[T]):
    """Sets of host buffers (each a T) written in turn: `next()` at the start of each step."""

    def __init__(self, sets: list[T], event: Callable[[], Event]) -> None:
        """event: makes an event on the copies' device (torch.cuda.Event); one per set."""
        assert len(sets) >= 2, "one set would be rewritten while its copy may be in flight"
        self.sets = sets
        self.events = [event() for _ in sets]
        self.index = 0
        self.waits = 0  # times the host had to wait for a set's copies (it was two steps ahead)

    @property
    def current(self) -> T:
        return self.sets[self.index]

    def next(self) -> T:
        """The set to write this step's inputs into. Marks the end of the current set's copies (an
        event after everything enqueued so far), then takes the next set once the copies that last
        read it have run: a query of its event, a wait only if the device is that far behind."""
        self.events[self.index].record()
        self.index = (self.index + 1) % len(self.sets)
        event = self.events[self.index]
        if not event.query():
            self.waits += 1
            event.synchronize()
        return self.sets[self.index]
