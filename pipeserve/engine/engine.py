"""The engine core: `add`, `abort`, `step`, transport-free. Usable in-process (offline API, tests,
benchmarks) and wrapped by the engine process loop, which owns the wire format, the tombstones of
aborts that overtake their add, and clock conversion. Requests reaching `add` were validated at an
edge (the gateway and tokenizer, or the offline LLM): here they are only asserted."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pipeserve import hub
from pipeserve.config import EngineConfig
from pipeserve.demo import ensure_demo_model
from pipeserve.engine.backend import Backend
from pipeserve.engine.executor import EagerStep, StepPlan
from pipeserve.engine.host_memory import keep_freed_memory
from pipeserve.engine.kv.policy import make_policy
from pipeserve.engine.kv.pool import KVPool, kv_bytes_per_page
from pipeserve.engine.kv.predicted import PredictedPolicy
from pipeserve.engine.lora import layer as lora_layer
from pipeserve.engine.lora.manager import LoRAManager
from pipeserve.engine.lora.rows import LoRAContext
from pipeserve.engine.lora.shard import LoRAShard
from pipeserve.engine.lora.tensor_parallel import AdapterSender
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.engine.model.loader import load_model
from pipeserve.engine.model.tensor_parallel import check_shardable
from pipeserve.engine.parallel import group as parallel_group
from pipeserve.engine.parallel import worker
from pipeserve.engine.parallel.group import TPGroup
from pipeserve.engine.parallel.step_plan import StepSender
from pipeserve.engine.pooling import Pooler
from pipeserve.engine.prompt_logprobs import PromptLogprobs
from pipeserve.engine.quantization.model import weight_bytes
from pipeserve.engine.runner import ForwardRunner, LaunchedStep, ModelRunner, StepResult
from pipeserve.engine.sampler import Sampler
from pipeserve.engine.scheduler import ScheduledBatch, Scheduler
from pipeserve.engine.sequence import Sequence, Status, StepUpdate, TokenLogprobs
from pipeserve.engine.shard import build_pool, load_shard, resolve_device
from pipeserve.engine.spec.draft import DraftModel
from pipeserve.engine.spec.ngram import NgramProposer
from pipeserve.engine.spec.speculator import Speculator
from pipeserve.engine.structured import StructuredOutputs
from pipeserve.lora import LORA_RUNNING, LoRARequest
from pipeserve.model_config import ModelConfig, generation_defaults
from pipeserve.sampling_params import PREEMPTIONS_BY_PRIORITY, SamplingParams
from pipeserve.startup import phase

log = logging.getLogger(__name__)

GRAMMAR_WAIT = 0.005  # seconds a step with nothing to run waits for a grammar to compile


@dataclass
class InFlight:
    """An overlapped step launched and not read yet (see Engine.step)."""

    sampled: list[Sequence]  # its sampling requests, in row order (each holds a PENDING token)
    launched: LaunchedStep


class Engine:
    def __init__(self, config: EngineConfig | None = None, **options: Any) -> None:
        """With config.tensor_parallel_size > 1 this is rank 0: it starts ranks 1..T-1
        (pipeserve/engine/parallel/worker.py), which hold a shard and a KV pool each, no Engine."""
        self.config = config = config or EngineConfig(**options)
        self.tp: TPGroup | None = None
        if config.tensor_parallel_size > 1:
            model_dir = hub.resolve(config.model, config.revision) if config.model else ensure_demo_model()
            model_cfg = ModelConfig.from_dir(model_dir, config.rope_scaling)
            check_shardable(model_cfg, config.tensor_parallel_size)  # before any process starts
            self.tp = parallel_group.start(config, worker.main)
        try:
            self._build(config, self.tp)
        except BaseException:
            if self.tp is not None:  # the other ranks go with this one
                self.tp.close()
            raise

    def _build(self, config: EngineConfig, tp: TPGroup | None) -> None:
        self.model_dir = hub.resolve(config.model, config.revision) if config.model else ensure_demo_model()
        model_cfg = ModelConfig.from_dir(self.model_dir, config.rope_scaling)
        self.device = resolve_device(config.device) if tp is None else tp.device
        if self.device.type == "cpu":  # a CPU step's activations are large blocks, every step
            keep_freed_memory()
        self._tokenizer: Any = None
        self.structured = StructuredOutputs(
            lambda: self.tokenizer,
            model_cfg.vocab_size,
            model_cfg.eos_token_ids,
            config.max_num_seqs,
            self.device,
        )
        # The grammar compiler (xgrammar's import, the vocabulary read) is built while the model
        # loads, so that the first constrained request waits only for its own grammar.
        compiler = self.structured.prepare()
        shard = load_shard(config, tp)
        self.model, self.model_config = shard.model, shard.model_config
        self.dtype, self.max_model_len = shard.dtype, shard.max_model_len
        backend = shard.backend
        self.backend = backend.name
        # A draft model is loaded before the pool is sized: its pool holds as many pages, of its size.
        draft = self._load_draft(config, backend, model_cfg) if config.speculative_method == "draft" else None
        draft_per_page = kv_bytes_per_page(draft[1], self.dtype, config.page_size) if draft else 0
        self.pool = build_pool(config, shard, tp, draft_per_page, weight_bytes(draft[0]) if draft else 0)
        self.sampler = Sampler(config.max_num_seqs, model_cfg.vocab_size, self.device, config.max_logprobs)
        self.lora: LoRAManager | None = None
        lora_context = None
        if config.enable_lora:  # after prepare_model (the CPU's packed linears): the adapters wrap them
            assert config.max_cpu_loras is not None  # EngineConfig fills it in
            self.lora = LoRAManager(cfg=model_cfg, max_loras=config.max_loras,
                                    max_lora_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras,
                                    max_num_seqs=config.max_num_seqs, dtype=self.dtype, device=self.device,
                                    shard=None if tp is None else LoRAShard(model_cfg, tp.rank, tp.world))
            lora_context = LoRAContext(self.lora.table, self.lora)
            lora_layer.attach(self.model, self.lora.table, lora_context, backend)
        spec_tokens = config.num_speculative_tokens if config.speculative_method != "none" else 0
        plan = StepPlan(
            requested=config.step_executor,
            max_rows=config.max_num_seqs * (1 + spec_tokens),  # verification rows run as decode rows
            exact=tuple(range(2, 2 + spec_tokens)),  # a batch-1 verification step's row counts
            whole_graph=config.quantization == "none" and not any(model_cfg.moe_layers or ()),
            max_cuda_graph_batch=config.max_cuda_graph_batch,
            tensor_parallel=tp is not None,
        )
        self.runner = ModelRunner(
            model=self.model,
            pool=self.pool,
            backend=backend,
            device=self.device,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            plan=plan,
            sampler=self.sampler,
            structured=self.structured,
            pooler=Pooler(config.pooling, config.embed_normalize, config.max_num_seqs, model_cfg.hidden_size,
                          self.device),
            lora=lora_context,
        )
        self.pooling = config.pooling
        log.info("embeddings: %s pooling of the final hidden state (--pooling), %s", config.pooling,
                 "L2-normalised" if config.embed_normalize else "not normalised (--no-embed-normalize)")
        if tp is not None:  # its steps run eager (StepPlan.tensor_parallel): each sends the step plan
            caches = self.pool.layers
            adapters = None if lora_context is None else AdapterSender(lora_context, tp.device)
            send = StepSender(tp, caches[0].seq_of_page if caches else None, adapters).send
            for step in (self.runner.eager, self.runner.executor):
                assert isinstance(step, EagerStep)
                step.send_plan = send
        with phase("compiling and warming up the decode steps", log):
            self.runner.warm_up()  # compiles or captures before the engine reports ready
        self.speculator = self._speculator(config, backend, plan, draft)
        policy_opts: dict[str, Any] = {}
        if config.admission == "predicted":
            policy_opts = {
                "path": config.predictor_path,
                "quantile": config.predictor_quantile,
                "mode": config.predictor_mode,
            }
        self.policy = make_policy(config.admission, **policy_opts)
        self.scheduler = Scheduler(
            pool=self.pool,
            policy=self.policy,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            on_admit=self._on_admit,
            on_release=self._on_release,
            scheduling_policy=config.scheduling_policy,
            adapters=self.lora,
        )
        log.info("scheduling policy: %s", config.scheduling_policy)
        self.requests: dict[str, Sequence] = {}
        self._ended: list[Sequence] = []  # finished outside a step (abort), reported by the next step
        self.overlap = self._choose_overlap(config)
        self._in_flight: InFlight | None = None  # the overlapped step launched by the last call
        self.step_count = 0
        self._rng = np.random.default_rng(config.seed)
        self._refused: dict[str, str] = {}  # rid -> why, until take_refused()
        if compiler is not None:
            with phase("preparing structured outputs (the grammar compiler)", log):
                try:
                    compiler.result()
                except Exception as exc:  # noqa: BLE001 - constrained requests will say why; serve the rest
                    log.warning("the grammar compiler could not be built: %s", exc)

    def _choose_overlap(self, config: EngineConfig) -> bool:
        """Overlapped decode steps (EngineConfig.overlap_steps), chosen once and logged."""
        if self.speculator is not None or self.tp is not None:
            why = "off: the next step needs the tokens (speculative decoding or tensor parallelism)"
            on = False
        elif config.overlap_steps == "auto":
            on = self.device.type == "cuda"
            why = ("on: the host prepares the next step while the GPU runs this one" if on
                   else f"off: on {self.device.type} the device is the host")
        else:
            on = config.overlap_steps == "on"
            why = "requested"
        log.info("overlapped decode steps: %s (--overlap-steps %s)", why, config.overlap_steps)
        return on

    # -- requests -------------------------------------------------------------------------------
    @property
    def max_prompt_len(self) -> int:
        """The longest prompt this engine can run: one token must still fit in the context and in
        the whole KV pool, or the request could never produce output."""
        return min(self.max_model_len, self.pool.num_pages * self.pool.page_size) - 1

    def capacity_problem(self, prompt_len: int) -> str | None:
        """Why a prompt this long can never run on this engine (its context or KV pool), or None.
        Not validation: the tokenizers check the model's context, but only the engine knows its
        own (possibly shorter) context and pool."""
        if prompt_len >= self.max_model_len:
            return (f"prompt has {prompt_len} tokens; the context is {self.max_model_len} "
                    "and at least one must be left to generate")
        if prompt_len > self.max_prompt_len:
            return f"prompt has {prompt_len} tokens, more than the KV cache holds"
        return None

    def add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        app: str = "",
        arrival: float | None = None,
        cache_salt: str = "",
        embed: bool = False,
        lora: LoRARequest | None = None,
    ) -> None:
        """Queue a request. Its id, ids and params were validated by the caller's edge. arrival:
        time.monotonic() of its arrival (default now). cache_salt: prefix-cache pages are shared only
        among requests with the same salt. Unseeded params get a seed drawn here. embed: an
        embedding request (prefill only; its update carries the pooled final hidden state, --pooling;
        params must ask for nothing but the defaults, max_tokens 1). lora: its adapter, read into host
        memory now (LoRAError, a ValueError naming the file and field, refuses the request; nothing
        is queued)."""
        assert rid not in self.requests, f"request_id {rid!r} is already in flight"
        assert 0 < len(prompt_ids) <= self.max_prompt_len, f"prompt of {len(prompt_ids)} tokens"
        vocab = self.model_config.vocab_size
        assert 0 <= min(prompt_ids) and max(prompt_ids) < vocab, "ids outside the vocabulary"
        assert params.max_tokens >= 1 and params.min_tokens <= params.max_tokens, "unvalidated params"
        if lora is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} requested but LoRA is not enabled "
                                 "(enable_lora)")
            self.lora.hold(lora)
            # Its pages hold the adapter's K/V: shared only among requests of the same adapter.
            cache_salt = f"{cache_salt}\0lora:{lora.lora_int_id}:{lora.lora_path}"
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.model_config.eos_token_ids)
        seq = Sequence(
            rid,
            list(prompt_ids),
            len(prompt_ids),
            params,
            time.monotonic() if arrival is None else arrival,
            app,
            cache_salt,
            stop_ids=frozenset(stop),
            embed=self.pooling if embed else "",
            lora=lora,
        )
        assert not embed or (params.max_tokens == 1 and not params.constrained
                             and params.prompt_logprobs is None), "an embedding request samples nothing"
        if params.seed is None:  # unseeded requests still sample reproducibly per engine seed
            params.seed = int(self._rng.integers(0, 2**62))
        self.requests[rid] = seq
        if params.constrained:
            self.structured.submit(seq)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(seq)

    def abort(self, rid: str, reason: str = "abort") -> bool:
        """End a request at this step boundary (the next step reports it). Idempotent; returns
        whether the request is known (the engine process tombstones unknown ones)."""
        seq = self.requests.get(rid)
        if seq is None:
            return False
        if seq.status is not Status.FINISHED:
            if self.structured.discard(seq):  # still waiting for its grammar: never scheduled
                seq.status, seq.finish_reason = Status.FINISHED, reason
            else:
                self.scheduler.finish(seq, reason)
            self._ended.append(seq)
        return True

    def _on_admit(self, seq: Sequence) -> None:
        if seq.first_scheduled is None:
            seq.first_scheduled = time.monotonic()
        self.runner.admit(seq, sorted(seq.stop_ids))
        if self.speculator is not None:
            self.speculator.admit(seq)

    def _on_release(self, seq: Sequence) -> None:
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _load_draft(self, config: EngineConfig, backend: Backend,
                    model_cfg: ModelConfig) -> tuple[LlamaForCausalLM, ModelConfig]:
        assert config.draft_model is not None
        draft_dir = hub.resolve(config.draft_model, config.revision)
        draft_cfg = ModelConfig.from_dir(draft_dir)
        if draft_cfg.vocab_size != model_cfg.vocab_size:  # preflight says so first under `pipeserve up`
            raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size}) is not the model's "
                             f"({model_cfg.vocab_size}): it must share the tokenizer")
        model, _ = load_model(draft_dir, backend, self.device, self.dtype, self.max_model_len)
        backend.prepare_model(model)
        return model, draft_cfg

    def _speculator(self, config: EngineConfig, backend: Backend, plan: StepPlan,
                    draft: tuple[LlamaForCausalLM, ModelConfig] | None) -> Speculator | None:
        def speculator(ngram: NgramProposer | None = None, drafter: DraftModel | None = None) -> Speculator:
            return Speculator(k=config.num_speculative_tokens, max_num_seqs=config.max_num_seqs,
                              max_model_len=self.max_model_len, adaptive=config.speculative_adaptive,
                              ngram=ngram, draft=drafter, exact_rows=self.runner.exact_rows)

        if config.speculative_method == "ngram":
            return speculator(ngram=NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
        if draft is None:
            return None
        model, draft_cfg = draft
        # As many tokens as the model's pool: every request it holds can be drafted for.
        pool = KVPool(cfg=draft_cfg, num_pages=self.pool.num_pages, page_size=self.pool.page_size,
                      dtype=self.dtype, device=self.device, max_num_seqs=config.max_num_seqs,
                      max_model_len=self.max_model_len)
        # The draft's one-token rounds run on a step executor of its own, chosen for the draft (an
        # explicit choice for the model stands for its family: the draft may be another kind).
        requested = "eager" if self.runner.executor.mode == "eager" else "auto"
        # It proposes without the adapters (verification applies them).
        draft_plan = replace(plan, requested=requested, max_rows=config.max_num_seqs, exact=(),
                             whole_graph=not any(draft_cfg.moe_layers or ()))
        runner = ForwardRunner(model=model, pool=pool, backend=backend, device=self.device,
                               max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens, plan=draft_plan,
                               role="draft")
        runner.warm_up()
        drafter = DraftModel(runner=runner, sampler=self.sampler,
                             max_num_batched_tokens=config.max_num_batched_tokens)
        return speculator(drafter=drafter)

    # -- the step -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self._ended) or bool(self.structured.waiting)
                or self._in_flight is not None)

    def step(self) -> list[StepUpdate]:
        """Run one step; one update per request it touched: those that sampled a token, in batch
        row order, then those that ended between steps (no token). With overlapped steps a decode
        step's tokens are read, and reported, by the next call: each call launches its step, then
        lands the one in flight while the device runs the new one."""
        updates: list[StepUpdate] = []
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and (self.scheduler.waiting or self.structured.waiting):
            updates += self._land(in_flight)  # admissions and grammars need every token read
            in_flight = None
        step_start = time.perf_counter()
        if self.structured.waiting:
            self._take_compiled()
        proposals, drafts = self.speculator.propose(self.scheduler.running) if self.speculator else ({}, None)
        batch = self.scheduler.schedule(proposals)
        overlaps = self._overlaps(batch)
        start = time.perf_counter()
        launched = (self.runner.launch(batch, drafts, None if in_flight is None else in_flight.launched)
                    if batch.num_tokens else LaunchedStep.done(StepResult([])))
        if in_flight is not None:
            updates += self._land(in_flight)
        sampled = batch.sampling()
        if in_flight is not None or overlaps:  # decode rows only: their tokens land as a deferred step's
            assert not batch.prefill and not batch.verify
            self.scheduler.defer(batch, sampled)
            deferred = InFlight(sampled, launched)
            if overlaps and any(seq.status is Status.RUNNING for seq in sampled):
                self._in_flight = deferred
            else:  # nothing to overlap with, or only rows of requests that just stopped
                updates += self._land(deferred)
        else:
            result = launched.result()
            if self.speculator is not None:
                self.speculator.observe(batch, result.accepted, time.perf_counter() - start)
            before = [seq.num_tokens for seq in sampled]
            finished = self.scheduler.postprocess(batch, sampled, result.tokens, result.accepted)
            self.step_count += 1
            new = [seq.token_ids[n:] for seq, n in zip(sampled, before, strict=True)]
            updates += self._report(sampled, new, range(len(sampled)), result)
            self._retire(finished)
        updates += [self._update(seq, []) for seq in self._ended]
        self._retire(self._ended)
        self._ended = []
        if self.speculator is not None:
            self.speculator.finish(time.perf_counter() - step_start)
        return updates

    def _overlaps(self, batch: ScheduledBatch) -> bool:
        """Whether the step may stay in flight: overlapped steps are on, and the next step needs none of
        its tokens on the host (every running request a decode row, none waiting to be admitted, no
        grammar). The next step is then decode rows only, of these requests."""
        return (self.overlap and bool(batch.decode) and not batch.prefill and not batch.verify
                and len(batch.decode) == len(self.scheduler.running) and not self.scheduler.waiting
                and not self.structured.waiting and not self.structured.matchers)

    def _land(self, in_flight: InFlight) -> list[StepUpdate]:
        """Read the step in flight's tokens (the step's one readback) and report them."""
        result = in_flight.launched.result()
        landed, rows, finished = self.scheduler.land(in_flight.sampled, result.tokens)
        self.step_count += 1
        updates = self._report(landed, [[seq.token_ids[-1]] for seq in landed], rows, result)
        self._retire(finished)
        return updates

    def _report(self, seqs: list[Sequence], tokens: list[list[int]], rows: Iterable[int],
                result: StepResult) -> list[StepUpdate]:
        """The updates of requests that got tokens; rows: each one's row in the step's results."""
        updates = [self._update(seq, toks) for seq, toks in zip(seqs, tokens, strict=True)]
        if result.logprobs is not None:
            lps, top_ids, top_lps = result.logprobs, result.top_ids, result.top_logprobs
            assert top_ids is not None and top_lps is not None
            for i, update in zip(rows, updates, strict=True):
                k = update.seq.params.logprobs
                if k is not None:
                    update.logprobs = [TokenLogprobs(float(lps[i]), top_ids[i, :k], top_lps[i, :k])]
        return updates

    def _retire(self, finished: list[Sequence]) -> None:
        """Forget requests that finished (their last update is made)."""
        for seq in finished:
            del self.requests[seq.rid]
            self.structured.finish(seq)
            if self.lora is not None and seq.lora is not None:
                self.lora.drop(seq.lora)

    def take_refused(self) -> dict[str, str]:
        """rid -> why of the requests refused since the last call: their constraint did not compile.
        The step that ended them reported them (finish "abort", no token); the engine process tells
        the client why instead."""
        refused, self._refused = self._refused, {}
        return refused

    def _take_compiled(self) -> None:
        """Schedule the requests whose grammar is compiled; when nothing else could run, wait a
        moment for one instead of spinning."""
        if not self.scheduler.has_work() and not self._ended:
            self.structured.wait(GRAMMAR_WAIT)
        ready, failed = self.structured.ready()
        for seq in ready:
            self.scheduler.add(seq)
        for seq, why in failed:  # a constraint that does not compile: the request is refused
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            self._refused[seq.rid] = why
            self._ended.append(seq)

    @staticmethod
    def _update(seq: Sequence, token_ids: list[int]) -> StepUpdate:
        new, seq.announced = not seq.announced, True
        prompt = None
        if new and seq.params.prompt_logprobs is not None:  # filled during prefill (prompt_logprobs.py)
            prompt = seq.prompt_logprobs or PromptLogprobs.empty(seq.prompt_len, seq.params.prompt_logprobs)
        return StepUpdate(seq, token_ids, seq.finish_reason, None, new, prompt, seq.embedding)

    def close(self) -> None:
        """Persist what the admission policy learned since its last periodic save (on shutdown)."""
        if isinstance(self.policy, PredictedPolicy):
            self.policy.save()
        self.structured.close()
        if self.tp is not None:
            self.tp.close()

    # -- introspection --------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        pool = self.pool.stats()
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "compiling": len(self.structured.waiting),  # waiting for their grammar, outside the scheduler
            "pages_total": pool.pages_total,
            "pages_used": pool.pages_used,
            "pages_reserved": pool.pages_reserved,
            "preemptions": self.scheduler.num_preemptions,
            **{f"{PREEMPTIONS_BY_PRIORITY}{p}": n for p, n in self.scheduler.preemptions_by_priority.items()},
            "pages_cached": pool.pages_cached,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "requests": len(self.requests),
            "steps": self.step_count,
            **(self.speculator.stats() if self.speculator else Speculator.zero_stats()),
            **(self._lora_stats() if self.lora is not None else {}),
        }

    def _lora_stats(self) -> dict[str, int]:
        assert self.lora is not None
        running = {f"{LORA_RUNNING}{name}": n for name, n in self.lora.running().items()}
        return {"lora_swaps": self.lora.swaps, "lora_loads": self.lora.host.loads, **running}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from pipeserve.tokenizer.load import load_for

            self._tokenizer = load_for(replace(self.config, model=self.model_dir))[1]
        return self._tokenizer

    def model_info(self) -> dict[str, Any]:
        cfg = self.model_config
        return {
            "name": self.config.served_model_name or hub.display_name(self.config.model or cfg.name),
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
            "sampling_defaults": (
                generation_defaults(self.model_dir) if self.config.generation_config == "auto" else {}
            ),
        }
