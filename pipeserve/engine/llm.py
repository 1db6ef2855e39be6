"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

An edge like the gateway: it validates every request (ValueError naming the parameter) before any
reaches the engine, then drives the engine and turns its updates into text with the detokenizer
process's own per-request class (RequestText), so stop strings, aborts and the final flush behave
exactly as in the server."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from pipeserve.config import EngineConfig
from pipeserve.detokenizer.incremental import IncrementalDetokenizer, RequestText, make_decoder, skipped_ids
from pipeserve.engine.engine import Engine
from pipeserve.engine.sequence import one_token_updates
from pipeserve.lora import LoRARequest
from pipeserve.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Per generated token, when asked: {"logprob": float, "top": {token_id: logprob}}.
    logprobs: list[dict[str, Any]] | None = None
    # Per prompt token, when asked (prompt_logprobs): None for the first, else as logprobs.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check(self, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request (the engine only asserts)."""
        engine = self.engine
        params.validate(engine.config.max_logprobs, engine.model_config.vocab_size)
        if params.constrained:
            from pipeserve.grammar import check_constraint  # imports xgrammar: only when needed

            check_constraint(params)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = engine.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab})")
        problem = engine.capacity_problem(len(prompt_ids))
        if problem is not None:
            raise ValueError(problem)

    def _prompt_ids(self, prompts: str | Seq[str] | Seq[Seq[int]]) -> list[list[int]]:
        """One prompt (text or token ids) or several, as token ids each."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch: list[Any] = [prompts] if single else list(prompts)
        return [self.tokenizer(p).input_ids if isinstance(p, str) else [int(t) for t in p] for p in batch]

    def embed(self, prompts: str | Seq[str] | Seq[Seq[int]], cache_salt: str = "") -> list[np.ndarray]:
        """Each prompt's embedding (text, or token ids; in prompt order): the final-norm hidden state
        of its last token (pooling="last") or their mean over every token (pooling="mean"),
        L2-normalised unless embed_normalize=False (pipeserve/engine/pooling.py),
        float32 [hidden]. The prompts run as prefill-only requests batched through the engine's
        steps."""
        requests = self._prompt_ids(prompts)
        for ids in requests:
            self.check(ids, SamplingParams(max_tokens=1, temperature=0.0))
        rids = [f"offline-{next(self._ids)}" for _ in requests]
        for rid, ids in zip(rids, requests, strict=True):
            self.engine.add(rid, ids, SamplingParams(max_tokens=1, temperature=0.0), cache_salt=cache_salt,
                            embed=True)
        vectors: dict[str, np.ndarray] = {}
        while self.engine.has_work():
            for update in self.engine.step():
                if update.embedding is not None:
                    vectors[update.rid] = update.embedding
        return [vectors[rid] for rid in rids]

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, cache_salt: str = "",
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt (text, or token ids) to completion; outputs in prompt order. cache_salt:
        these prompts share prefix-cache pages only with requests of the same salt. lora_request:
        the adapter of every prompt, or one per prompt (None: the base model); LLM(...,
        enable_lora=True)."""
        batch = self._prompt_ids(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(batch)
        if len(sampling_params) != len(batch):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(batch)} prompts")
        loras = ([lora_request] * len(batch) if lora_request is None or isinstance(lora_request, LoRARequest)
                 else list(lora_request))
        if len(loras) != len(batch):
            raise ValueError(f"{len(loras)} LoRA requests for {len(batch)} prompts")
        if any(loras) and not self.engine.config.enable_lora:
            raise ValueError("lora_request needs LLM(..., enable_lora=True)")
        ids_by_name: dict[str, int] = {}
        for lora in loras:  # one adapter per name and per id, as the engine keys them
            if lora is not None and ids_by_name.setdefault(lora.lora_name,
                                                           lora.lora_int_id) != lora.lora_int_id:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} given with two ids")
        requests = []
        for ids, given in zip(batch, sampling_params, strict=True):
            # Each request gets its own params object: the engine fills in an unseeded seed.
            params = SamplingParams.from_dict(given.to_dict())
            self.check(ids, params)
            requests.append((ids, params))
        outputs: dict[str, RequestOutput] = {}
        texts: dict[str, RequestText] = {}
        decode, skip = make_decoder(self.tokenizer), skipped_ids(self.tokenizer)
        # Every adapter read and validated (a LoRAError names the file and field) before any request is
        # added; held meanwhile, so host memory keeps them.
        distinct = list({lora.lora_int_id: lora for lora in loras if lora is not None}.values())
        manager = self.engine.lora
        held: list[LoRARequest] = []
        try:
            for lora in distinct:
                assert manager is not None
                manager.hold(lora)
                held.append(lora)
            for (ids, params), lora in zip(requests, loras, strict=True):  # all valid: every one is added
                rid = f"offline-{next(self._ids)}"
                self.engine.add(rid, ids, params, cache_salt=cache_salt, lora=lora)
                outputs[rid] = RequestOutput(rid, ids, logprobs=[] if params.logprobs is not None else None)
                texts[rid] = RequestText(IncrementalDetokenizer(
                    self.tokenizer, ids, params.stop, params.skip_special_tokens, decode=decode, skip=skip))
        finally:
            for lora in held:
                assert manager is not None
                manager.drop(lora)
        bar = tqdm(total=len(outputs), disable=not use_tqdm, desc="generate")
        while self.engine.has_work():
            for update in one_token_updates(self.engine.step()):
                text = texts[update.rid]
                if text.finished:  # a stop string ended it; the engine had not seen the abort yet
                    continue
                out = outputs[update.rid]
                out.token_ids += update.token_ids
                out.num_cached_tokens = update.seq.num_cached_tokens
                if update.prompt_logprobs is not None:
                    lp = update.prompt_logprobs
                    top = [dict(zip(i.tolist(), v.tolist(), strict=True))
                           for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
                    out.prompt_logprobs = [None] + [{"logprob": float(lp.logprobs[p]), "top": top[p]}
                                                    for p in range(1, len(lp.logprobs))]
                if out.logprobs is not None and update.logprobs is not None:
                    out.logprobs += [
                        {"logprob": lp.logprob,
                         "top": dict(zip(lp.top_ids.tolist(), lp.top_logprobs.tolist(), strict=True))}
                        for lp in update.logprobs
                    ]
                delta = text.feed(update.token_ids, update.finish_reason)
                out.text += delta.text
                if delta.abort:  # a stop string matched: end it here, as the server does
                    self.engine.abort(update.rid, "stop")
                if delta.finish:
                    out.finish_reason = delta.finish
                    bar.update(1)
        bar.close()
        return list(outputs.values())
