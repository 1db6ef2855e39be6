"""All configuration of pipeserve in one place: engine and gateway options, process addresses, and the
CLI flags derived from them."""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

ADMISSION_POLICIES = ("max", "optimistic", "predicted")
PREDICTOR_MODES = ("peak", "reserve")
BACKENDS = ("reference", "cpu", "torch", "triton")  # torch: the cpu backend's former name
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("none", "w8a8-int8", "w8a8-fp8", "w4a16", "nf4")

# An abort overtakes its add by the tokenizers' queueing (milliseconds), so the engine process keeps
# an abort for an id it has not seen (a tombstone) this long, then drops it as stale (e.g. an abort
# queued for a dead engine's request), so that it cannot end a later request reusing the id.
TOMBSTONE_TTL = 30.0
# The gateway keeps an aborted id reserved until the engine reports its finish, but at most this
# long. It must outlast any tombstone, or a reused id could meet its predecessor's tombstone.
ABORTED_HOLD = 2 * TOMBSTONE_TTL


@dataclass
class EngineConfig:
    """Options of one engine. Every field has a CLI flag of the same name (dashes for underscores)."""

    model: str | None = None  # HF checkpoint dir; None builds the random-weight demo model
    device: str = "auto"  # "auto" picks cuda when available
    dtype: str = "auto"  # auto: checkpoint dtype on CUDA, float32 on CPU
    backend: str = "auto"  # auto: triton on CUDA, cpu elsewhere
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    page_size: int = 16
    prefix_caching: bool = True  # reuse the KV of prompt prefixes already computed (exact; per cache_salt)
    kv_cache_gb: float | None = None  # None: a fraction of free GPU memory, or 0.25 GB on CPU
    gpu_memory_utilization: float = 0.9
    num_pages: int | None = None  # overrides kv_cache_gb (tests use tiny pools)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    admission: str = "optimistic"
    predictor_path: str | None = None  # where the `predicted` policy persists what it learned
    predictor_quantile: float = 0.9
    predictor_mode: str = "peak"  # peak: future-peak admission check; reserve: promise it in the pool
    seed: int = 0
    max_logprobs: int = 20
    # torch intra-op threads of the engine process. 0: on a CPU device all cores but one (the
    # tokenizers, detokenizer and gateway need CPU too, and a descheduled OpenMP thread stalls
    # every matmul); on CUDA torch's default.
    cpu_threads: int = 0

    def __post_init__(self) -> None:
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}")
        if self.backend not in (*BACKENDS, "auto"):
            raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {self.backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.predictor_mode not in PREDICTOR_MODES:
            raise ValueError(f"predictor_mode must be one of {PREDICTOR_MODES}, got {self.predictor_mode!r}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0, got {self.cpu_threads}")


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@dataclass
class Addresses:
    """ZeroMQ endpoints. Binders: gateway (tokenize, deltas, errors, status) and engine (requests,
    control) and detokenizer (steps). Connectors: everything else. Env vars let compose wire them.

    `errors` carries only per-request failures (RequestError); `status` carries liveness and process
    state (the engine's EngineInfo heartbeats, the supervisor's ProcessStatus)."""

    tokenize: str = field(default_factory=lambda: _env("PIPESERVE_TOKENIZE_ADDR", "ipc:///tmp/pipeserve/tokenize"))
    requests: str = field(default_factory=lambda: _env("PIPESERVE_REQUESTS_ADDR", "ipc:///tmp/pipeserve/requests"))
    control: str = field(default_factory=lambda: _env("PIPESERVE_CONTROL_ADDR", "ipc:///tmp/pipeserve/control"))
    steps: str = field(default_factory=lambda: _env("PIPESERVE_STEPS_ADDR", "ipc:///tmp/pipeserve/steps"))
    deltas: str = field(default_factory=lambda: _env("PIPESERVE_DELTAS_ADDR", "ipc:///tmp/pipeserve/deltas"))
    errors: str = field(default_factory=lambda: _env("PIPESERVE_ERRORS_ADDR", "ipc:///tmp/pipeserve/errors"))
    status: str = field(default_factory=lambda: _env("PIPESERVE_STATUS_ADDR", "ipc:///tmp/pipeserve/status"))

    @classmethod
    def under(cls, directory: str) -> Addresses:
        """ipc:// endpoints inside one directory (local mode: nothing listens beyond the host)."""
        return cls(**{name: f"ipc://{directory}/{name}" for name in cls.__dataclass_fields__})

    def to_env(self) -> dict[str, str]:
        """The env vars that make a child process's Addresses() equal these."""
        return {f"PIPESERVE_{name.upper()}_ADDR": getattr(self, name) for name in self.__dataclass_fields__}


@dataclass
class GatewayConfig:
    """Options of the gRPC gateway (`pipeserve gateway`, and passed through by `pipeserve up`)."""

    host: str = "127.0.0.1"
    port: int = 50051
    max_inflight: int = 4096  # admission limit: more concurrent streams get RESOURCE_EXHAUSTED
    max_request_bytes: int = 4 * 1024 * 1024  # larger requests get INVALID_ARGUMENT
    max_response_bytes: int = 1024 * 1024  # a coalesced response is cut at about this size
    liveness_timeout: float = 10.0  # no heartbeat for this long: NOT_SERVING, streams end UNAVAILABLE
    grace: float = 10.0  # on SIGTERM, in-flight streams get this long to finish
    metrics_port: int | None = None  # Prometheus /metrics on this port (None: off)
    api_key: str | None = None  # when set, calls need "authorization: Bearer <key>" (health is exempt)
    tls_cert: str | None = None  # PEM files: serve gRPC over TLS instead of plaintext
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or self.max_request_bytes < 1024 or self.max_response_bytes < 1024:
            raise ValueError("max_inflight must be >= 1, max_request_bytes and max_response_bytes >= 1024")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field (`--page-size`, `--tokenize`). Flags default to None, so
    from_args() leaves unset fields to the dataclass (and its env defaults)."""
    group = parser.add_argument_group(cls.__name__)
    for f, hint in _field_hints(cls):
        flag = f"--{f.name.replace('_', '-')}"
        default = f.default_factory() if f.default is MISSING else f.default
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        how: dict[str, Any] = ({"action": argparse.BooleanOptionalAction} if kind is bool
                               else {"type": kind, "metavar": kind.__name__.upper()})
        group.add_argument(flag, default=None, help=f"default {default}", **how)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    values = {f.name: getattr(args, f.name) for f, _ in _field_hints(cls)}
    return cls(**{name: value for name, value in values.items() if value is not None})


def to_argv(obj: Any) -> list[str]:
    """The flags that reproduce obj's non-default fields in a child process."""
    argv = []
    for f, _ in _field_hints(type(obj)):
        value = getattr(obj, f.name)
        if f.default is not MISSING and value == f.default or value is None:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        argv += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return argv


def _field_hints(cls: type) -> list[tuple[Any, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in fields(cls)]
