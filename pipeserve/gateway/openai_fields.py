"""Which OpenAI (and vLLM-extension) request fields the HTTP API refuses rather than ignore.

A field that would change the result and that the server does not implement is a 400 naming it: a
client that sends it must not get an answer that silently lacks it. Harmless bookkeeping fields
(`user`, `metadata`, `store: false`, `service_tier`, ...) are accepted. Any other unknown field is
ignored, as vLLM does (clients add their own). docs/openai-api.md lists both sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Rule = Callable[[Any], bool]  # True: this value asks for something the server does not do


def _given(value: Any) -> bool:
    return value is not None


def _truthy(value: Any) -> bool:
    return bool(value)


def _not_one(value: Any) -> bool:
    return value not in (None, 1)


def _not_text(value: Any) -> bool:
    return value is not None and (not isinstance(value, list) or any(m != "text" for m in value))


def _is_false(value: Any) -> bool:
    return value is False


def _nonzero(value: Any) -> bool:
    return value not in (None, 0)


# Fields both endpoints refuse, with when (and why, where it is not obvious).
_SHARED: dict[str, Rule] = {
    "best_of": _not_one,
    "use_beam_search": _truthy,
    "length_penalty": _given,
    "allowed_token_ids": _given,
    "bad_words": _truthy,
    "logits_processors": _truthy,
    "include_stop_str_in_output": _truthy,
    "spaces_between_special_tokens": _is_false,
    "truncate_prompt_tokens": _given,
    "priority": _nonzero,
    "prompt_logprobs": _given,  # over HTTP: completions' echo with logprobs
    "structural_tag": _given,
    # vLLM's older structured-output fields: structured_outputs replaces them.
    "guided_json": _given,
    "guided_regex": _given,
    "guided_choice": _given,
    "guided_grammar": _given,
    "guided_decoding_backend": _given,
    "guided_whitespace_pattern": _given,
    "prompt_embeds": _given,
    "mm_processor_kwargs": _given,
    "kv_transfer_params": _given,
    "vllm_xargs": _given,
}

COMPLETION_REFUSED: dict[str, Rule] = _SHARED | {"suffix": _truthy}

CHAT_REFUSED: dict[str, Rule] = _SHARED | {
    "functions": _given,
    "function_call": _given,
    "audio": _given,
    "modalities": _not_text,
    "prediction": _given,
    "store": _truthy,  # nothing is stored; store: false is accepted
    "web_search_options": _given,
    "reasoning_effort": _given,
    "verbosity": _given,
    "echo": _truthy,
    "chat_template": _given,
    "chat_template_kwargs": _truthy,
    "add_generation_prompt": _is_false,
    "continue_final_message": _truthy,
    "documents": _truthy,
}

def _not_disabled(value: Any) -> bool:
    return value not in (None, "disabled")


RESPONSES_REFUSED: dict[str, Rule] = {
    "store": _truthy,  # stateless: nothing is stored; store: false is accepted
    "previous_response_id": _given,
    "conversation": _given,
    "prompt": _given,  # stored prompt templates
    "reasoning": _given,  # effort and summaries: the model reasons as its template makes it
    "include": _truthy,
    "truncation": _not_disabled,
    "top_logprobs": _truthy,
    "max_tool_calls": _given,
    "background": _truthy,
}

# /v1/embeddings (`dimensions` is refused by the request itself, naming why).
EMBEDDINGS_REFUSED: dict[str, Rule] = {
    "truncate_prompt_tokens": _given,
    "add_special_tokens": _is_false,  # strings are tokenized with the tokenizer's special tokens
    "messages": _given,  # chat-rendered embedding input
    "normalize": _is_false,  # vectors are always L2-normalised
    "embed_dtype": _given,
    "mm_processor_kwargs": _given,
}

# Fields of a chat message the server does not render (the chat template sees role and content).
MESSAGE_REFUSED: dict[str, Rule] = {"function_call": _given, "audio": _given}

def first_refused(extra: Mapping[str, Any] | None, rules: Mapping[str, Rule]) -> str | None:
    """The first field of extra that rules refuse, or None."""
    for name, value in (extra or {}).items():
        rule = rules.get(name)
        if rule is not None and rule(value):
            return name
    return None
