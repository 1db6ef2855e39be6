"""All configuration of pipeserve in one place: engine options and process addresses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ADMISSION_POLICIES = ("max", "optimistic", "predicted")
BACKENDS = ("torch", "triton")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("none", "w8a8-int8", "w8a8-fp8", "w4a16", "nf4")


@dataclass
class EngineConfig:
    """Options of one engine. Every field has a CLI flag of the same name (dashes for underscores)."""

    model: str | None = None  # HF checkpoint dir; None builds the random-weight demo model
    device: str = "auto"  # "auto" picks cuda when available
    dtype: str = "auto"  # auto: checkpoint dtype on CUDA, float32 on CPU
    backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    page_size: int = 16
    kv_cache_gb: float | None = None  # None: a fraction of free GPU memory, or 0.25 GB on CPU
    gpu_memory_utilization: float = 0.9
    num_pages: int | None = None  # overrides kv_cache_gb (tests use tiny pools)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    admission: str = "optimistic"
    predictor_path: str | None = None  # where the `predicted` policy persists what it learned
    predictor_quantile: float = 0.9
    seed: int = 0
    max_logprobs: int = 20

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


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@dataclass
class Addresses:
    """ZeroMQ endpoints. Binders: gateway (tokenize, deltas, errors) and engine (requests, control)
    and detokenizer (steps). Connectors: everything else. Env vars let compose wire them."""

    tokenize: str = field(default_factory=lambda: _env("PIPESERVE_TOKENIZE_ADDR", "ipc:///tmp/pipeserve/tokenize"))
    requests: str = field(default_factory=lambda: _env("PIPESERVE_REQUESTS_ADDR", "ipc:///tmp/pipeserve/requests"))
    control: str = field(default_factory=lambda: _env("PIPESERVE_CONTROL_ADDR", "ipc:///tmp/pipeserve/control"))
    steps: str = field(default_factory=lambda: _env("PIPESERVE_STEPS_ADDR", "ipc:///tmp/pipeserve/steps"))
    deltas: str = field(default_factory=lambda: _env("PIPESERVE_DELTAS_ADDR", "ipc:///tmp/pipeserve/deltas"))
    errors: str = field(default_factory=lambda: _env("PIPESERVE_ERRORS_ADDR", "ipc:///tmp/pipeserve/errors"))

    @classmethod
    def under(cls, directory: str) -> Addresses:
        """ipc:// endpoints inside one directory (local mode: nothing listens beyond the host)."""
        return cls(**{name: f"ipc://{directory}/{name}" for name in cls.__dataclass_fields__})
