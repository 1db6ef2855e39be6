"""The one choice of how steps run, made once at engine start from the config and the backend's
declared capabilities, and logged in one line."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipeserve.engine.backend import Backend, native
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.lora.rows import LoRAContext
from pipeserve.engine.model.llama import LlamaForCausalLM

from .base import CUDA_GRAPH, EAGER, INDUCTOR, NATIVE, StepExecutor
from .buffers import StepBuffers
from .cuda_graph import CudaGraphStep
from .eager import EagerStep
from .inductor import InductorStep
from .native import NativeExecutor, unsupported

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What the choice needs besides the model: the request (EngineConfig.step_executor), and the
    sizes of the steps the engine makes."""

    requested: str  # auto | eager | compiled | native
    max_rows: int  # the most rows of a decode step (each request's verification rows included)
    exact: tuple[int, ...] = ()  # row counts that get a compiled bucket of their own
    whole_graph: bool = True  # the forward pass traces as one graph (Inductor)
    max_cuda_graph_batch: int = 256
    tensor_parallel: bool = False  # a tensor-parallel forward exchanges the step plan: eager


def compiled_mode(backend: Backend, device: torch.device) -> tuple[str | None, str]:
    """The compiled executor the backend offers on this device, or None and why not."""
    mode = backend.compiled_step_on(device.type)
    if mode is None:
        return None, f"the {backend.name} backend compiles no steps on {device.type}"
    if mode == INDUCTOR and native.compiler() is None:  # Inductor builds C++ with it
        return None, "no C++ compiler (g++, or $CXX) on this host"
    return mode, ""


def _native_why(model: LlamaForCausalLM) -> str:
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    return f"dense {dtype} {model.config.architecture}, {torch.get_num_threads()} threads"


def choose(plan: StepPlan, backend: Backend, model: LlamaForCausalLM, pool: KVPool,
           device: torch.device) -> tuple[str, str]:
    """(mode, why): the executor for this model, device and request. ValueError when an explicit
    request cannot be met."""
    if plan.requested == EAGER:
        return EAGER, "requested"
    if plan.tensor_parallel:
        if plan.requested != "auto":
            raise ValueError(f"--step-executor {plan.requested}: tensor-parallel steps run eager")
        return EAGER, "tensor-parallel steps send their plan to the other ranks"
    no_native = unsupported(model, pool) if device.type == "cpu" else f"not on {device.type}"
    compiled, no_compiled = compiled_mode(backend, device)
    if plan.requested == NATIVE:
        if no_native is not None:
            raise ValueError(f"--step-executor native: {no_native}")
        return NATIVE, "requested"
    if plan.requested == "compiled":
        if compiled is None:
            raise ValueError(f"--step-executor compiled: {no_compiled}")
        return compiled, "requested"
    if no_native is None:
        return NATIVE, _native_why(model)
    if compiled is not None:
        return compiled, f"native step: {no_native}"
    return EAGER, no_compiled


def select_executor(plan: StepPlan, *, backend: Backend, model: LlamaForCausalLM, pool: KVPool,
                    buffers: StepBuffers, device: torch.device, role: str = "model",
                    lora: LoRAContext | None = None) -> StepExecutor:
    """The executor of the steps it covers (the rest run eager), its buckets compiled or captured
    by `prepare`. role names the model in the log line (model, draft); lora: the context of the
    model's LoRA layers, which every executor's steps apply (the native step reads each row's adapter
    slot itself, compiled steps take it as an input)."""
    mode, why = choose(plan, backend, model, pool, device)
    if lora is not None:
        why += ", LoRA adapters in the step"
    executor: StepExecutor
    if mode == NATIVE:
        executor = NativeExecutor(model=model, pool=pool, buffers=buffers, max_rows=plan.max_rows)
    elif mode == INDUCTOR:
        executor = InductorStep(model=model, pool=pool, buffers=buffers, max_rows=plan.max_rows,
                                exact=plan.exact, whole_graph=plan.whole_graph, lora=lora)
    elif mode == CUDA_GRAPH:
        executor = CudaGraphStep(model=model, pool=pool, buffers=buffers, max_rows=plan.max_rows,
                                 max_batch=plan.max_cuda_graph_batch, exact=plan.exact, lora=lora)
    else:
        executor = EagerStep(model=model, pool=pool, buffers=buffers, max_rows=plan.max_rows)
    rows = "" if mode == EAGER else f"; steps of up to {executor.max_rows} rows, larger ones eager"
    if isinstance(executor, NativeExecutor) and executor.gemm_rows is not None:
        rows += f" (from {executor.gemm_rows} rows oneDNN's GEMM wins, per the measured table)"
    log.info("step (%s): %s (%s%s)", role, mode, why, rows)
    return executor
