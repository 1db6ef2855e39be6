"""The reasoning formats `--reasoning-parser` names: the tags around a model's reasoning section,
shared by the gateway's parsers (pipeserve/gateway/reasoning/) and the grammar that lets a
structured-output constraint start only after the section ends (pipeserve/grammar.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    # True: everything before `end` is reasoning even without `start` (the chat template may have
    # opened the section in the prompt); False: reasoning only between the tags.
    implicit_start: bool


FORMATS = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>", implicit_start=True),
    "qwen3": ReasoningFormat("<think>", "</think>", implicit_start=False),
}


def section_ebnf(name: str) -> str:
    """EBNF (root rule `root`) of a reasoning section of format name: `start` (optional when the
    format's start is implicit; the whole section optional when it is not), then any text that
    does not contain `end`, then `end`. The text rules are the matching automaton of `end` (state
    k: its first k characters just read), so no text is refused that lacks `end`."""
    fmt = FORMATS[name]
    end = fmt.end
    rules = [f"s0 ::= {_char_not(end[0])} s0 | {_lit(end[0])} s1"]
    for k in range(1, len(end)):
        after = "" if k == len(end) - 1 else f" s{k + 1}"
        rules.append(f"s{k} ::= {_lit(end[k])}{after} | {_lit(end[0])} s1 | {_char_not(end[k] + end[0])} s0")
    root = f"root ::= {_lit(fmt.start)}? s0" if fmt.implicit_start else f"root ::= ({_lit(fmt.start)} s0)?"
    return "\n".join([root, *rules])


def _lit(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _char_not(chars: str) -> str:
    escaped = "".join("\\" + c if c in "\\]^-" else c for c in dict.fromkeys(chars))
    return f"[^{escaped}]"
