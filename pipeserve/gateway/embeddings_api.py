"""OpenAI's `POST /v1/embeddings` over the gateway's embeddings (gateway/embeddings.py).

`input`: a string, a list of strings, token ids or a list of token-id lists (one embedding each, in
order); `encoding_format`: `float` (a JSON list) or `base64` (the little-endian float32 bytes, as
OpenAI); `dimensions` is refused (no served model has reduced, Matryoshka-trained sizes);
`usage.prompt_tokens` counts the tokens pooled.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict

from pipeserve.gateway.embeddings import embed
from pipeserve.gateway.http_common import HTTPError, RequestBody, from_refusal, until_disconnect
from pipeserve.gateway.openai_fields import EMBEDDINGS_REFUSED, Rule, first_refused
from pipeserve.gateway.requests import MAX_TOKEN_ID, Core, Prompt, Refusal


class EmbeddingRequest(RequestBody):
    model_config = ConfigDict(extra="allow")  # kept only to refuse the meaningful ones
    REFUSED: ClassVar[dict[str, Rule]] = EMBEDDINGS_REFUSED

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.dimensions is not None:
            raise HTTPError(400, "dimensions: this model has no reduced embedding sizes; leave dimensions "
                                 "unset for the full size", "dimensions", "unsupported_parameter")
        name = first_refused(self.model_extra, self.REFUSED)
        if name is not None:
            raise HTTPError(400, f"{name} is not supported by this server", name, "unsupported_parameter")

    def inputs(self) -> list[Prompt]:
        given = self.input
        if isinstance(given, str):
            given = [given]
        if not given:
            raise HTTPError(400, "input must not be empty", "input")
        items: list[Any] = [given] if isinstance(given[0], int) else list(given)
        out: list[Prompt] = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                if not item:
                    raise HTTPError(400, f"input[{i}] must not be an empty string", "input")
                out.append(item)
                continue
            if not item:
                raise HTTPError(400, f"input[{i}] must not be an empty list of token ids", "input")
            if any(not 0 <= t <= MAX_TOKEN_ID for t in item):
                raise HTTPError(400, f"input[{i}] has token ids outside [0, {MAX_TOKEN_ID}]", "input")
            out.append(np.asarray(item, dtype=np.int64))
        return out


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    values: list[float] = vector.tolist()
    return values


class Embeddings:
    """The /v1/embeddings endpoint of one OpenAI front end."""

    def __init__(self, core: Core, model: Callable[[str | None], str]) -> None:
        self.core, self.model = core, model

    async def create(self, body: EmbeddingRequest, request: Request) -> Response:
        model = self.model(body.model)
        inputs = body.inputs()
        try:
            results = await until_disconnect(request, embed(self.core, inputs, f"embd-{uuid.uuid4().hex}"))
        except Refusal as refusal:
            error = from_refusal(refusal)
            if error.param in ("prompt", "prompt_token_ids"):  # the core's name for what is `input` here
                error.param = "input"
            raise error from None
        tokens = sum(r.prompt_tokens for r in results)
        data = [{"object": "embedding", "index": i, "embedding": encoded(r.vector, body.encoding_format)}
                for i, r in enumerate(results)]
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
