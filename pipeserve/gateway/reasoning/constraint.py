"""A request's structured-output constraint made to apply only after the reasoning section: the
engine builds that grammar (SamplingParams.reasoning_format; pipeserve/grammar.py after_reasoning),
so the gateway never imports xgrammar."""

from __future__ import annotations

from typing import Any

from pipeserve.sampling_params import CONSTRAINTS


def constrain_after_reasoning(reasoning: str, given: dict[str, Any]) -> dict[str, Any]:
    """given (SamplingParams fields) with its constraint, if any, applying from the first token after
    a reasoning section of the format `reasoning`. A constraint that does not compile is refused by
    the engine (INVALID_ARGUMENT naming it), as any constraint is."""
    if not any(given.get(name) not in (None, False) for name in CONSTRAINTS):
        return given
    return given | {"reasoning_format": reasoning}
