"""gpu-check's serving section: `pipeserve up` on this device (every process, as an operator starts
it) reaches SERVING, and one streamed gRPC request and one HTTP completion return the greedy text the
offline `LLM` gives on the same device. A tiny random Llama in fp32 with the default backend and step
executor (Triton and CUDA graphs on CUDA), so the three texts must be identical. The KV pool is sized
explicitly (1 GB): the check may share the GPU with others, and the default takes 90% of it."""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from .models import build_tiny_model
from .report import CorrectnessRow, SpeedRow
from .runner import Context

PROMPT = "The pipeline serves tokens on the device: "
MAX_TOKENS = 32
NAME = "gpu-check-tiny"
KV_GB = 1.0


def offline_text(model_dir: str, device: str) -> str:
    from pipeserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, device=device, dtype="float32", kv_cache_gb=KV_GB)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    text: str = llm.generate([PROMPT], params)[0].text
    return text


def http_text(url: str) -> str:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        reply: dict[str, Any] = json.loads(response.read())
    return str(reply["choices"][0]["text"])


def same(name: str, got: str, want: str) -> CorrectnessRow:
    return CorrectnessRow.check(name, got == want, "" if got == want else f"got {got!r}, offline {want!r}")


def run(ctx: Context, startup_s: float = 60.0) -> None:
    from pipeserve.local_cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="gpu-check-serving-") as tmp:
        model_dir = build_tiny_model(f"{tmp}/llama", "llama")
        want = offline_text(model_dir, ctx.device)
        start = time.perf_counter()
        flags = ("--served-model-name", NAME, "--dtype", "float32", "--kv-cache-gb", str(KV_GB))
        with LocalCluster(Path(tmp) / "serve.log", model_dir, *flags, workers=1, device=ctx.device,
                          startup=startup_s) as cluster:
            ctx.row(SpeedRow("serving_start_tiny", round(time.perf_counter() - start, 2), "s",
                             detail="`pipeserve up` to SERVING, a tiny fp32 Llama"))
            stream = cluster.client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                             timeout=60)
            ctx.row(same("serving grpc stream equals offline LLM", stream.text, want))
            ctx.row(same("serving http completion equals offline LLM", http_text(cluster.http_url), want))
