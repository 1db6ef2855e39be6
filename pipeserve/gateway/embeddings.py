"""Embeddings through the gateway's core, transport-free (the HTTP `/v1/embeddings` route and the gRPC
`Embed` RPC both call `embed`).

Each input becomes one embedding request (TokenizeRequest.embed): tokenized as a completion prompt is
(a string with the special tokens the tokenizer adds by default, token ids as given), run by the
engine as a prefill only, batched with whatever else runs (pipeserve/engine/pooling.py), and answered
with the final-norm hidden states pooled as the engine's --pooling says (its last token's, or the
mean over every token), L2-normalised, in its finishing row.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from pipeserve.gateway.requests import Core, ErrorCode, Prompt, Refusal, Stream, invalid
from pipeserve.sampling_params import SamplingParams

MAX_INPUTS = 2048  # inputs of one request, as OpenAI's limit


@dataclass
class Embedding:
    vector: np.ndarray  # float32 [hidden], L2-normalised
    prompt_tokens: int  # the tokens pooled


async def embed(core: Core, inputs: list[Prompt], rid: str, cache_salt: str = "") -> list[Embedding]:
    """One embedding per input, in order; Refusal (naming `input` or the core's cause) otherwise.
    Every input is admitted before any answer is awaited, so they share the engine's steps."""
    if not inputs:
        raise core.refused(invalid("input must not be empty"))
    if len(inputs) > MAX_INPUTS:
        raise core.refused(invalid(f"input has {len(inputs)} items, at most {MAX_INPUTS} allowed"))
    params = SamplingParams(max_tokens=1, temperature=0.0)  # the engine samples nothing for them
    streams: list[Stream] = []
    try:
        for i, prompt in enumerate(inputs):
            streams += await core.submit(params, prompt, f"{rid}-{i}", cache_salt=cache_salt, embed=True)
        return list(await asyncio.gather(*(_one(core, stream) for stream in streams)))
    finally:
        for stream in streams:
            core.close(stream)


async def _one(core: Core, stream: Stream) -> Embedding:
    vector = None
    async for rows, _ in core.output(stream):
        vector = next((row.embedding for row in rows if row.embedding is not None), vector)
    if vector is None:  # a finish without its vector: the request was aborted in the engine
        raise Refusal(ErrorCode.CANCELLED if stream.finish == "abort" else ErrorCode.INTERNAL,
                      f"the embedding request ended ({stream.finish or 'no finish'}) without its vector")
    return Embedding(vector, stream.prompt_tokens)
