"""What `pipeserve up` checks before it starts any process, so that a mistake ends in one line that
says what is wrong and what to do instead of tracebacks from five processes:

- the ports: the gRPC port (and the metrics and HTTP ports) must be free on the host;
- the model: a checkpoint directory with config.json of a supported architecture and safetensors
  weights, or a hub id (downloaded into the Hugging Face cache, or found there offline);
- the tokenizer (--tokenizer, or the model's; a slow-only one is converted here, once) and the
  chat template (--chat-template: a file or the template itself, which must parse).

check_ports() runs in the launcher; resolve() runs in a subprocess (`python -m pipeserve.preflight`,
see run()) because loading a tokenizer imports transformers, and building the demo model torch,
neither of which the launcher should keep in memory while it supervises.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import socket
import subprocess
import sys
import traceback
from dataclasses import asdict, replace

from pipeserve.config import EngineConfig, GatewayConfig, lora_module
from pipeserve.lora import LoRAError, validate
from pipeserve.model_config import ModelConfig, read_config
from pipeserve.startup import StartupError, explain

__all__ = ["StartupError", "check_port", "check_ports", "resolve", "run"]


def check_port(host: str, port: int, flag: str) -> None:
    """StartupError unless a listening socket can be bound at host:port (as the gateway binds it:
    SO_REUSEADDR on, so a port in TIME_WAIT counts as free, one with a listener does not)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(f"port {port} on {host} is in use (another pipeserve, or another "
                                   f"program): stop it or choose another {flag}") from None
            if exc.errno == errno.EACCES:
                raise StartupError(f"port {port} needs privileges: choose a {flag} above 1023") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise StartupError(f"--host {host} is not an address of this machine") from None
            raise StartupError(f"cannot listen on {host}:{port} ({exc.strerror}): check {flag}") from None


def check_ports(gateway: GatewayConfig) -> None:
    check_port(gateway.host, gateway.port, "--port")
    taken = {gateway.port: "--port"}
    for flag, port in (("--metrics-port", gateway.metrics_port), ("--http-port", gateway.http_port)):
        if port is None:
            continue
        if port in taken:
            raise StartupError(f"{flag} {port} is also {taken[port]}: choose another")
        taken[port] = flag
        check_port(gateway.host, port, flag)


