"""The engine under --scheduling-policy priority on stories260K: a late request of an earlier
priority overtakes a full batch (seats and KV pages), and every request's greedy output is what it
is alone, preempted or not."""

from __future__ import annotations

from pipeserve.engine.engine import Engine
from pipeserve.sampling_params import PREEMPTIONS_BY_PRIORITY, SamplingParams

PROMPTS = {f"low{i}": [1, 300 + 7 * i, 301, 302 + i, 303] for i in range(5)}
URGENT = [1, 410, 411, 412, 413]


def greedy(n: int, priority: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, priority=priority)


def test_a_late_urgent_request_finishes_first_with_unchanged_outputs(stories_dir) -> None:
    # 2 seats, 8 pages of 4 tokens: two 5 + 24 token requests fill the pool by the time they end.
    engine = Engine(model=stories_dir, device="cpu", page_size=4, num_pages=8, max_num_seqs=2,
                    scheduling_policy="priority")
    for rid, prompt in PROMPTS.items():
        engine.add(rid, prompt, greedy(24))
    finished: list[str] = []
    outputs: dict[str, list[int]] = {rid: [] for rid in [*PROMPTS, "urgent"]}
    for step in range(10_000):
        if step == 6:  # the batch is full, two of the low requests are mid-decode
            assert len(engine.scheduler.running) == 2
            engine.add("urgent", URGENT, greedy(12, priority=-1))
        if step > 6 and not engine.has_work():
            break
        for u in engine.step():
            outputs[u.rid] += u.token_ids
            if u.finish_reason:
                finished.append(u.rid)
    assert finished[0] == "urgent", finished
    stats = engine.stats()
    assert stats["preemptions"] >= 1 and stats[f"{PREEMPTIONS_BY_PRIORITY}0"] == stats["preemptions"]
    # Each request alone, one at a time, on a roomy fcfs engine.
    alone = Engine(model=stories_dir, device="cpu", page_size=4, num_pages=64)
    for rid, prompt in [*PROMPTS.items(), ("urgent", URGENT)]:
        alone.add(rid, prompt, greedy(12 if rid == "urgent" else 24))
        got: list[int] = []
        while alone.has_work():
            got += [t for u in alone.step() for t in u.token_ids]
        assert outputs[rid] == got, rid
