"""The paged KV pool: per-layer K/V page tensors, the free-page list, reservations and the
persistent block table (one row per request slot, updated in place as pages are added).

With prefix caching, a page is reference-counted and a full computed page is content-addressed: its
hash (pipeserve/engine/kv/prefix.py) names its parent page's hash and its token ids, so a request
whose prompt starts with the same pages attaches them instead of recomputing them. A page no
request references keeps its hash and stays findable until the pool needs it: free pages are first
the never-hashed ones, then the hashed ones least recently released first."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pipeserve.engine.host_memory import huge_page_tensors
from pipeserve.engine.quantization.kv_cache import K_SMOOTHED, KV_QUANT_DTYPES, scale_group
from pipeserve.engine.sequence import PENDING, Sequence
from pipeserve.model_config import ModelConfig

from .prefix import page_hash, root_hash


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


def kv_bytes_per_page(cfg: ModelConfig, dtype: torch.dtype, page_size: int, kv_cache_dtype: str = "auto",
                      prefix_caching: bool = False) -> int:
    """A page's K/V bytes; with prefix caching a key-smoothed cache also keeps one mean-key row per
    page (KVPool._allocate)."""
    per_page = kv_bytes_per_token(cfg, dtype, kv_cache_dtype) * page_size
    if prefix_caching and kv_cache_dtype in K_SMOOTHED:
        per_page += cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return per_page


@dataclass
class PoolStats:
    pages_total: int
    pages_used: int
    pages_reserved: int  # promised to running requests but not yet allocated
    pages_free: int
    pages_cached: int  # of the free pages, those still findable by their hash


class KVPool:
    def __init__(self, cfg: ModelConfig | None, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, max_num_seqs: int, max_model_len: int,
                 kv_cache_dtype: str = "auto", prefix_caching: bool = False) -> None:
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page; raise kv_cache_gb")
        self.num_pages, self.page_size = num_pages, page_size
        self.kv_cache_dtype = kv_cache_dtype
        self.prefix_caching = prefix_caching
        self.kv: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.k_means: torch.Tensor | None = None
        self.seq_of_page: torch.Tensor | None = None
        self.layers: list[LayerCache] = []
        if cfg is not None:  # None: accounting only (see accounting_only)
            self._allocate(cfg, dtype, device, max_num_seqs)
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.block_table = np.zeros((max_num_seqs, self.max_pages_per_seq), dtype=np.int32)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # unhashed free pages: a stack
        self.promised = 0  # sum over running requests of reserved - allocated pages
        # Prefix caching: references per page, the hash of each full computed page that is findable,
        # the reverse map, and the free pages that keep a hash (least recently released first).
        self.refs = np.zeros(num_pages, dtype=np.int32)
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()

    @classmethod
    def accounting_only(cls, num_pages: int, page_size: int, max_num_seqs: int, max_model_len: int,
                        prefix_caching: bool = False) -> KVPool:
        """Pages, promises and block tables without K/V tensors: the serving simulator drives the real
        allocator for an 8B model's pool without holding its gigabytes."""
        cpu = torch.device("cpu")
        return cls(None, num_pages, page_size, torch.float32, cpu, max_num_seqs, max_model_len,
                   prefix_caching=prefix_caching)

    def _allocate(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                  max_num_seqs: int) -> None:
        shape = (cfg.num_layers, 2, self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)
        storage = KV_QUANT_DTYPES.get(self.kv_cache_dtype, dtype)
        if device.type == "cpu":  # every decode step streams the pages it reads: huge pages (host_memory)
            self.kv = huge_page_tensors([(math.prod(shape), storage)])[0].view(shape)
            self.kv.zero_()  # commit the pool's memory now, as torch.zeros does, not in a step
        else:
            self.kv = torch.zeros(shape, dtype=storage, device=device)
        if self.kv_cache_dtype != "auto":
            scale_shape = (*shape[:-1], cfg.head_dim // scale_group(cfg.head_dim))
            self.scales = torch.zeros(scale_shape, dtype=torch.float16, device=device)
        if self.kv_cache_dtype in K_SMOOTHED:
            # Per request slot, the mean key its keys are stored less of; the slot of a request is found
            # from its first page (the one block-table entry every attention row has), so the map is
            # written once per admission and never read for later pages. With prefix caching the mean
            # belongs to the first page instead (one row per page): a request that attaches cached pages
            # reads the mean they were written with, and it outlives the slot of the request that set it.
            rows = self.num_pages if self.prefix_caching else max_num_seqs
            self.k_means = torch.zeros(cfg.num_layers, rows, cfg.num_kv_heads,
                                       cfg.head_dim, dtype=dtype, device=device)
            self.seq_of_page = torch.zeros(self.num_pages, dtype=torch.int32, device=device)
        self.layers = self.layer_views()

    def layer_views(self) -> list[LayerCache]:
        """Every layer's views of the pool's tensors. A compiled step builds them inside its graph,
        so the compiler sees one mutated base tensor instead of a view per layer."""
        kv, scales, k_means = self.kv, self.scales, self.k_means
        assert kv is not None
        return [
            LayerCache(kv[i, 0], kv[i, 1],
                       None if scales is None else scales[i, 0],
                       None if scales is None else scales[i, 1],
                       None if k_means is None else k_means[i], self.seq_of_page)
            for i in range(kv.shape[0])
        ]

    # -- accounting -------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free(self) -> int:
        """Pages no request references (cached ones included: they are taken back on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def available(self) -> int:
        """Pages neither allocated nor promised: what admission and overflow growth may take."""
        return self.num_free - self.promised

    def stats(self) -> PoolStats:
        free = self.num_free
        return PoolStats(self.num_pages, self.num_pages - free, self.promised, free, len(self._cached))

    def _take(self) -> int:
        """A page for new K/V: a never-hashed free page, else the least recently released cached one
        (which stops being findable)."""
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached.popitem(last=False)
            del self.page_of[self.hash_of.pop(page)]
        self.refs[page] = 1
        return page

    def reserve_scratch_page(self) -> int:
        """Take one page out of circulation for good: compiled decode steps point their padding
        rows at it, so they never write a request's K/V."""
        page = self._take()
        self.num_pages -= 1  # what requests can ever hold
        return page

    # -- prefix caching ---------------------------------------------------------------------
    def root(self, seq: Sequence, first_chunk: int) -> bytes:
        """The hash `seq`'s page chain starts from, were its first prefill chunk `first_chunk` tokens."""
        return root_hash(seq.cache_salt, self.kv_cache_dtype, seq.token_ids[:first_chunk])

    def match(self, seq: Sequence, root: bytes) -> tuple[list[int], list[bytes]]:
        """The longest run of cached pages that starts `seq`'s tokens under `root` (whole pages, and
        never its last token, whose logits the request needs): their page ids and hashes."""
        pages: list[int] = []
        hashes: list[bytes] = []
        size, parent = self.page_size, root
        for i in range((seq.num_tokens - 1) // size):
            h = page_hash(parent, seq.token_ids[i * size : (i + 1) * size])
            page = self.page_of.get(h)
            if page is None:
                break
            pages.append(page)
            hashes.append(h)
            parent = h
        return pages, hashes

    def cost(self, pages: list[int], num_pages: int) -> int:
        """Free pages an admission of `num_pages` in total takes when `pages` are attached: the cached
        free ones and the new ones; pages other requests hold cost nothing."""
        return num_pages - int(np.count_nonzero(self.refs[pages])) if pages else num_pages

    def attach(self, seq: Sequence, root: bytes, pages: list[int], hashes: list[bytes]) -> None:
        """Start `seq` (holding no pages) on the matched cached pages; their K/V count as computed."""
        assert not seq.pages
        for page in pages:
            if self.refs[page] == 0:
                del self._cached[page]
            self.refs[page] += 1
        seq.pages = list(pages)
        seq.hash_root, seq.page_hashes = root, list(hashes)
        self.block_table[seq.slot, : len(pages)] = pages
        seq.num_computed = len(pages) * self.page_size

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Make findable the pages `seq` fills up to `num_computed` tokens (when scheduling the step
        that writes them). A page whose hash another page already holds stays private."""
        size = self.page_size
        if seq.token_ids and seq.token_ids[-1] == PENDING:  # hashed once its token is read (next step)
            num_computed = min(num_computed, seq.num_tokens - 1)
        for i in range(len(seq.page_hashes), num_computed // size):
            parent = seq.page_hashes[-1] if seq.page_hashes else seq.hash_root
            h = page_hash(parent, seq.token_ids[i * size : (i + 1) * size])
            seq.page_hashes.append(h)
            if h not in self.page_of:
                page = seq.pages[i]
                self.page_of[h], self.hash_of[page] = page, h

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
        new = [self._take() for _ in range(need)]
        seq.pages.extend(new)
        self.block_table[seq.slot, start : start + need] = new
        if start == 0 and self.seq_of_page is not None:
            # The mean-key row of the request: its slot's, or with prefix caching its first page's.
            row = new[0] if self.prefix_caching else seq.slot
            self.seq_of_page[new[0]] = row  # a scalar fill: no host-device sync
        return True

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the pages past `num_tokens` tokens (a rejected speculation's) to the request's
        promise. They were never hashed: commit publishes real tokens only."""
        keep = max(self.pages_for(num_tokens), 1)
        if len(seq.pages) <= keep:
            return
        for page in seq.pages[keep:]:
            assert page not in self.hash_of and self.refs[page] == 1
            self.refs[page] = 0
            self._free.append(page)
        self.promised += len(seq.pages) - keep
        del seq.pages[keep:]

    def release(self, seq: Sequence) -> None:
        """Drop every page reference and promise of a request (finish, abort or preemption). Pages no
        request references any more are free; hashed ones stay findable, queued for eviction tail
        first, so a sequence's head outlives its tail."""
        self.promised -= seq.reserved_pages - len(seq.pages)
        for page in reversed(seq.pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)
        seq.pages = []
        seq.page_hashes = []
        seq.reserved_pages = 0