def resolve(engine: EngineConfig) -> EngineConfig:
    """The config with --model and --tokenizer as local directories (hub ids downloaded or found in
    the cache), the name clients will see, and everything the processes will load checked."""
    from pipeserve import hub
    from pipeserve.tokenizer.load import load_tokenizer, resolve_model_dir

    name = engine.model
    try:
        model_dir = resolve_model_dir(engine.model, engine.revision)
    except hub.ModelNotFound as exc:
        raise StartupError(f"--model {exc}") from None
    try:
        tokenizer_dir = hub.resolve(engine.tokenizer, engine.revision) if engine.tokenizer else None
    except hub.ModelNotFound as exc:
        raise StartupError(f"--tokenizer {exc}") from None
    what = f"--model {name}" if name else "the demo model"
    model_cfg = checkpoint(what, model_dir, engine.rope_scaling, weights=engine.load_format != "dummy")
    context = model_cfg.max_position_embeddings
    if engine.max_model_len is not None and engine.max_model_len > context:
        if engine.rope_scaling:
            raise StartupError(f"--max-model-len {engine.max_model_len} is above the {context} tokens "
                               f"--rope-scaling scales {what}'s context to: give at most {context}, or a "
                               "larger factor")
        raise StartupError(f"--max-model-len {engine.max_model_len} is above the context {what} was trained "
                           f"for ({context} tokens): give at most {context}, leave it unset, or scale the "
                           "context with --rope-scaling")
    check_device(engine.device)
    check_triton(engine)
    check_fp8(engine)
    if engine.tensor_parallel_size > 1:
        from pipeserve.engine.model.tensor_parallel import check_shardable

        try:
            check_shardable(model_cfg, engine.tensor_parallel_size)
        except ValueError as exc:
            raise StartupError(f"{what}: {exc}") from None
    vocab = model_cfg.vocab_size
    draft_dir = None
    if engine.draft_model:
        try:
            draft_dir = hub.resolve(engine.draft_model, engine.revision)
        except hub.ModelNotFound as exc:
            raise StartupError(f"--draft-model: {exc}") from None
        draft = checkpoint(f"--draft-model {engine.draft_model}", draft_dir)
        if draft.vocab_size != vocab:
            raise StartupError(f"--draft-model {engine.draft_model}: its vocabulary has {draft.vocab_size} "
                               f"tokens, the model's {vocab}: a draft must share the model's tokenizer")
    for spec in engine.lora_modules:  # the gateway checks them again when it starts
        name, path = lora_module(spec)
        try:
            validate(path, engine.max_lora_rank)
        except LoRAError as exc:
            raise StartupError(f"--lora-modules {name}: {exc}") from None
    try:
        tokenizer = load_tokenizer(tokenizer_dir or model_dir, engine.chat_template)
    except (OSError, ValueError) as exc:  # FileNotFoundError, a corrupt tokenizer.json, ...
        raise StartupError(f"tokenizer: {exc}") from None
    if tokenizer.chat_template:
        import jinja2

        try:
            jinja2.Environment().parse(tokenizer.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            where = "--chat-template" if engine.chat_template else f"the chat template of {what}"
            raise StartupError(f"{where} is not a valid Jinja template: {exc} (line {exc.lineno})") from None
    served = engine.served_model_name or (hub.display_name(name) if name else None)
    return replace(engine, model=model_dir, tokenizer=tokenizer_dir, revision=None, served_model_name=served,
                   draft_model=draft_dir)


def check_device(device: str) -> None:
    """StartupError unless torch can run on the device (a CUDA one needs CUDA and that GPU here)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise StartupError(f"--device {device}: {why} on this host: use --device cpu (or auto)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise StartupError(f"--device {device}: this host has {torch.cuda.device_count()} CUDA GPU(s): "
                           f"give cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def check_triton(engine: EngineConfig) -> None:
    """StartupError when the Triton backend would run and Triton is not installed (the runtime install
    leaves it out beside a torch without CUDA, whose engine never imports it)."""
    import importlib.util

    if engine.backend != "triton" and not (engine.backend == "auto" and engine.device.startswith("cuda")):
        return
    if importlib.util.find_spec("triton") is None:
        flag = "--backend triton" if engine.backend == "triton" else f"--device {engine.device}"
        raise StartupError(f"{flag}: the Triton kernels need Triton, which is not installed here: "
                           "pip install triton, or use --backend cpu")


# Triton has fp8 e4m3 (every fp8 kernel: W8A8 GEMMs, the fp8 KV cache) from compute capability 8.9:
# Ada and Hopper; on Ampere its compiler refuses the type.
FP8_CAPABILITY = (8, 9)


def check_fp8(engine: EngineConfig) -> None:
    """StartupError when fp8 weights or KV cache are asked for on a CUDA GPU without fp8 support."""
    fp8 = [flag for flag, on in (("--quantization w8a8-fp8", engine.quantization == "w8a8-fp8"),
                                 ("--kv-cache-dtype fp8", engine.kv_cache_dtype == "fp8")) if on]
    if not fp8 or engine.device == "cpu" or engine.backend in ("cpu", "torch", "reference"):
        return
    import torch

    if not torch.cuda.is_available():  # auto on a host without CUDA: the cpu backend runs fp8 itself
        return
    index = int(engine.device.partition(":")[2] or 0)
    capability = torch.cuda.get_device_capability(index)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        cc = f"{capability[0]}.{capability[1]}"
        raise StartupError(f"{' and '.join(fp8)}: {name} (compute capability {cc}) has no fp8 (Ada or "
                           "Hopper, 8.9+, does): use --quantization w8a8-int8 and --kv-cache-dtype int8 "
                           "instead")


def checkpoint(what: str, model_dir: str, rope_scaling: str | None = None,
               weights: bool = True) -> ModelConfig:
    """The config of a checkpoint directory that pipeserve can load, or StartupError saying why not.
    weights: whether it must hold weights (not with --load-format dummy)."""
    try:
        cfg = ModelConfig.from_dict(read_config(model_dir, rope_scaling))
    except FileNotFoundError:
        raise StartupError(f"{what}: {model_dir} has no config.json, so it is not a Hugging Face "
                           "checkpoint: give the directory that holds config.json") from None
    except KeyError as exc:
        raise StartupError(f"{what}: config.json has no {exc}: not a Llama-family checkpoint") from None
    except ValueError as exc:  # an unsupported architecture, a config.json that is no JSON
        raise StartupError(f"{what}: {exc}") from None
    if weights and not glob.glob(os.path.join(model_dir, "*.safetensors")):
        raise StartupError(f"{what}: no *.safetensors weights in {model_dir} (pipeserve loads safetensors "
                           "only; convert .bin weights with transformers' save_pretrained, or serve random "
                           "weights with --load-format dummy)") from None
    return cfg


def run(engine: EngineConfig, debug: bool = False) -> EngineConfig:
    """resolve() in a subprocess; StartupError with its one line when something is wrong. Download
    progress (stderr) reaches the user's terminal (and with debug, a traceback)."""
    argv = [sys.executable, "-m", "pipeserve.preflight", json.dumps(asdict(engine)), *(["--debug"] * debug)]
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise StartupError(lines[-1] if lines else f"the start-up checks failed (exit code {out.returncode})")
    return EngineConfig(**json.loads(lines[-1]))


def main(argv: list[str]) -> int:
    engine = EngineConfig(**json.loads(argv[0]))
    try:
        resolved = resolve(engine)
    except Exception as exc:  # noqa: BLE001 - any failure is the one line the launcher prints
        if "--debug" in argv[1:]:
            traceback.print_exception(exc)
        print(explain(exc, engine.device) if isinstance(exc, StartupError) else
              f"the start-up checks failed: {type(exc).__name__}: {exc} (run with --debug for the traceback)")
        return 1
    print(json.dumps(asdict(resolved)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
