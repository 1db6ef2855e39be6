"""The LoRA adapters this gateway serves, by name: those of --lora-modules and, under
--allow-runtime-lora, those loaded and unloaded over HTTP. Each directory is validated when it is
named (pipeserve/lora.py: a missing file or a rank above --max-lora-rank is refused with a message
naming it); every request of an adapter carries its id and path to the engine, which reads it when a
request first needs it. Ids are unique per load, so an adapter loaded again under the same name is
read again."""

from __future__ import annotations

import itertools

from pipeserve.config import EngineConfig, lora_module
from pipeserve.lora import LoRAError, LoRARequest, validate


class Adapters:
    def __init__(self, enabled: bool = False, max_rank: int = 16, runtime: bool = False) -> None:
        self.enabled, self.max_rank, self.runtime = enabled, max_rank, runtime
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @classmethod
    def from_config(cls, config: EngineConfig | None) -> Adapters:
        """The registry --enable-lora and --lora-modules describe (LoRAError for a bad module)."""
        if config is None or not config.enable_lora:
            return cls()
        adapters = cls(True, config.max_lora_rank, config.allow_runtime_lora)
        for spec in config.lora_modules:
            adapters.load(*lora_module(spec))
        return adapters

    def load(self, name: str, path: str) -> LoRARequest:
        """Validate and register; LoRAError (the client's: a 400) when the directory is bad or the
        name taken."""
        if not self.enabled:
            raise LoRAError("LoRA is not enabled on this server (--enable-lora)")
        if not name:
            raise LoRAError("lora_name must not be empty")
        if name in self.by_name:
            raise LoRAError(f"the LoRA adapter {name!r} is already loaded")
        validate(path, self.max_rank)
        request = LoRARequest(name, next(self._ids), path)
        self.by_name[name] = request
        return request

    def unload(self, name: str) -> bool:
        """Whether it was loaded."""
        return self.by_name.pop(name, None) is not None

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def names(self) -> list[str]:
        return list(self.by_name)
