"""A request's state inside the engine, and what a step reports of it. Transport-free: the engine
process turns StepUpdates into wire messages, the offline LLM reads them directly."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeserve.lora import LoRARequest
from pipeserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pipeserve.engine.prompt_logprobs import PromptLogprobs


# The token id a request holds for a token sampled on the device and not read yet (overlapped steps:
# its next decode row takes the token from the device).
PENDING = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    rid: str
    token_ids: list[int]  # prompt followed by every generated token
    prompt_len: int
    params: SamplingParams
    arrival: float
    app: str = ""
    cache_salt: str = ""  # prefix caching: only requests with the same salt share KV pages
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and stop_token_ids
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)
    reserved_pages: int = 0  # pages promised by admission (>= len(pages) while running)
    slot: int = -1  # row in the block table and the sampler's per-request buffers
    finish_reason: str = ""
    announced: bool = False  # some step has reported this request (its first update is `new`)
    num_preemptions: int = 0
    predicted_len: int | None = None  # the `predicted` policy's reservation of output tokens
    first_scheduled: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was admitted
    hash_root: bytes = b""  # prefix caching: the chain its page hashes start from (kv.prefix)
    page_hashes: list[bytes] = field(default_factory=list)  # of its full computed pages, in order
    prompt_logprobs: PromptLogprobs | None = None  # filled during prefill when params ask for them
    # An embedding request's pooling ("last" or "mean", pipeserve/engine/pooling.py; "": not one):
    # prefill only; the step that computes its last prompt token reads out the pooled hidden state
    # instead of sampling, and it finishes there ("stop", no token).
    embed: str = ""
    embedding: np.ndarray[Any, np.dtype[np.float32]] | None = None  # [hidden], L2-normalised
    lora: LoRARequest | None = None  # its adapter (None: the base model)

    @property
    def runs_every_prompt_row(self) -> bool:
        """Whether every prompt row must run (prompt logprobs, mean pooling): no prefix-cache hit."""
        return self.params.prompt_logprobs is not None or self.embed == "mean"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model: 1 when decoding, more while (re)prefilling."""
        return len(self.token_ids) - self.num_computed


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one sampled token: its own, and the request's top-k alternatives (views into the
    step's host arrays, not copies)."""

    logprob: float
    top_ids: np.ndarray[Any, np.dtype[Any]]  # int [k]
    top_logprobs: np.ndarray[Any, np.dtype[np.float32]]  # float32 [k]


@dataclass(slots=True)
class StepUpdate:
    """One request's part of one step."""

    seq: Sequence  # prompt, params and app of the request; read `new` to know whether it is news
    token_ids: list[int]  # generated this step: one, or none (it ended between steps)
    finish_reason: str  # "" while running, else "stop" | "length" | "abort"
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked
    new: bool = False  # the request's first update
    prompt_logprobs: PromptLogprobs | None = None  # on the first update, when the request asked
    embedding: np.ndarray[Any, np.dtype[np.float32]] | None = None  # an embedding request's, when done

    @property
    def rid(self) -> str:
        return self.seq.rid


def one_token_updates(updates: list[StepUpdate]) -> list[StepUpdate]:
    """The updates with one token each: a request that emitted several in one step (speculative
    decoding) takes one update per token, all but the last still running, so that whatever reads
    them token by token (stop strings, the wire's one-token rows) sees the order decoding made."""
    if all(len(u.token_ids) <= 1 for u in updates):
        return updates
    out = []
    for u in updates:
        if len(u.token_ids) <= 1:
            out.append(u)
            continue
        last = len(u.token_ids) - 1
        out += [StepUpdate(u.seq, [tok], u.finish_reason if i == last else "", None, u.new and i == 0,
                           u.prompt_logprobs if i == 0 else None)
                for i, tok in enumerate(u.token_ids)]
    return out
