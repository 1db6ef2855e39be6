"""Values the CPU backend derives from its inputs once per step and reuses in every layer.

Each layer gets the same per-step tensors (positions, block tables, lengths), so masks, page
indices and rope rows built from them are the same in all layers (and a rope cache's table the
same in every step): a memo of one entry holds the last ones. Its key is the input tensors
themselves, held so that a later tensor can never take a freed one's id, plus their version
counters, so an in-place write through torch makes a new key. Inference tensors keep no version
counter: with one among the inputs nothing is memoized.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from typing import Any

import torch


class StepMemo:
    def __init__(self) -> None:
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._key: tuple[Hashable, ...] = ()
        self._value: Any = None

    def get(self, tensors: tuple[torch.Tensor, ...], extra: Hashable, build: Callable[[], Any]) -> Any:
        if any(t.is_inference() for t in tensors):
            return build()
        key = (tuple(t._version for t in tensors), extra)
        same = len(tensors) == len(self._tensors) and all(map(operator.is_, tensors, self._tensors))
        if not (same and key == self._key):
            self._tensors, self._key, self._value = tensors, key, build()
        return self._value
