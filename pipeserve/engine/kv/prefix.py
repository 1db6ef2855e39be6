"""Content addresses of KV pages for prefix caching.

A full page's hash names everything its K/V depend on: its parent page's hash (so the whole token
prefix and its positions), its own token ids, and, through the root every chain starts from, the
request's cache salt (tenants with different salts never share a page) and the KV cache dtype. The
int8/fp8 caches store keys less a per-sequence mean key that the sequence's first prefill chunk sets
(quant.key_means); there the root also names that chunk's tokens, so a page is only shared with a
request whose own first chunk, and therefore mean, would be the same: the shared page is what it
would have written itself. blake2b with a 16-byte digest: collision resistant, unlike Python's hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from pipeserve.engine.quantization.kv_cache import K_SMOOTHED

DIGEST_BYTES = 16


def _ids(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def root_hash(cache_salt: str, kv_cache_dtype: str, first_chunk: Sequence[int]) -> bytes:
    """The hash every page chain of a request starts from. first_chunk: the tokens of the request's
    first prefill chunk (used only by the key-smoothed caches)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"pipeserve-kv")
    salt = cache_salt.encode()
    h.update(kv_cache_dtype.encode() + b"\0" + len(salt).to_bytes(8, "little") + salt)
    if kv_cache_dtype in K_SMOOTHED:
        h.update(_ids(first_chunk))
    return h.digest()


def page_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full page: its parent's hash (or the root) and its token ids."""
    return hashlib.blake2b(parent + _ids(token_ids), digest_size=DIGEST_BYTES).digest()
