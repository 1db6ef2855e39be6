"""The persistent device buffers a step's inputs are copied into, and the one way results come back.

Buffers are allocated once at their largest and refilled in place every step (a captured CUDA graph
reads them at fixed addresses). On CUDA, host arrays go through pinned staging with non-blocking
copies, two sets used in turns (pipeserve/engine/staging.py: a step never rewrites host memory that
the last step's copies may still be reading); on the CPU they are written in place. Results reach
the host only through `read` (or `read_later`, which lets the host go on until it waits), which counts
its blocking readbacks: the steady-state step makes one (tests assert it on the CPU too).
"""

from __future__ import annotations

import numpy as np
import torch

from pipeserve.engine.staging import Turns

from .flat import DeviceIds


class StepBuffers:
    def __init__(self, *, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 device: torch.device) -> None:
        """shapes: each buffer's dtype and largest shape."""
        self.device = device
        self.buf = {name: torch.zeros(shape, dtype=dtype, device=device)
                    for name, (dtype, shape) in shapes.items()}
        # Pinned host staging for asynchronous uploads on CUDA; on the CPU the buffers are written
        # directly (elsewhere, copied with a blocking copy).
        self.staging: Turns[dict[str, torch.Tensor]] | None = None
        if device.type == "cuda":
            self.staging = Turns([{name: torch.zeros_like(b, device="cpu", pin_memory=True)
                                   for name, b in self.buf.items()} for _ in range(2)], torch.cuda.Event)
        self.readbacks = 0  # blocking device-to-host reads so far

    def begin(self) -> None:
        """A step starts: its uploads are staged in the other set of host buffers."""
        if self.staging is not None:
            self.staging.next()

    def stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Copy a host array into the persistent device buffer `name`; return the filled prefix,
        contiguous in the array's shape."""
        n = array.size
        dev = self.buf[name].view(-1)[:n].view(array.shape)
        if self.device.type == "cpu":  # host memory already: write in place
            dev.numpy()[...] = array
            return dev
        if self.staging is None:
            dev.copy_(torch.from_numpy(np.ascontiguousarray(array)))
            return dev
        host = self.staging.current[name].view(-1)[:n].view(array.shape)
        host.numpy()[...] = array
        dev.copy_(host, non_blocking=True)
        return dev

    def stage_ids(self, name: str, ids: np.ndarray, patch: DeviceIds | None) -> torch.Tensor:
        """stage(name, ids), then the rows whose ids live on the device written from there (a
        device-to-device copy: nothing waits)."""
        dev = self.stage(name, ids)
        if patch is not None and patch.rows.size:
            dev.index_copy_(0, self.host_or_stage("patch_rows", patch.rows), patch.values)
        return dev

    def host_or_stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """The array as a tensor on the device: on the CPU the array itself (no copy)."""
        return torch.from_numpy(array) if self.device.type == "cpu" else self.stage(name, array)

    def read(self, *tensors: torch.Tensor) -> list[np.ndarray]:
        """The tensors on the host, with one blocking wait for them all."""
        return self.read_later(*tensors).wait()

    def read_later(self, *tensors: torch.Tensor) -> PendingRead:
        """Start bringing the tensors to the host without waiting: on CUDA each is copied non-blocking
        into pinned memory and an event marks the copies' end; `wait()` on the result is the blocking
        readback (counted then). On the CPU the values are there already."""
        if self.device.type == "cpu":  # copies: a later step may reuse a tensor's memory before the wait
            return PendingRead(self, [t.detach().numpy().copy() for t in tensors], None)
        if self.device.type != "cuda":
            return PendingRead(self, [t.detach().cpu().numpy() for t in tensors], None)
        host = [t.detach().to("cpu", non_blocking=True) for t in tensors]
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        return PendingRead(self, [h.numpy() for h in host], done)


class PendingRead:
    """Values on their way to the host: readable once `wait()` returns."""

    def __init__(self, buffers: StepBuffers, arrays: list[np.ndarray], done: torch.cuda.Event | None) -> None:
        self.buffers, self.arrays, self.done = buffers, arrays, done

    def wait(self) -> list[np.ndarray]:
        """The step's blocking readback: waits for the copies (on CUDA, the stream up to them)."""
        self.buffers.readbacks += 1
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        return self.arrays


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without waiting for it: on CUDA through pinned memory with a
    non-blocking copy (a plain copy from pageable memory synchronizes the stream)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
