"""Per-request sampling parameters. Torch-free: the gateway and tokenizer import it too. Defaults:
a field a gRPC request leaves unset takes the model's generation_config.json default when it states
one (ModelInfo.sampling_defaults), else the default here."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from pipeserve.config import opt
from pipeserve.reasoning import FORMATS as REASONING_FORMATS

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 1024
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (OpenAI allows 300)
LOGIT_BIAS_LIMIT = 100.0  # biases lie in [-100, 100], as OpenAI's
# Structured-output constraints, at most one per request (pipeserve/grammar.py builds them).
CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")
# The engine's stats key PREEMPTIONS_BY_PRIORITY + str(priority): requests of that priority preempted.
PREEMPTIONS_BY_PRIORITY = "preemptions_priority:"


@dataclass
class SamplingParams:
    max_tokens: int = opt(16, "most tokens to generate; prompt + max_tokens must fit the context")
    temperature: float = opt(1.0, "sampling temperature; 0 is greedy")
    top_p: float = opt(1.0, "nucleus sampling: keep the most likely tokens up to this probability mass")
    top_k: int = opt(-1, "keep the k most likely tokens; -1: the whole vocabulary")
    min_p: float = opt(0.0, "drop tokens below this fraction of the most likely token's probability")
    repetition_penalty: float = opt(1.0, "HF-style penalty on tokens of the prompt and the output; 1: off")
    presence_penalty: float = opt(0.0, "OpenAI-style penalty on tokens already in the output")
    frequency_penalty: float = opt(0.0, "OpenAI-style penalty growing with each output token's count")
    seed: int | None = opt(None, "per-request sampling seed; unset: the engine's")
    stop: list[str] = opt(help="stop when the text contains this string (repeatable)", factory=list)
    stop_token_ids: list[int] = opt(help="stop on this token id (repeatable)", factory=list)
    ignore_eos: bool = opt(False, "keep generating past the end-of-sequence token")
    min_tokens: int = opt(0, "generate at least this many tokens before any stop applies")
    logprobs: int | None = opt(None, "return the log-probability of each token and of its N most likely "
                               "alternatives; unset: none")
    prompt_logprobs: int | None = opt(None, "return the log-probability of every prompt token (the first has "
                                      "none) and of its N most likely alternatives; unset: none")
    skip_special_tokens: bool = opt(True, "leave special tokens out of the text")
    speculative: bool = opt(True, "let the engine's speculative decoding propose tokens for this request "
                            "(exact either way); false opts out")
    priority: int = opt(0, "scheduling priority under --scheduling-policy priority: lower runs sooner; "
                        "ignored under fcfs")
    logit_bias: dict[int, float] | None = opt(
        None, "added to these token ids' logits before sampling (OpenAI's logit_bias: token id -> bias "
        "in [-100, 100]; -100 bans a token, 100 all but forces it)")
    # Structured outputs: the output must match this constraint (at most one is set).
    json_schema: dict[str, Any] | str | None = opt(
        None, "the output must be JSON valid under this JSON schema (a dict or JSON text)")
    json_object: bool = opt(False, "the output must be a JSON object")
    regex: str | None = opt(None, "the output must fully match this regular expression")
    choice: list[str] | None = opt(None, "the output must be exactly one of these strings")
    grammar: str | None = opt(None, "the output must match this EBNF grammar (GBNF style, root rule `root`)")
    reasoning_format: str | None = opt(
        None, "the constraint applies from the first token after a reasoning section of this format "
        f"({', '.join(REASONING_FORMATS)}); the section itself is free text. Unset: from the first token")

    def validate(self, max_logprobs: int = 20, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field. vocab_size: the model's, when known (the ids
        logit_bias names must lie inside it)."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, "must be a finite number")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", "must be an integer in [0, 2**63)")
        if not isinstance(self.priority, int) or not -(2**31) <= self.priority < 2**31:
            bad("priority", "must be an integer in [-2**31, 2**31)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= max_logprobs):
                bad(name, f"must be in [0, {max_logprobs}]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings, at most {MAX_STOP_STRINGS} allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"stop strings must be non-empty and at most {MAX_STOP_STRING_LEN} characters"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS}"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        self._validate_logit_bias(vocab_size)
        self._validate_constraint()

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a map of token id to bias, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS} allowed")
        top = vocab_size if vocab_size is not None else 2**31
        for token, value in bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < top:
                raise ValueError(f"logit_bias: token id {token!r} is outside the vocabulary [0, {top})")
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
                raise ValueError(f"logit_bias: the bias of token {token} must be a number in "
                                 f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {value!r}")

    def _validate_constraint(self) -> None:
        """The constraint's shape. Whether it compiles (schema, regex or grammar syntax) is checked
        where the tokenizer is at hand: pipeserve.grammar.check_constraint."""
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if self.reasoning_format is not None and self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, "
                             f"got {self.reasoning_format!r}")
        if len(given) > 1:
            raise ValueError(f"at most one structured-output constraint may be set, got {', '.join(given)}")
        if not given:
            return
        if self.ignore_eos or self.min_tokens:
            # The output ends where the structure does: EOS is the only token left then.
            raise ValueError(f"{given[0]} cannot be combined with ignore_eos or min_tokens")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"choice has {len(self.choice)} strings, at most {MAX_CHOICES} allowed")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("choice strings must be non-empty")

    @property
    def constrained(self) -> bool:
        return any(getattr(self, name) not in (None, False) for name in CONSTRAINTS)

    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint, or None: the one canonical form that
        grammars are built from and cached by. JSON schemas keep their key order (it is the
        order the properties are generated in)."""
        if self.json_schema is not None:
            text = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
            return "json_schema", text
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice, ensure_ascii=False)
        if self.grammar is not None:
            return "grammar", self.grammar
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        return cls(**data)
