"""All configuration of pipeserve in one place: engine and gateway options, process addresses, and the
CLI flags derived from them."""

from __future__ import annotations

import argparse
import json
import os
import re
import typing
import uuid
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from pipeserve.startup import StartupError

ADMISSION_POLICIES = ("max", "optimistic", "predicted")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREDICTOR_MODES = ("peak", "reserve")
BACKENDS = ("reference", "cpu", "triton")
BACKEND_ALIASES = {"torch": "cpu"}  # former names, still accepted on the command line and in LLM(...)
STEP_EXECUTORS = ("auto", "eager", "compiled", "native")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
QUANTIZATIONS = ("none", "w8a8-int8", "w8a8-fp8", "w4a16", "nf4")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
POOLING_MODES = ("last", "mean")

# The gateway keeps an aborted id reserved until the engine reports its finish (or its error), but at
# most this long (a request lost with a dead process never reports).
ABORTED_HOLD = 60.0


def opt(default: Any = None, help: str = "", *, choices: tuple[Any, ...] | None = None,
        factory: Callable[[], Any] | None = None) -> Any:
    """A config field with its CLI help (and choices): the one place a flag is described. A new
    field needs only `name: type = opt(default, "what it does")`; `--help` adds the default."""
    metadata = {"help": help, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class EngineConfig:
    """Options of one engine. Every field has a CLI flag of the same name (dashes for underscores)."""

    model: str | None = opt(None, "Hugging Face checkpoint: a local directory or a hub id (org/name); "
                            "unset: the random-weight demo model")
    device: str = opt("auto", "torch device; auto: cuda when available, else cpu")
    dtype: str = opt("auto", "weight and activation dtype; auto: the checkpoint's on CUDA, float32 on CPU",
                     choices=("auto", "float32", "float16", "bfloat16"))
    backend: str = opt("auto", "kernel backend; auto: triton on CUDA, cpu elsewhere (torch: cpu's former "
                       "name)", choices=("auto", "reference", "cpu", *BACKEND_ALIASES, "triton"))
    kv_cache_dtype: str = opt("auto", "KV cache storage: auto keeps the model dtype; int8/fp8 quantize it",
                              choices=KV_CACHE_DTYPES)
    quantization: str = opt("none", "weight quantization applied at load time", choices=QUANTIZATIONS)
    page_size: int = opt(16, "tokens per KV cache page")
    prefix_caching: bool = opt(True, "reuse the KV cache of prompt prefixes already computed (exact; "
                               "pages are shared only among requests with the same cache_salt)")
    kv_cache_gb: float | None = opt(None, "KV cache size in GB; unset: what --gpu-memory-utilization leaves "
                                    "after the weights and the profiled activation peak on CUDA, "
                                    "0.25 GB on CPU")
    gpu_memory_utilization: float = opt(0.9, "fraction of the GPU's TOTAL memory this engine may use: "
                                        "weights, activations and the KV cache (as vLLM)")
    load_format: str = opt("auto", "auto/safetensors: read the checkpoint's weights; dummy: random weights "
                           "made on the device (only config.json and a tokenizer needed)",
                           choices=LOAD_FORMATS)
    num_pages: int | None = opt(None, "KV cache pages, overriding --kv-cache-gb (tests use tiny pools)")
    max_num_seqs: int = opt(256, "most sequences running in one step")
    max_num_batched_tokens: int = opt(2048, "most tokens (prefill + decode) in one step")
    max_model_len: int | None = opt(None, "context length served, at most the model's (or what "
                                    "--rope-scaling scales it to); unset: the model's")
    rope_scaling: str | None = opt(None, "override the checkpoint's rope_scaling, as JSON: '{\"rope_type\": "
                                   "\"linear\", \"factor\": 4}' serves 4x the trained context "
                                   "(--max-model-len up to it); llama3 scaling states its context itself")
    scheduling_policy: str = opt("fcfs", "order of the waiting queue: fcfs (arrival) or priority (each "
                                 "request's priority, lower first, then arrival; running requests of a "
                                 "later priority are preempted when pages run short)",
                                 choices=SCHEDULING_POLICIES)
    admission: str = opt("optimistic", "KV admission policy: max reserves the whole budget, optimistic "
                         "admits while pages are free, predicted learns output lengths",
                         choices=ADMISSION_POLICIES)
    predictor_path: str | None = opt(None, "file where the predicted policy persists what it learned")
    predictor_quantile: float = opt(0.9, "predicted policy: the output-length quantile it plans for")
    predictor_mode: str = opt("peak", "predicted policy: peak checks the future peak at admission, "
                              "reserve promises it in the pool", choices=PREDICTOR_MODES)
    seed: int = opt(0, "seed of the engine's sampler for requests without their own")
    max_logprobs: int = opt(20, "most top logprobs a request may ask for")
    pooling: str = opt("last", "embeddings pool the final-norm hidden states: last takes the last "
                       "input token's, mean averages every input token's", choices=POOLING_MODES)
    embed_normalize: bool = opt(True, "embeddings (the pooled final hidden state) are L2-normalised; "
                                "--no-embed-normalize returns the raw pooled state")
    # On a CPU device all cores but one by default: the tokenizers, detokenizer and gateway need CPU
    # too, and a descheduled OpenMP thread stalls every matmul.
    cpu_threads: int = opt(0, "torch intra-op threads of the engine; 0: all cores but one on CPU, "
                           "torch's default on CUDA")
    tensor_parallel_size: int = opt(1, "processes the model is sharded across (torch.distributed: gloo on "
                                    "CPU, NCCL on CUDA, one GPU per rank); the engine is rank 0 and "
                                    "spawns the others")
    revision: str | None = opt(None, "hub revision (branch, tag or commit) of --model and --tokenizer")
    tokenizer: str | None = opt(None, "tokenizer source (directory or hub id) when not --model's")
    served_model_name: str | None = opt(None, "the model name clients see (ModelInfo); unset: from --model")
    chat_template: str | None = opt(None, "chat template for `messages` requests: a Jinja file or the "
                                    "template itself; unset: the tokenizer's")
    step_executor: str = opt("auto", "how a step runs: auto picks the fastest for the model and device (the "
                             "native step for dense fp32 models on the CPU, else Inductor on the CPU, CUDA "
                             "graphs on CUDA, eager where neither applies); compiled: Inductor or CUDA "
                             "graphs; native: the native CPU step; eager: the model's ops one by one",
                             choices=STEP_EXECUTORS)
    compile: bool = opt(True, "false: every step eager (the same as --step-executor eager)")
    overlap_steps: str = opt("auto", "overlapped decode steps: the host schedules and launches the next "
                             "decode step while the device runs this one, and reads this one's tokens "
                             "after (a request that stops runs one wasted row); auto: on CUDA, off on the "
                             "CPU (where the device is the host); never with speculative decoding or "
                             "tensor parallelism, whose next step needs the tokens",
                             choices=("auto", "on", "off"))
    max_cuda_graph_batch: int = opt(256, "CUDA graphs: the largest batch (decode and verification rows) "
                                    "captured; larger steps run eager")
    generation_config: str = opt("auto", "auto: the checkpoint's generation_config.json sampling defaults "
                                 "(temperature, top_p, top_k, min_p, repetition_penalty) apply to requests "
                                 "that leave them unset; none: pipeserve's defaults",
                                 choices=("auto", "none"))
    speculative_method: str = opt("none", "speculative decoding: ngram proposes by prompt lookup, draft by "
                                  "--draft-model; verified exactly in the merge step",
                                  choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = opt(4, "most tokens a request proposes per step (the adaptive rule "
                                      "proposes fewer, or none, where they do not pay)")
    draft_model: str | None = opt(None, "draft checkpoint (directory or hub id) sharing the model's "
                                  "tokenizer, for --speculative-method draft")
    speculative_adaptive: bool = opt(True, "size each request's proposal by the measured step cost and its "
                                     "acceptance (none at large batch); false: always num_speculative_tokens")
    prompt_lookup_min: int = opt(2, "ngram: the shortest suffix looked up in the prompt and output")
    prompt_lookup_max: int = opt(4, "ngram: the longest suffix looked up (the longest match wins)")
    enable_lora: bool = opt(False, "serve LoRA adapters (PEFT directories) of the model, batched: each "
                            "request names its adapter (the OpenAI model field, gRPC lora) or none")
    lora_modules: list[str] = opt(help="adapters served from the start, as NAME=PATH (PATH: a PEFT "
                                  "directory with adapter_config.json and adapter_model.safetensors)",
                                  factory=list)
    max_loras: int = opt(4, "LoRA: slots of the device-resident adapter table, the most distinct "
                         "adapters one step runs (others wait for a slot)")
    max_lora_rank: int = opt(16, "LoRA: the largest adapter rank served (the slots' width)")
    max_cpu_loras: int | None = opt(None, "LoRA: adapters kept in host memory, least recently used "
                                    "evicted (those requests hold are kept); unset: max(4, --max-loras)")
    allow_runtime_lora: bool = opt(False, "LoRA: POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                   "add and remove adapters while serving")

    def __post_init__(self) -> None:
        check_choices(self)
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0 (GB; unset: the default size), got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("num_pages", "max_model_len"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if not 0 < self.predictor_quantile < 1:
            raise ValueError(f"predictor_quantile must be in (0, 1), got {self.predictor_quantile}")
        self.backend = BACKEND_ALIASES.get(self.backend, self.backend)
        if not self.compile:  # the older switch, kept: compile=False is an eager engine
            if self.step_executor not in ("auto", "eager"):
                raise ValueError(f"--no-compile contradicts --step-executor {self.step_executor}")
            self.step_executor = "eager"
        needs_tokens = self.speculative_method != "none" or self.tensor_parallel_size > 1
        if self.overlap_steps == "on" and needs_tokens:
            raise ValueError("--overlap-steps on contradicts speculative decoding and tensor parallelism: "
                             "their next step needs this one's tokens")
        if self.max_cuda_graph_batch < 1:
            raise ValueError(f"max_cuda_graph_batch must be >= 1, got {self.max_cuda_graph_batch}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0, got {self.cpu_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max")
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ValueError("--draft-model goes with --speculative-method draft, and only with it")
        self._check_lora()

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(4, self.max_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if (self.lora_modules or self.allow_runtime_lora) and not self.enable_lora:
            raise ValueError("lora_modules and allow_runtime_lora need enable_lora")
        names = [lora_module(m)[0] for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")


def lora_module(spec: str) -> tuple[str, str]:
    """A --lora-modules entry NAME=PATH -> (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules entries are NAME=PATH, got {spec!r}")
    return name, path


# The devices an engine runs on (torch's names); auto picks cuda when present.
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
PORTS = (1, 65535)  # what a port flag accepts; a config made in code may also say 0 (any free port)


def check_ports(obj: Any, names: tuple[str, ...]) -> None:
    """ValueError naming the port field that is no TCP port (0, any free port, only from code)."""
    for name in names:
        port = getattr(obj, name)
        if port is not None and not 0 <= port <= PORTS[1]:
            raise ValueError(f"{name} {port} is not a TCP port: give {PORTS[0]}-{PORTS[1]}")


def port_number(text: str) -> int:
    """argparse's type of a port flag: an integer in PORTS (a wrapped 70000 would listen on 4464)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give {PORTS[0]}-{PORTS[1]}") from None
    if not PORTS[0] <= port <= PORTS[1]:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: give {PORTS[0]}-{PORTS[1]}")
    return port


def as_flags(message: str, *classes: type) -> str:
    """A config error as the CLI user reads it: the fields it names spelled as their flags (a field
    named by a plain word, e.g. port, only where it starts the message)."""
    names = sorted({f.name for cls in classes for f in fields(cls)}, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    return pattern.sub(lambda m: "--" + m.group(1).replace("_", "-")
                       if "_" in m.group(1) or m.start() == 0 else m.group(1), message)


ROPE_TYPES = ("linear", "llama3")  # the scalings the model's rope table implements


def check_rope_scaling(text: str) -> None:
    """ValueError unless text is a rope_scaling the engine implements (a JSON object, as in config.json)."""
    try:
        scaling = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"rope_scaling is not JSON: {text!r}") from None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling needs a rope_type of {' or '.join(ROPE_TYPES)}: {text!r}")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
        raise ValueError(f"rope_scaling needs a factor >= 1: {text!r}")
    missing = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if kind == "llama3" and k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type llama3 needs {', '.join(missing)}: {text!r}")


def check_choices(obj: Any) -> None:
    """ValueError naming the field whose value is not one of its declared choices."""
    for f in fields(obj):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(obj, f.name) not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}; "
                             f"got {getattr(obj, f.name)!r}")


# The EngineConfig fields a tokenizer or detokenizer process reads: which tokenizer, and the context.
TOKENIZER_FIELDS = ("model", "revision", "tokenizer", "chat_template", "max_model_len", "rope_scaling")
# The EngineConfig fields the gateway reads besides: the LoRA adapters it names and validates.
LORA_FIELDS = ("enable_lora", "lora_modules", "max_lora_rank", "allow_runtime_lora")


def cache_dir() -> str:
    """pipeserve's own cache (the demo model, converted tokenizers): $PIPESERVE_CACHE or ~/.cache."""
    return os.environ.get("PIPESERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pipeserve")


def new_instance_id() -> str:
    """A gateway's instance id: the health service name only that gateway answers SERVING for."""
    return f"pipeserve-{uuid.uuid4().hex}"


def address(name: str, help: str) -> Any:
    """An Addresses field: $PIPESERVE_<NAME>_ADDR, else an ipc:// path under /tmp/pipeserve."""
    return opt(help=help, factory=lambda: os.environ.get(f"PIPESERVE_{name.upper()}_ADDR",
                                                        f"ipc:///tmp/pipeserve/{name}"))


@dataclass
class Addresses:
    """ZeroMQ endpoints. Binders: gateway (tokenize, deltas, errors, status) and engine (requests,
    control) and detokenizer (steps). Connectors: everything else. Env vars let compose wire them.

    `errors` carries only per-request failures (RequestError); `status` carries liveness and process
    state (the engine's EngineInfo heartbeats, the supervisor's ProcessStatus)."""

    tokenize: str = address("tokenize", "gateway <-> tokenizers: requests to tokenize and their aborts "
                                        "(gateway binds)")
    requests: str = address("requests", "tokenizers -> engine: token ids (engine binds); data parallel: "
                                        "one endpoint per engine, comma-separated")
    control: str = address("control", "gateway and detokenizer -> engine: aborts (engine binds); data "
                                      "parallel: one endpoint per engine, comma-separated")
    steps: str = address("steps", "engine and tokenizers -> detokenizer: generated tokens, request "
                                  "settings (detokenizer binds)")
    deltas: str = address("deltas", "detokenizer -> gateway: text deltas (gateway binds)")
    errors: str = address("errors", "any process -> gateway: per-request failures (gateway binds)")
    status: str = address("status", "engine and supervisor -> gateway: heartbeats, process state "
                                    "(gateway binds)")

    @classmethod
    def under(cls, directory: str, engines: int = 1) -> Addresses:
        """ipc:// endpoints inside one directory (local mode: nothing listens beyond the host), with
        one requests and control endpoint per engine."""
        addrs = cls(**{name: f"ipc://{directory}/{name}" for name in cls.__dataclass_fields__})
        for name in PER_ENGINE:
            setattr(addrs, name, ",".join(f"ipc://{directory}/{name}-{i}" for i in range(engines)))
        return addrs

    def to_env(self) -> dict[str, str]:
        """The env vars that make a child process's Addresses() equal these."""
        return {f"PIPESERVE_{name.upper()}_ADDR": getattr(self, name) for name in self.__dataclass_fields__}


ZMQ_KEY_ENV = "PIPESERVE_ZMQ_KEY_FILE"
ZMQ_INSECURE_ENV = "PIPESERVE_ZMQ_INSECURE"


@dataclass
class InternalAuth:
    """Who may use the internal ZeroMQ sockets that cross hosts (pipeserve/zmq_auth.py): the
    deployment's CURVE key pair, a ZeroMQ certificate file. Every process reads it from
    $PIPESERVE_ZMQ_KEY_FILE (the launcher sets it for its children; compose and hand-started
    processes set it themselves); without it no process binds a tcp:// address, unless insecure
    ($PIPESERVE_ZMQ_INSECURE=1: open tcp:// sockets, only to measure what CURVE costs)."""

    key_file: str | None = opt(help="the deployment's ZeroMQ CURVE key pair (certificate file)",
                               factory=lambda: os.environ.get(ZMQ_KEY_ENV) or None)
    insecure: bool = opt(help="tcp:// without a key: anyone who reaches a port may use it",
                         factory=lambda: os.environ.get(ZMQ_INSECURE_ENV) == "1")

    def to_env(self) -> dict[str, str]:
        return ({ZMQ_KEY_ENV: self.key_file} if self.key_file else {}) | (
            {ZMQ_INSECURE_ENV: "1"} if self.insecure else {})


# Data parallelism: these Addresses list one endpoint per engine; engine i binds the i-th and every
# connector connects to all of them (engine i is the i-th socket).
PER_ENGINE = ("requests", "control")


def engine_endpoints(value: str) -> list[str]:
    """The per-engine endpoints of a `requests` or `control` address (one for a single engine)."""
    return [part.strip() for part in value.split(",") if part.strip()]


def engine_endpoint(value: str, index: int) -> str:
    """The endpoint engine `index` binds: the index-th of the list, or the only one (compose gives
    each engine service its own single bind address)."""
    endpoints = engine_endpoints(value)
    return endpoints[0] if len(endpoints) == 1 else endpoints[index]


@dataclass
class LaunchConfig:
    """Options of `pipeserve up` that shape the deployment rather than one process."""

    data_parallel_size: int = opt(1, "engines, each with its own KV pool (and, with tensor parallelism, "
                                  "its own ranks); one gateway, tokenizer pool and detokenizer serve "
                                  "them all, each request on one engine")
    ray: str | None = opt(None, "place the processes on a Ray cluster: its address (host:port) or auto; "
                          "unset: every process on this host")
    zmq_key_file: str | None = opt(None, "the deployment's ZeroMQ CURVE key pair (a certificate file, "
                                   "`pipeserve zmq-keygen PATH`) for the internal sockets on tcp:// "
                                   "(--ray); unset: a new pair per start")
    zmq_over: str = opt("ipc", "how the processes on this host talk: ipc (a private directory) "
                        "or tcp (127.0.0.1, authenticated and encrypted as across hosts: to test or "
                        "measure that transport; tcp-insecure: without CURVE, only to measure what it "
                        "costs); --ray always uses tcp", choices=("ipc", "tcp", "tcp-insecure"))

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")


# The tool-call formats the HTTP API reads (pipeserve/gateway/tool_parsers/: one module each).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# The reasoning formats it splits off (pipeserve/reasoning.py).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass
class GatewayConfig:
    """Options of the gRPC gateway (`pipeserve gateway`, and passed through by `pipeserve up`)."""

    host: str = opt("127.0.0.1", "address the gRPC server listens on (0.0.0.0: every interface)")
    port: int = opt(50051, "gRPC port; the server owns it exclusively (a second server on it exits)")
    max_inflight: int = opt(4096, "admission limit: more concurrent streams get RESOURCE_EXHAUSTED")
    max_request_bytes: int = opt(4 * 1024 * 1024, "larger requests get INVALID_ARGUMENT")
    max_response_bytes: int = opt(1024 * 1024, "a coalesced response is cut at about this size")
    liveness_timeout: float = opt(10.0, "seconds without a heartbeat before NOT_SERVING (open streams "
                                  "end UNAVAILABLE)")
    grace: float = opt(10.0, "on SIGTERM, seconds in-flight streams get to finish")
    metrics_port: int | None = opt(None, "serve Prometheus /metrics on this port; unset: off")
    http_port: int | None = opt(None, "serve the OpenAI-compatible HTTP API (and /metrics) on this port; "
                                "unset: 8000 under `pipeserve up`, off for `pipeserve gateway` alone")
    api_key: str | None = opt(None, 'require "authorization: Bearer KEY" on every call but health')
    allowed_origins: str | None = opt(None, "HTTP API: web origins (comma-separated, e.g. "
                                      "https://app.example.com; * for any) whose pages a browser lets call "
                                      "it (CORS); unset: none")
    http_max_connections: int = opt(4096, "HTTP API: most connections open at once; another gets 503 "
                                    "and is closed (counted in pipeserve_gateway_http_refused_total)")
    http_header_timeout: float = opt(10.0, "HTTP API: seconds a client has to send a request's headers "
                                     "(from connecting or from the request's first byte); then the "
                                     "connection closes")
    http_body_timeout: float = opt(30.0, "HTTP API: seconds a client has to send a request's body after its "
                                   "headers; then the connection closes")
    http_keepalive_timeout: float = opt(30.0, "HTTP API: seconds an idle keep-alive connection stays open")
    tls_cert: str | None = opt(None, "PEM certificate: serve gRPC over TLS only (with --tls-key)")
    tls_key: str | None = opt(None, "PEM private key of --tls-cert")
    enable_auto_tool_choice: bool = opt(False, "HTTP API: let the model decide to call tools (tool_choice "
                                        "auto, the default with tools); needs --tool-call-parser")
    tool_call_parser: str | None = opt(None, "HTTP API: how tool calls are read out of the model's text "
                                       "under tool_choice auto", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = opt(None, "HTTP API: split the model's reasoning section off chat output "
                                       "(message.reasoning); structured outputs and tool choices apply "
                                       "after it", choices=REASONING_PARSERS)
    dp_balance_threshold: int = opt(32, "data parallel: a request follows its prompt prefix to the engine "
                                    "that holds it unless that engine's load (waiting x 4 + running) is "
                                    "this much above the least loaded engine's")

    def __post_init__(self) -> None:
        check_ports(self, ("port", "metrics_port", "http_port"))
        if self.liveness_timeout <= 0 or self.grace < 0:
            raise ValueError("liveness_timeout must be > 0 and grace >= 0")
        if self.max_inflight < 1 or self.max_request_bytes < 1024 or self.max_response_bytes < 1024:
            raise ValueError("max_inflight must be >= 1, max_request_bytes and max_response_bytes >= 1024")
        if self.http_max_connections < 1 or min(self.http_header_timeout, self.http_body_timeout,
                                                self.http_keepalive_timeout) <= 0:
            raise ValueError("http_max_connections must be >= 1 and the http timeouts > 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")


def add_arguments(parser: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None) -> None:
    """One flag per dataclass field (`--page-size`, `--tokenize`; `only` these fields), described by
    the field's opt() help, choices and default. Flags default to None, so from_args() leaves unset
    fields to the dataclass (and its env defaults)."""
    group = parser.add_argument_group(f"{cls.__name__} options")
    for f, hint in _field_hints(cls):
        if only is not None and f.name not in only:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        default = f.default_factory() if f.default is MISSING else f.default
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        how: dict[str, Any] = ({"action": argparse.BooleanOptionalAction} if kind is bool
                               else {"type": kind, "metavar": kind.__name__.upper()})
        if typing.get_origin(hint) is list:  # one flag, several values
            how = {"type": str, "nargs": "+", "metavar": "VALUE"}
        if f.name.endswith("port"):
            how["type"] = port_number
        if f.metadata.get("choices"):
            how |= {"choices": f.metadata["choices"], "metavar": "{" + ",".join(f.metadata["choices"]) + "}"}
        shown = "unset" if default is None else default
        text = f.metadata.get("help", "")
        group.add_argument(flag, default=None, help=f"{text} (default: {shown})".lstrip(), **how)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The config the flags describe; StartupError (the one line a command prints) when its checks
    refuse it, the fields spelled as their flags."""
    values = {f.name: getattr(args, f.name, None) for f, _ in _field_hints(cls)}
    try:
        return cls(**{name: value for name, value in values.items() if value is not None})
    except ValueError as exc:
        raise StartupError(as_flags(str(exc), cls)) from None


def to_argv(obj: Any, only: tuple[str, ...] | None = None) -> list[str]:
    """The flags that reproduce obj's non-default fields (`only` these) in a child process."""
    argv = []
    for f, _ in _field_hints(type(obj)):
        if only is not None and f.name not in only:
            continue
        value = getattr(obj, f.name)
        if f.default is not MISSING and value == f.default or value is None:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(value, list):
            argv += [flag, *map(str, value)] if value else []
            continue
        argv += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return argv


def _field_hints(cls: type) -> list[tuple[Any, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in fields(cls)]
