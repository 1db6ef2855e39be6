"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from services.config import EngineConfig
from services.detokenizer.incremental import IncrementalDetokenizer, make_decoder, skipped_ids
from services.engine.engine import Engine
from services.messages import unpack_ids
from services.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    # Per generated token, when asked: {"logprob": float, "top": {token_id: logprob}}.
    logprobs: list[dict] | None = None


class LLM:
    def __init__(self, model: str | None = None, **options) -> None:
        self.engine = Engine(EngineConfig(model=model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt (text, or token ids) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        outputs: dict[str, RequestOutput] = {}
        decode, skip = make_decoder(self.tokenizer), skipped_ids(self.tokenizer)
        detoks: dict[str, IncrementalDetokenizer] = {}
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else [int(t) for t in prompt]
            rid = f"offline-{next(self._ids)}"
            # Each request gets its own params object: the engine fills in an unseeded seed.
            self.engine.add(rid, ids, SamplingParams.from_dict(params.to_dict()))
            outputs[rid] = RequestOutput(rid, ids, logprobs=[] if params.logprobs is not None else None)
            detoks[rid] = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                                 decode=decode, skip=skip)
        bar = tqdm(total=len(outputs), disable=not use_tqdm, desc="generate")
        while self.engine.has_work():
            step = self.engine.step()
            tokens = unpack_ids(step.tokens)
            for i, rid in enumerate(step.rids):
                out, token, finish = outputs[rid], int(tokens[i]), step.finish[i]
                if token >= 0 and not out.finish_reason:
                    out.token_ids.append(token)
                    delta = detoks[rid].add(token)
                    out.text += delta.text
                    if out.logprobs is not None and step.logprobs and step.logprobs[i] is not None:
                        lp, top_ids, top_lps = step.logprobs[i]
                        top = dict(zip(unpack_ids(top_ids).tolist(),
                                       np.frombuffer(top_lps, "<f4").tolist(), strict=True))
                        out.logprobs.append({"logprob": lp, "top": top})
                    if delta.stopped:  # a stop string matched: end it here, as the server does
                        finish = "stop"
                        self.engine.abort(rid, "stop")
                if finish and not out.finish_reason:
                    out.finish_reason = finish
                    out.text += detoks[rid].flush()
                    bar.update(1)
        bar.close()
        return list(outputs.values())
