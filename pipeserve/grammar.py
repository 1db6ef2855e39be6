"""Structured-output constraints as xgrammar grammars: the one place a SamplingParams constraint
(`SamplingParams.constraint()`) becomes a `Grammar`.

The edges call `check_constraint` to refuse what cannot be built (a schema xgrammar rejects, a regex
or EBNF grammar that does not parse) before any engine work; the engine compiles the same Grammar
against the model's vocabulary (pipeserve/engine/structured.py). Building a Grammar needs no
tokenizer and takes milliseconds; xgrammar imports torch, so the tokenizer workers import this module
only when a request carries a constraint.

JSON is compact: no free whitespace, separators "," and ":" (vLLM's `disable_any_whitespace`), so a
model that has never seen JSON cannot wander off into spaces and newlines between tokens.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from pipeserve.reasoning import section_ebnf
from pipeserve.sampling_params import SamplingParams

COMPACT = (",", ":")
# Any JSON object, spelled out so that nested values are compact too (xgrammar's built-in any-JSON
# rules, which a bare {"type": "object"} would use, put a space after every comma).
_ANY = {"$ref": "#/$defs/any"}
ANY_OBJECT = json.dumps(
    {
        "type": "object",
        "additionalProperties": _ANY,
        "$defs": {
            "any": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "number"},
                    {"type": "boolean"},
                    {"type": "null"},
                    {"type": "array", "items": _ANY},
                    {"type": "object", "additionalProperties": _ANY},
                ]
            }
        },
    }
)
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def build_grammar(kind: str, text: str) -> xgr.Grammar:
    """The grammar of a canonical constraint (SamplingParams.constraint()); ValueError naming the
    constraint and what xgrammar found wrong."""
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=COMPACT)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(ANY_OBJECT, any_whitespace=False, separators=COMPACT)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            # JSON string escapes are EBNF string escapes too.
            options = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
            return xgr.Grammar.from_ebnf(f"root ::= {options}")
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"{kind} is invalid: {_first_line(exc)}") from None
    raise ValueError(f"unknown constraint kind {kind!r}")


def after_reasoning(reasoning: str, kind: str, text: str) -> xgr.Grammar:
    """The grammar of a constraint that applies from the first character after a reasoning section of
    the named format (pipeserve/reasoning.py; SamplingParams.reasoning_format). ValueError as
    build_grammar."""
    section = xgr.Grammar.from_ebnf(section_ebnf(reasoning))
    return xgr.Grammar.concat(section, build_grammar(kind, text))


def params_grammar(params: SamplingParams) -> xgr.Grammar | None:
    """The grammar the engine compiles for params (None: unconstrained)."""
    constraint = params.constraint()
    if constraint is None:
        return None
    if params.reasoning_format is not None:
        return after_reasoning(params.reasoning_format, *constraint)
    return build_grammar(*constraint)


def check_constraint(params: SamplingParams) -> None:
    """Raise ValueError when the params' constraint (if any) cannot be turned into a grammar."""
    params_grammar(params)


def _first_line(exc: BaseException) -> str:
    """xgrammar's reason: its first line, less the "[time] file.cc:line: " prefix of its C++ logger
    (a stack trace may follow)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
