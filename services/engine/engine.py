"""The engine: `add`, `abort`, `step`. Usable in-process (offline API, tests, benchmarks) and
wrapped by the engine process loop. Each step returns ONE columnar StepOutput."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np
import torch

from services.config import EngineConfig
from services.engine.backend import get_backend
from services.engine.kv.policy import make_policy
from services.engine.kv.pool import KVPool, kv_bytes_per_token
from services.engine.kv.predicted import PredictedPolicy
from services.engine.model.demo import ensure_demo_model
from services.engine.model.loader import load_model, resolve_dtype
from services.engine.model.quantize import quantize_model
from services.engine.runner import ModelRunner, StepResult
from services.engine.sampler import Sampler
from services.engine.scheduler import ScheduledBatch, Scheduler
from services.engine.sequence import Sequence, Status
from services.messages import NewRequestInfo, StepOutput, pack_ids
from services.sampling_params import SamplingParams

log = logging.getLogger(__name__)

PROMPT_TAIL = 8  # prompt ids the detokenizer gets as left context
MAX_TOMBSTONES = 65536
# An abort overtakes its add by the tokenizers' queueing (milliseconds). A tombstone older than
# this is stale (e.g. an abort the gateway queued for a dead engine's request) and is dropped, so
# it cannot end a request that reuses the id: the gateway holds an aborted id for longer (60 s).
TOMBSTONE_TTL = 30.0
CPU_KV_GB = 0.25


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_gb is not None:
        return int(config.kv_cache_gb * 2**30)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - (1 - config.gpu_memory_utilization) * total))
    return int(CPU_KV_GB * 2**30)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **options) -> None:
        self.config = config = config or EngineConfig(**options)
        self.device = resolve_device(config.device)
        backend = (
            config.backend
            if config.backend != "auto"
            else ("triton" if self.device.type == "cuda" else "torch")
        )
        self.model_dir = config.model or ensure_demo_model()
        from services.engine.model.config import ModelConfig  # cheap: reads config.json only

        model_cfg = ModelConfig.from_dir(self.model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, model_cfg)
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings
        )
        self.model, self.model_config = load_model(
            self.model_dir, get_backend(backend), self.device, self.dtype, self.max_model_len
        )
        self.backend = backend
        quantize_model(self.model, config.quantization, backend)  # before sizing the KV pool: frees memory
        per_page = kv_bytes_per_token(model_cfg, self.dtype, config.kv_cache_dtype) * config.page_size
        num_pages = config.num_pages or kv_budget_bytes(config, self.device) // per_page
        self.pool = KVPool(
            model_cfg,
            num_pages,
            config.page_size,
            self.dtype,
            self.device,
            config.max_num_seqs,
            self.max_model_len,
            config.kv_cache_dtype,
        )
        unquantized = num_pages * per_page // kv_bytes_per_token(model_cfg, self.dtype)
        log.info(
            "KV pool: %d pages of %d tokens = %d tokens in %.1f MiB (%s KV; %s would hold %d)",
            num_pages,
            config.page_size,
            num_pages * config.page_size,
            num_pages * per_page / 2**20,
            config.kv_cache_dtype,
            self.dtype,
            unquantized,
        )
        self.sampler = Sampler(config.max_num_seqs, model_cfg.vocab_size, self.device, config.max_logprobs)
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.sampler,
            self.device,
            config.max_num_seqs,
            config.max_num_batched_tokens,
        )
        policy_opts = {}
        if config.admission == "predicted":
            policy_opts = {
                "path": config.predictor_path,
                "quantile": config.predictor_quantile,
                "mode": config.predictor_mode,
            }
        self.policy = make_policy(config.admission, **policy_opts)
        self.scheduler = Scheduler(
            self.pool,
            self.policy,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self._on_admit,
            self.runner.release,
        )
        self.requests: dict[str, Sequence] = {}
        self._ended: list[Sequence] = []  # finished outside a step (abort), reported by the next step
        self._tombstones: OrderedDict[str, float] = OrderedDict()  # overtaking aborts: rid -> expiry
        self._recently_done: OrderedDict[str, None] = OrderedDict()
        self.step_count = 0
        self._rng = np.random.default_rng(config.seed)
        self._tokenizer = None

    # -- requests -------------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request; the engine state is untouched."""
        params.validate(self.config.max_logprobs)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the context is {self.max_model_len} "
                "and at least one must be left to generate"
            )
        if self.pool.pages_for(len(prompt_ids) + 1) > self.pool.num_pages:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, more than the KV cache holds")

    def add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        app: str = "",
        arrival: float | None = None,
    ) -> None:
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in flight")
        prompt_ids = [int(t) for t in prompt_ids]
        self.check(prompt_ids, params)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.model_config.eos_token_ids)
        seq = Sequence(
            rid,
            prompt_ids,
            len(prompt_ids),
            params,
            arrival or time.monotonic(),
            app,
            stop_ids=frozenset(stop),
        )
        if params.seed is None:  # unseeded requests still sample reproducibly per engine seed
            params.seed = int(self._rng.integers(0, 2**62))
        self.requests[rid] = seq
        self._recently_done.pop(rid, None)
        if self._tombstones.pop(rid, 0.0) > time.monotonic():
            self._end(seq, "abort")
            return
        self.scheduler.add(seq)

    def abort(self, rid: str, reason: str = "abort") -> None:
        """Idempotent. A known request ends at this step boundary; an unknown one is remembered so
        that an add arriving later (through another path) is dropped."""
        seq = self.requests.get(rid)
        if seq is None:
            if rid not in self._recently_done:
                self._tombstones.pop(rid, None)  # re-inserted at the end: the dict stays in expiry order
                self._tombstones[rid] = time.monotonic() + TOMBSTONE_TTL
                self._prune_tombstones()
            return
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, reason)
            self._end(seq, reason)

    def _prune_tombstones(self) -> None:
        now = time.monotonic()
        while self._tombstones and (
            len(self._tombstones) > MAX_TOMBSTONES or next(iter(self._tombstones.values())) <= now
        ):
            self._tombstones.popitem(last=False)

    def _end(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self._ended.append(seq)

    def _on_admit(self, seq: Sequence) -> None:
        if seq.first_scheduled is None:
            seq.first_scheduled = time.monotonic()
        self.runner.admit(seq, sorted(seq.stop_ids))

    # -- the step -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._ended)

    def step(self) -> StepOutput:
        batch = self.scheduler.schedule()
        result = self.runner.run(batch) if batch.num_tokens else StepResult([])
        sampled = batch.sampling()
        finished = self.scheduler.postprocess(batch, sampled, result.tokens)
        self.step_count += 1
        return self._output(batch, sampled, result, finished)

    def _output(
        self, batch: ScheduledBatch, sampled: list[Sequence], result: StepResult, finished: list[Sequence]
    ) -> StepOutput:
        rows = sampled + self._ended  # aborts happen between steps: never in this batch
        tokens = result.tokens + [-1] * (len(rows) - len(sampled))
        new = []
        for seq in rows:
            if not seq.announced:
                seq.announced = True
                p = seq.params
                new.append(
                    NewRequestInfo(
                        seq.rid,
                        seq.prompt_len,
                        pack_ids(seq.token_ids[: seq.prompt_len][-PROMPT_TAIL:]),
                        list(p.stop),
                        p.skip_special_tokens,
                        p.logprobs,
                    ).__dict__
                )
        logprobs = None
        if result.logprobs is not None:
            logprobs = [None] * len(rows)
            for i, seq in enumerate(sampled):
                k = seq.params.logprobs
                if k is not None:
                    logprobs[i] = [
                        float(result.logprobs[i]),
                        pack_ids(result.top_ids[i, :k]),
                        result.top_logprobs[i, :k].astype("<f4").tobytes(),
                    ]
        out = StepOutput(
            self.step_count,
            [s.rid for s in rows],
            pack_ids(tokens),
            [s.finish_reason for s in rows],
            new,
            logprobs,
        )
        for seq in finished + self._ended:
            self.requests.pop(seq.rid, None)
            self._recently_done[seq.rid] = None
        while len(self._recently_done) > MAX_TOMBSTONES:
            self._recently_done.popitem(last=False)
        self._ended = []
        return out

    def close(self) -> None:
        """Persist what the admission policy learned since its last periodic save (on shutdown)."""
        if isinstance(self.policy, PredictedPolicy):
            self.policy.save()

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        self._prune_tombstones()
        pool = self.pool.stats()
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_total": pool.pages_total,
            "pages_used": pool.pages_used,
            "pages_reserved": pool.pages_reserved,
            "preemptions": self.scheduler.num_preemptions,
            "requests": len(self.requests),
            "tombstones": len(self._tombstones),
            "steps": self.step_count,
        }

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from services.tokenizer.load import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def model_info(self) -> dict:
        cfg = self.model_config
        return {
            "name": cfg.name,
            "context_length": self.max_model_len,
            "vocab_size": cfg.vocab_size,
            "eos_token_ids": list(cfg.eos_token_ids),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "backend": self.backend,
            "quantization": self.config.quantization,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "page_size": self.pool.page_size,
            "num_pages": self.pool.num_pages,
        }
