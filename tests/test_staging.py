"""Host staging used in turns (pipeserve/engine/staging.py): a step never rewrites a host buffer whose
non-blocking upload may still be in flight. CUDA events are faked (on this host copies are
synchronous): each stays "in flight" until the test lets the device catch up, so the tests see when
the host would have waited. The tensor-parallel step plan's header goes through it on CUDA; here its
sender is given CPU buffers used in turns and its plans are decoded by the receiver."""

from __future__ import annotations

import torch

from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.parallel.step_plan import HEADER, StepReceiver, StepSender
from pipeserve.engine.staging import Turns


class FakeEvent:
    """An event that completes only when the test says the device has caught up."""

    def __init__(self, device: list[FakeEvent]) -> None:
        self.device = device  # every event made, so that the test can complete them
        self.done = True  # never recorded: nothing to wait for (as torch.cuda.Event)
        self.syncs = 0
        device.append(self)

    def record(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True


def catch_up(events: list[FakeEvent]) -> None:
    for event in events:
        event.done = True


def test_sets_alternate_and_the_host_waits_only_two_steps_ahead() -> None:
    events: list[FakeEvent] = []
    turns = Turns(["a", "b"], lambda: FakeEvent(events))
    assert turns.current == "a"
    # Steps the device keeps up with (each ends in a readback): the other set is free, no wait.
    for expected in ("b", "a", "b", "a"):
        assert turns.next() == expected
        catch_up(events)
    assert turns.waits == 0 and all(e.syncs == 0 for e in events)
    # Steps with no readback, the device behind: the second one would rewrite the buffers of a step
    # whose copies have not run, so it waits for them (that set's event), and only for them.
    assert turns.next() == "b" and turns.waits == 0
    assert turns.next() == "a" and turns.waits == 1
    assert events[0].syncs == 1 and events[1].syncs == 0


def test_the_event_of_a_set_is_recorded_when_its_step_ends() -> None:
    events: list[FakeEvent] = []
    turns = Turns([0, 1, 2], lambda: FakeEvent(events))
    turns.next()  # step 0's copies (set 0) are all enqueued: its event follows them
    assert [e.done for e in events] == [False, True, True]
    turns.next()
    turns.next()  # set 0 again, two steps later: waits only if the device has not reached that event
    assert turns.index == 0 and turns.waits == 1


class RecordingGroup:
    """Rank 0's side of a group: keeps a copy of every broadcast."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.sent.append(tensor.clone())


class ReplayGroup:
    """A worker's side: each broadcast receives the next recorded one."""

    device = torch.device("cpu")

    def __init__(self, sent: list[torch.Tensor]) -> None:
        self.sent = list(sent)

    def broadcast(self, tensor: torch.Tensor) -> None:
        tensor.copy_(self.sent.pop(0))


def decode_step(n: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    i32 = torch.int32
    ids, positions = torch.arange(100, 100 + n), torch.arange(n) + 7
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n) + 50, num_decode=n,
        decode_block_tables=torch.arange(n * 2, dtype=i32).view(n, 2),
        decode_seq_lens=(positions + 1).to(i32),
        prefill_block_tables=torch.zeros(0, 2, dtype=i32), prefill_cu_q_lens=torch.zeros(1, dtype=i32),
        prefill_seq_lens=torch.zeros(0, dtype=i32), prefill_max_q_len=0, prefill_max_seq_len=0,
        decode_max_seq_len=7 + n)
    return ids, positions, meta


def test_step_plan_headers_are_written_in_turns_and_decoded_by_the_workers() -> None:
    group, events = RecordingGroup(), []
    sender = StepSender(group)  # type: ignore[arg-type]
    assert sender.headers is None  # on the CPU the header is written in place
    buffers = [torch.zeros(HEADER, dtype=torch.int64) for _ in range(2)]
    sender.headers = Turns(buffers, lambda: FakeEvent(events))  # as on CUDA, less the pinning
    steps = [decode_step(n) for n in (1, 3, 2)]
    for i, step in enumerate(steps):
        sender.send(*step)
        # Each step's header went to the other buffer than the last step's, whose upload may be in flight.
        assert torch.equal(buffers[(i + 1) % 2][:2], torch.tensor([1, step[0].shape[0]]))
        # The device never catches up here: each later step waits for what preceded the step before.
        assert sender.headers.waits == i
    receiver = StepReceiver(ReplayGroup(group.sent), None)  # type: ignore[arg-type]
    for ids, positions, meta in steps:
        got = receiver.receive()
        assert got is not None
        assert torch.equal(got.input_ids, ids) and torch.equal(got.positions, positions)
        assert torch.equal(got.meta.decode_block_tables, meta.decode_block_tables)
        assert got.meta.decode_max_seq_len == meta.decode_max_seq_len and got.num_sampled == ids.shape[0]
