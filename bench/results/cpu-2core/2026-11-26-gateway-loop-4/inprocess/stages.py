"""In-process CPU (thread time) per engine step of each stage under the gateway-loop load: HEAVY rows
(default 48) with top-20 logprobs (LOGPROBS=0: none) beside one plain row, stories260K, one torch
thread (the engine's on this 2-core VM). Prints the medians over 60 steps of the engine's step, its
output message, the detokenizer's work on it (decode / handle / TextDeltas), then the sampler alone
and the decoding of one step's StepOutput and TextDeltas.

    PIPESERVE_SHARED=<shared assets> PYTHONPATH=<checkout> python stages.py
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pipeserve.detokenizer.worker import Detokenizer, Row
from pipeserve.engine.llm import LLM
from pipeserve.engine.process import step_output
from pipeserve.engine.sampler import Sampler
from pipeserve.messages import DetokenizeRequest, decode, encode, pack_ids
from pipeserve.sampling_params import SamplingParams

torch.set_num_threads(1)
HEAVY = int(os.environ.get("HEAVY", "48"))
TOP = None if os.environ.get("LOGPROBS") == "0" else 20
PROMPT = [1, 403, 407, 261, 378]


def median_us(fn: Callable[[], Any], repeat: int = 200, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(repeat):
            fn()
        times.append((time.thread_time() - start) / repeat * 1e6)
    return statistics.median(times)


def main() -> None:
    llm = LLM(f"{os.environ['PIPESERVE_SHARED']}/models/stories260K", device="cpu")
    engine, detok = llm.engine, Detokenizer(llm.tokenizer)
    for i in range(HEAVY):
        engine.add(f"h{i}", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True, logprobs=TOP, seed=i))
        detok.handle(DetokenizeRequest([f"h{i}"], len(PROMPT), pack_ids(PROMPT), logprobs=TOP is not None,
                                       logprobs_format="completion"), {})
    engine.add("p", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True, seed=99))
    detok.handle(DetokenizeRequest(["p"], len(PROMPT), pack_ids(PROMPT)), {})
    for _ in range(5):
        engine.step()
    stages: dict[str, list[float]] = {name: [] for name in
                                      ("engine step", "step output", "detok decode", "detok handle",
                                       "detok deltas")}
    frame = deltas = b""
    for step in range(60):
        marks = [time.thread_time()]
        updates = engine.step()
        marks.append(time.thread_time())
        frame = encode(step_output(step + 10, updates))
        marks.append(time.thread_time())
        msg = decode(frame)
        marks.append(time.thread_time())
        rows: dict[str, Row] = {}
        detok.handle(msg, rows)
        marks.append(time.thread_time())
        deltas = encode(detok.deltas(rows))
        marks.append(time.thread_time())
        for times, a, b in zip(stages.values(), marks, marks[1:], strict=False):
            times.append(b - a)
    for name, times in stages.items():
        print(f"{name}: {statistics.median(times) * 1e3:.3f} ms")
    # A sampler of its own with the same rows (the engine's would advance its requests).
    sampler = Sampler(64, engine.model_config.vocab_size, torch.device("cpu"))
    for i in range(HEAVY + 1):
        sampler.set_request(i, SamplingParams(logprobs=TOP if i < HEAVY else None, seed=i), [1], [], [2])
    slots = np.arange(HEAVY + 1)
    slots_t, logits = torch.from_numpy(slots), torch.randn(HEAVY + 1, engine.model_config.vocab_size)
    print(f"sampler alone: {median_us(lambda: sampler.sample(logits, slots, slots_t)):.0f} us")
    print(f"decode StepOutput ({len(frame)} B): {median_us(lambda: decode(frame)):.0f} us")
    print(f"decode TextDeltas ({len(deltas)} B): {median_us(lambda: decode(deltas)):.0f} us")


if __name__ == "__main__":
    main()
