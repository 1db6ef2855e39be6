"""A request's structured-output constraint made to apply only after the reasoning section: one
grammar (pipeserve/grammar.py after_reasoning), built off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeserve.gateway.http_common import HTTPError
from pipeserve.sampling_params import CONSTRAINTS, SamplingParams


async def constrain_after_reasoning(reasoning: str, given: dict[str, Any]) -> dict[str, Any]:
    """given (SamplingParams fields) with its constraint, if any, replaced by the grammar of
    "reasoning section, then the constraint"; a 400 naming the constraint when it does not build.
    xgrammar (and with it torch) is imported on the first such request."""
    names = [name for name in CONSTRAINTS if given.get(name) not in (None, False)]
    if not names:
        return given
    try:
        kind, text = SamplingParams(**{names[0]: given[names[0]]}).constraint() or ("", "")
        from pipeserve.grammar import after_reasoning  # xgrammar imports torch: not until needed

        grammar = await asyncio.to_thread(after_reasoning, reasoning, kind, text)
    except (ValueError, TypeError) as exc:
        raise HTTPError(400, str(exc), names[0]) from None
    return {k: v for k, v in given.items() if k not in CONSTRAINTS} | {"grammar": grammar}
