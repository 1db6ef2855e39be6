"""How much memory the KV pool gets.

On CUDA (as vLLM): the engine may use `gpu_memory_utilization` of the device's TOTAL memory. Out of
that come the weights, the activation peak of the largest step, and what is not torch's (the CUDA
context, NCCL, other processes on the GPU); the KV pool gets the rest. The activation peak is
measured, not estimated: with the allocator's cache emptied, a profile run of the largest step (a
decode batch of the most rows a step can have, and a full prefill chunk of max_num_batched_tokens
tokens, each with its logits and a softmax over them) on a throwaway pool, under the allocator's
peak statistics; what the engine allocates after the pool for good (the LoRA slot table, `reserved`,
its size computed beforehand) comes out of that share too. On the CPU the pool keeps its fixed size
(`kv_cache_gb`, else CPU_KV_GB), the slot table in host memory beside it. Either way one line says
what went where.

The arithmetic is pure (kv_bytes_cuda, MemoryPlan) and the profile step runs on any device, so the
CPU tests run the code the CUDA path runs."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pipeserve.config import EngineConfig
from pipeserve.engine.kv.metadata import AttentionMetadata
from pipeserve.engine.kv.pool import KVPool
from pipeserve.engine.model.llama import LlamaForCausalLM
from pipeserve.startup import StartupError

CPU_KV_GB = 0.25
GiB = 2**30


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GB" if n >= GiB // 10 else f"{n / 2**20:.1f} MB"


def kv_bytes_cuda(total: int, utilization: float, weights: int, activation_peak: int, non_torch: int) -> int:
    """Bytes the KV pool may take on a device of `total` bytes: its share of the device, less the
    weights, the activation peak and the memory torch does not manage (never negative)."""
    return max(0, int(total * utilization) - weights - activation_peak - non_torch)


@dataclass(frozen=True)
class MemoryPlan:
    """Where the engine's memory went, for the one start-up line."""

    weights: int  # bytes of every weight (the draft model's too)
    activation_peak: int | None  # the profiled step's peak; None where not profiled
    kv: int  # bytes of the KV pool as allocated (pages x bytes per page)
    num_pages: int
    page_size: int
    max_model_len: int
    not_profiled: str = ""  # why the activation peak was not measured
    lora_table: int = 0  # the LoRA slot table's bytes (allocated after the pool, out of its budget)

    @property
    def max_concurrent_seqs(self) -> int:
        """How many sequences of max_model_len tokens the pool holds at once."""
        return self.num_pages // math.ceil(self.max_model_len / self.page_size)

    def line(self) -> str:
        act = (_size(self.activation_peak) if self.activation_peak is not None
               else f"not profiled ({self.not_profiled})")
        lora = f"LoRA slot table {_size(self.lora_table)}, " if self.lora_table else ""
        return (f"memory: weights {_size(self.weights)}, activation peak {act}, {lora}"
                f"KV {_size(self.kv)} = {self.num_pages} pages of {self.page_size} tokens, "
                f"at most {self.max_concurrent_seqs} concurrent sequences of {self.max_model_len} tokens")


class MemoryProbe(Protocol):
    """What sizing reads from a device's allocator (CudaProbe on CUDA; tests pass fake numbers)."""

    def total(self) -> int: ...
    def allocated(self) -> int: ...
    def non_torch(self) -> int: ...
    def peak(self, step: Callable[[], None]) -> int: ...


class CudaProbe:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def non_torch(self) -> int:
        """In use on the device but not by torch's allocator (the CUDA context, NCCL, other
        processes), with the allocator's cache emptied first: cached blocks are torch's."""
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, int(total - free - torch.cuda.memory_reserved(self.device)))

    def peak(self, step: Callable[[], None]) -> int:
        """Bytes the allocator's peak rose by while `step` ran, above what was allocated before."""
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        step()
        torch.cuda.synchronize(self.device)
        peak = int(torch.cuda.max_memory_allocated(self.device) - base)
        gc.collect()
        torch.cuda.empty_cache()  # the profile's blocks go back before the pool is allocated
        return peak


def device_probe(device: torch.device) -> MemoryProbe | None:
    """The allocator sizing reads on this device: CUDA's; None where the pool has a fixed size."""
    return CudaProbe(device) if device.type == "cuda" else None


