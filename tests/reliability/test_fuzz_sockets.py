"""Random and mutated msgpack messages at every bound ZeroMQ input of a live pipeline (engine
requests and control, detokenizer steps, gateway deltas, errors and status): nothing crashes, nothing is
left behind, and the pipeline still serves."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeserve.messages import MESSAGE_TYPES, VERSION

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(120)]
SOCKETS = ("requests", "control", "steps", "deltas", "errors", "status")
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=8), st.binary(max_size=16))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
mutated = st.builds(  # a known tag with random fields: the strict field checks must drop it
    lambda tag, body: msgpack.packb({"v": VERSION, "t": tag, **body}, use_bin_type=True),
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(st.sampled_from(["rid", "rids", "tokens", "finish", "step", "new", "sampling",
                                     "prompt_ids", "text", "offsets", "boot", "info", "process", "up",
                                     "messages", "logprobs", "stats"]),
                    values, max_size=6))
packed = values.map(lambda v: msgpack.packb(v, use_bin_type=True))
frames = st.one_of(st.binary(max_size=256), packed, mutated)


def addresses(pipeline) -> dict[str, str]:
    (engine,) = pipeline.pids("engine")
    environ = Path(f"/proc/{engine}/environ").read_text().split("\0")
    env = dict(line.split("=", 1) for line in environ if "=" in line)
    return {name: env[f"PIPESERVE_{name.upper()}_ADDR"] for name in SOCKETS}


def test_fuzzed_messages_at_every_process_input(pipeline):
    before = pipeline.children()
    ctx = zmq.Context()
    socks = {}
    for name, addr in addresses(pipeline).items():
        socks[name] = ctx.socket(zmq.PUSH)
        socks[name].setsockopt(zmq.LINGER, 0)
        socks[name].connect(addr)
    sent = [0]

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from(SOCKETS), frame=frames)
    def fuzz(name: str, frame: bytes) -> None:
        if b"process" in frame or b"engine_info" in frame:  # a forged supervisor or engine is trusted
            return
        socks[name].send(frame)
        sent[0] += 1

    try:
        fuzz()
        time.sleep(1.0)
    finally:
        ctx.destroy(linger=0)
    assert sent[0] > 100
    assert pipeline.children() == before  # nobody crashed (no restarts)
    assert pipeline.client.health() == "SERVING"
    assert pipeline.client.generate("Once upon a time", max_tokens=3, temperature=0).completion_tokens == 3
    pipeline.wait_clean()
