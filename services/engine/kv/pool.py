"""The paged KV pool: per-layer K/V page tensors, the free-page list, reservations and the
persistent block table (one row per request slot, updated in place as pages are added)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.sequence import Sequence
from services.model_config import ModelConfig

from .quant import K_SMOOTHED, KV_QUANT_DTYPES, scale_group


@dataclass
class LayerCache:
    """One layer's view of the pool (scales only for quantized caches; with k_means [max_num_seqs,
    Hkv, D] and seq_of_page [P], keys are stored less their sequence's mean: quant.key_means)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_means: torch.Tensor | None = None
    seq_of_page: torch.Tensor | None = None

    def scale_kwargs(self) -> dict[str, torch.Tensor]:
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    elems = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    if kv_cache_dtype == "auto":
        return elems * dtype.itemsize
    return elems + elems // scale_group(cfg.head_dim) * 2  # 1 byte + fp16 scale per group


@dataclass
class PoolStats:
    pages_total: int
    pages_used: int
    pages_reserved: int  # promised to running requests but not yet allocated
    pages_free: int


class KVPool:
    def __init__(self, cfg: ModelConfig | None, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, max_num_seqs: int, max_model_len: int,
                 kv_cache_dtype: str = "auto") -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page; raise kv_cache_gb")
        self.num_pages, self.page_size = num_pages, page_size
        self.kv_cache_dtype = kv_cache_dtype
        self.kv: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.k_means: torch.Tensor | None = None
        self.seq_of_page: torch.Tensor | None = None
        self.layers: list[LayerCache] = []
        if cfg is not None:  # None: accounting only (see accounting_only)
            self._allocate(cfg, dtype, device, max_num_seqs)
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.block_table = np.zeros((max_num_seqs, self.max_pages_per_seq), dtype=np.int32)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() is O(1)
        self.promised = 0  # sum over running requests of reserved - allocated pages

    @classmethod
    def accounting_only(cls, num_pages: int, page_size: int, max_num_seqs: int, max_model_len: int) -> KVPool:
        """Pages, promises and block tables without K/V tensors: the serving simulator drives the real
        allocator for an 8B model's pool without holding its gigabytes."""
        cpu = torch.device("cpu")
        return cls(None, num_pages, page_size, torch.float32, cpu, max_num_seqs, max_model_len)

    def _allocate(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  max_num_seqs: int) -> None:
        shape = (cfg.num_layers, 2, self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)
        storage = KV_QUANT_DTYPES.get(self.kv_cache_dtype, dtype)
        self.kv = kv = torch.zeros(shape, dtype=storage, device=device)
        scales = k_means = None
        if self.kv_cache_dtype != "auto":
            scale_shape = (*shape[:-1], cfg.head_dim // scale_group(cfg.head_dim))
            self.scales = scales = torch.zeros(scale_shape, dtype=torch.float16, device=device)
        if self.kv_cache_dtype in K_SMOOTHED:
            # Per request slot, the mean key its keys are stored less of; the slot of a request is found
            # from its first page (the one block-table entry every attention row has), so the map is
            # written once per admission and never read for later pages.
            self.k_means = k_means = torch.zeros(cfg.num_layers, max_num_seqs, cfg.num_kv_heads,
                                                 cfg.head_dim, dtype=dtype, device=device)
            self.seq_of_page = torch.zeros(self.num_pages, dtype=torch.int32, device=device)
        self.layers = [
            LayerCache(kv[i, 0], kv[i, 1],
                       None if scales is None else scales[i, 0],
                       None if scales is None else scales[i, 1],
                       None if k_means is None else k_means[i], self.seq_of_page)
            for i in range(cfg.num_layers)
        ]

    # -- accounting -------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def available(self) -> int:
        """Pages neither allocated nor promised: what admission and overflow growth may take."""
        return len(self._free) - self.promised

    def stats(self) -> PoolStats:
        return PoolStats(self.num_pages, self.num_pages - len(self._free), self.promised, len(self._free))

    # -- per request ------------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_pages: int) -> None:
        """Promise `num_pages` in total to a request being admitted (caller checked `available`)."""
        seq.reserved_pages = max(num_pages, len(seq.pages))
        self.promised += seq.reserved_pages - len(seq.pages)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens; False (and nothing taken) if the pool cannot."""
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        from_promise = min(need, seq.reserved_pages - len(seq.pages))
        overflow = need - from_promise
        if overflow > self.available:
            return False
        self.promised -= from_promise
        seq.reserved_pages += overflow
        start = len(seq.pages)
        new = [self._free.pop() for _ in range(need)]
        seq.pages.extend(new)
        self.block_table[seq.slot, start : start + need] = new
        if start == 0 and self.seq_of_page is not None:
            self.seq_of_page[new[0]] = seq.slot  # a scalar fill: no host-device sync
        return True

    def release(self, seq: Sequence) -> None:
        """Return every page and promise of a request (finish, abort or preemption)."""
        self.promised -= seq.reserved_pages - len(seq.pages)
        self._free.extend(reversed(seq.pages))
        seq.pages = []
        seq.reserved_pages = 0
