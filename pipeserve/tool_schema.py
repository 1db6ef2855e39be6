"""Tool choices as structured-output constraints (JSON schemas for pipeserve/grammar.py to build),
as vLLM enforces them: `required` makes the output a JSON list of one or more calls
`{"name": ..., "parameters": {...}}` to the offered functions, each with arguments valid against
its schema (one call when parallel calls are off); a named function makes the output that
function's arguments."""

from __future__ import annotations

from typing import Any

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function tool's parameters schema (none given: an object without properties, as OpenAI)."""
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else EMPTY_PARAMETERS


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `tool_choice: "required"` over these function definitions."""
    calls = [
        {"type": "object",
         "properties": {"name": {"const": f["name"]}, "parameters": parameters_schema(f)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