def kv_budget(config: EngineConfig, probe: MemoryProbe | None,
              profile: Callable[[], None] | None, reserved: int = 0) -> tuple[int, int | None, str]:
    """(bytes for the KV pool, the profiled activation peak or None, why it was not profiled).
    probe: the device's allocator (None on the CPU); profile: the largest step (None where it cannot
    run alone, as on a tensor-parallel rank, whose forward is a collective of the group); reserved:
    bytes the engine allocates after the pool, for good (the LoRA slot table)."""
    if config.num_pages is not None:  # the pool's size in pages: no budget to work out
        return 0, None, "--num-pages given"
    if config.kv_cache_gb is not None:
        return int(config.kv_cache_gb * GiB), None, "--kv-cache-gb given"
    if probe is None:
        return int(CPU_KV_GB * GiB), None, f"CPU: a fixed {CPU_KV_GB} GB pool unless --kv-cache-gb"
    peak = None if profile is None else probe.peak(profile)
    # Everything allocated so far (weights, RoPE tables, a draft model) is the engine's for good, and
    # so is what is allocated after the pool.
    total, weights, other = probe.total(), probe.allocated() + reserved, probe.non_torch()
    kv = kv_bytes_cuda(total, config.gpu_memory_utilization, weights, peak or 0, other)
    if kv == 0:
        lora = " with the LoRA slot table" if reserved else ""
        raise StartupError(
            f"no GPU memory left for the KV cache: --gpu-memory-utilization {config.gpu_memory_utilization} "
            f"of {_size(total)} is {_size(int(total * config.gpu_memory_utilization))}, and the weights "
            f"({_size(weights)}{lora}), the largest step's activations ({_size(peak or 0)}) and memory "
            f"outside this engine's allocator ({_size(other)}: the CUDA context, other processes on this "
            "GPU) take it all: free the GPU, raise --gpu-memory-utilization, or size the pool with "
            "--kv-cache-gb / --num-pages")
    return kv, peak, "" if profile is not None else "tensor parallel"


def profile_step(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype, page_size: int,
                 kv_cache_dtype: str, max_model_len: int, max_batched_tokens: int, decode_rows: int) -> None:
    """Run the largest steps the engine can take, eagerly, on a throwaway KV pool just large enough:
    a decode step of `decode_rows` rows and a prefill of `max_batched_tokens` tokens (in chunks of
    at most max_model_len), each with its logits and a softmax over them (the sampler's share)."""
    chunk = min(max_batched_tokens, max_model_len)
    full, rest = divmod(max_batched_tokens, chunk)
    lens = [chunk] * full + ([rest] if rest else [])
    pages_per_chunk = math.ceil(chunk / page_size)
    num_pages = max(decode_rows, len(lens) * pages_per_chunk)
    pool = KVPool(model.config, num_pages, page_size, dtype, device, 1, max_model_len, kv_cache_dtype)

    def tensor(values: np.ndarray, kind: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(values.copy()).to(device=device, dtype=kind)  # plain strides, owned

    # Prefill: sequence i holds pages i * pages_per_chunk onward, its tokens in order from position 0.
    seq_lens = np.asarray(lens, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(seq_lens)])
    seq_of_row = np.repeat(np.arange(len(lens)), seq_lens)
    positions = np.arange(max_batched_tokens) - cu[:-1][seq_of_row]
    slots = seq_of_row * pages_per_chunk * page_size + positions
    tables = np.arange(len(lens) * pages_per_chunk, dtype=np.int32).reshape(len(lens), pages_per_chunk)
    no_rows = np.zeros((0, pages_per_chunk), dtype=np.int32)
    prefill = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64), num_decode=0,
        decode_block_tables=tensor(no_rows, torch.int32), decode_seq_lens=tensor(no_rows[:, 0], torch.int32),
        prefill_block_tables=tensor(tables, torch.int32), prefill_cu_q_lens=tensor(cu, torch.int32),
        prefill_seq_lens=tensor(seq_lens, torch.int32), prefill_max_q_len=chunk, prefill_max_seq_len=chunk,
        sample_rows=tensor(cu[1:] - 1, torch.int64), sample_block_tables=tensor(tables, torch.int32),
        sample_seq_lens=tensor(seq_lens, torch.int32), sample_max_seq_len=chunk,
    )
    _run(model, tensor(positions % model.config.vocab_size, torch.int64), tensor(positions, torch.int64),
         prefill, pool)
    # Decode: row i is a sequence of one token in page i.
    rows = np.arange(decode_rows)
    decode = AttentionMetadata(
        slot_mapping=tensor(rows * page_size, torch.int64), num_decode=decode_rows,
        decode_block_tables=tensor(rows.astype(np.int32)[:, None], torch.int32),
        decode_seq_lens=tensor(np.ones(decode_rows, np.int32), torch.int32),
        prefill_block_tables=tensor(no_rows[:, :1], torch.int32),
        prefill_cu_q_lens=tensor(np.zeros(1, np.int32), torch.int32),
        prefill_seq_lens=tensor(np.zeros(0, np.int32), torch.int32),
        prefill_max_q_len=0, prefill_max_seq_len=0, decode_max_seq_len=1,
    )
    _run(model, tensor(rows % model.config.vocab_size, torch.int64), tensor(np.zeros(decode_rows, np.int64),
                                                                            torch.int64), decode, pool)


def _run(model: LlamaForCausalLM, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
         pool: KVPool) -> None:
    with torch.inference_mode():
        hidden = model(ids, positions, meta, pool.layers)
        model.compute_logits(hidden).softmax(-1)
