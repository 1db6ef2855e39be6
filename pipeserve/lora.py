"""LoRA adapters as users name them: `LoRARequest` (vLLM's shape), and the reading and validation of a
PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) without torch, so the
gateway checks a directory when it is named and the engine loads only what passed.

Every error is a `LoRAError` (a ValueError) whose message names the file and the field at fault.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: PEFT's module names in the Llama family.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_MODULES + MLP_MODULES
# The engine's stats key LORA_RUNNING + name: running requests of that adapter (a labelled gauge).
LORA_RUNNING = "lora_running:"
# PEFT's key of one LoRA factor: ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>[.<adapter>].weight
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAError(ValueError):
    """A bad adapter directory or name; the message names the file and field."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, its integer id (unique per adapter, > 0) and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise LoRAError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine needs of adapter_config.json."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the module names the weights file holds factors for

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class FactorShape:
    """One LoRA factor in the weights file: layer, module, A or B, and its shape."""

    key: str
    layer: int
    module: str
    factor: str  # "A" [r, in] or "B" [out, r]
    shape: tuple[int, ...]


def parse_factor(key: str) -> tuple[int, str, str, str] | None:
    """(layer, block, module, A|B) of a PEFT factor key; None for any other key."""
    m = _KEY.search(key)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), m.group(3), m.group(4)


def read_config(path: str, max_rank: int) -> AdapterConfig:
    """adapter_config.json of `path`, validated (rank within max_rank, a plain LoRA)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAError(f"adapter directory {path!r} does not exist")
    if not os.path.isfile(file):
        raise LoRAError(f"{CONFIG_FILE} is missing in {path!r}")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{CONFIG_FILE} in {path!r} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{CONFIG_FILE}: expected a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{CONFIG_FILE}: peft_type {raw.get('peft_type')!r} is not LORA")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{CONFIG_FILE}: rank 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"{CONFIG_FILE}: rank r={rank} is above max_lora_rank={max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAError(f"{CONFIG_FILE}: use_rslora must be true or false, got {rslora!r}")
    # What a plain LoRA does not do: refused rather than served wrong.
    for name, off in (("use_dora", False), ("rank_pattern", {}), ("alpha_pattern", {}), ("bias", "none"),
                      ("modules_to_save", None)):
        value = raw.get(name, off)
        if value not in (off, None, [], {}, False) and not (name == "bias" and value == "none"):
            raise LoRAError(f"{CONFIG_FILE}: {name}={value!r} is not supported (a plain LoRA only)")
    targets = raw.get("target_modules")
    if isinstance(targets, str):  # a regex over module names: the weights file says which matched
        names: tuple[str, ...] = ()
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        names = tuple(t.rsplit(".", 1)[-1] for t in targets)
        bad = sorted(set(names) - set(TARGETS))
        if bad:
            raise LoRAError(f"{CONFIG_FILE}: target_modules {bad} are not supported (supported: "
                            f"{', '.join(TARGETS)})")
    else:
        raise LoRAError(f"{CONFIG_FILE}: target_modules must be a list of module names or a regex, "
                        f"got {targets!r}")
    return AdapterConfig(rank=rank, alpha=float(alpha), use_rslora=rslora, target_modules=names)


def read_factors(path: str) -> list[FactorShape]:
    """The LoRA factors of adapter_model.safetensors (names and shapes, read from its header)."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"{WEIGHTS_FILE} is missing in {path!r}")
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= 100 << 20:
                raise ValueError(f"header size {size}")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{WEIGHTS_FILE} in {path!r} is not a safetensors file: {exc}") from None
    factors = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        parsed = parse_factor(key)
        if parsed is None:
            raise LoRAError(f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA factor of a supported projection")
        layer, block, module, factor = parsed
        if module not in TARGETS or block not in ("self_attn", "mlp"):
            raise LoRAError(f"{WEIGHTS_FILE}: {key!r}: target_modules may name only {', '.join(TARGETS)} "
                            "(mixture-of-experts experts are not supported)")
        factors.append(FactorShape(key, layer, module, factor, tuple(meta["shape"])))
    if not factors:
        raise LoRAError(f"{WEIGHTS_FILE} in {path!r} holds no LoRA factors")
    return factors


def validate(path: str, max_rank: int) -> tuple[AdapterConfig, list[FactorShape]]:
    """The adapter's config and factors, checked against each other: every targeted module has an A
    [r, in] and a B [out, r] of the config's rank."""
    config = read_config(path, max_rank)
    factors = read_factors(path)
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for f in factors:
        if len(f.shape) != 2:
            raise LoRAError(f"{WEIGHTS_FILE}: {f.key} has shape {list(f.shape)}, not a matrix")
        pairs.setdefault((f.layer, f.module), {})[f.factor] = f.shape
    for (layer, module), shapes in pairs.items():
        if set(shapes) != {"A", "B"}:
            raise LoRAError(f"{WEIGHTS_FILE}: layer {layer} {module} has lora_{''.join(shapes)} only")
        if shapes["A"][0] != config.rank or shapes["B"][1] != config.rank:
            raise LoRAError(f"{WEIGHTS_FILE}: layer {layer} {module}: factor rank {shapes['A'][0]} is not "
                            f"{CONFIG_FILE}'s r={config.rank}")
    modules = tuple(sorted({m for _, m in pairs}))
    if config.target_modules and not set(modules) <= set(config.target_modules):
        raise LoRAError(f"{WEIGHTS_FILE} holds {modules}, outside {CONFIG_FILE}'s target_modules "
                        f"{list(config.target_modules)}")
    return AdapterConfig(config.rank, config.alpha, config.use_rslora, modules), factors


def check_shapes(factors: list[FactorShape], in_out: dict[str, tuple[int, int]], num_layers: int) -> None:
    """Each factor's shape against the model's projection (in, out) sizes and layer count."""
    for f in factors:
        if f.layer >= num_layers:
            raise LoRAError(f"{WEIGHTS_FILE}: {f.key}: layer {f.layer} but the model has {num_layers}")
        d_in, d_out = in_out[f.module]
        want = d_in if f.factor == "A" else d_out
        got = f.shape[1] if f.factor == "A" else f.shape[0]
        if got != want:
            raise LoRAError(f"{WEIGHTS_FILE}: {f.key} has shape {list(f.shape)}; the model's {f.module} "
                            f"needs {'in' if f.factor == 'A' else 'out'} size {want}")
