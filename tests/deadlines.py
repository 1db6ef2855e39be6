"""Deadlines that expire mid-generation on any machine: a fixed deadline that is short on a loaded
2-core box lets the whole generation finish on a fast CI host, so derive it from a timed run."""

from __future__ import annotations

import time

from pipeserve.gateway.client import Client


def mid_generation_deadline(client: Client, prompt: str, max_tokens: int) -> float:
    """A deadline (s) of a quarter of what the same greedy request takes when it runs to the end."""
    start = time.monotonic()
    completion = client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    took = time.monotonic() - start
    assert len(completion.token_ids) == max_tokens, "the timed run must generate every token"
    return took / 4
