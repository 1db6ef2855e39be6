"""The vLLM-CPU side of the peer benchmarks: a script run by the interpreter of vLLM's own venv
(`pipeserve/bench/vllm_peer.py` starts it), never imported by pipeserve. It imports only the
standard library and vllm, so it runs in a venv that has no pipeserve.

Protocol: one JSON object per line. Requests come on stdin; replies go to the file descriptor given
by --reply-fd (vLLM logs to stdout and stderr, which the parent sends to a log file). The first
reply is {"ready": {...versions...}} or {"error": "..."}; then, per request
{"prompts": [[ids]], "max_tokens": [n per prompt]}, a reply {"outputs": [[ids]], "seconds": s,
"first_token_s": s, "steps": n}: the wall time of the whole batch, the time until every request had
its first token, and the engine steps taken. An empty line or EOF ends the worker.

The batch runs on vLLM's own engine step loop (LLMEngine.add_request, then step until no request is
left), in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the parent): the loop pipeserve's
benchmarks time on their own engine, with no front-end process on another core. Sampling is greedy,
EOS ignored, no detokenization.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any


def serve(args: argparse.Namespace, reply: Any) -> None:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, skip_tokenizer_init=True, seed=0,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    send(reply, {"ready": {"vllm": vllm.__version__, "torch": torch.__version__,
                           "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                           "torch_threads": torch.get_num_threads()}})
    batch = 0
    for line in sys.stdin:
        if not line.strip():
            return
        request = json.loads(line)
        prompts, max_tokens = request["prompts"], request["max_tokens"]
        ids = [f"b{batch}-{i}" for i in range(len(prompts))]
        batch += 1
        outputs: dict[str, list[int]] = {}
        start = time.perf_counter()
        for rid, prompt, n in zip(ids, prompts, max_tokens, strict=True):
            params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True,
                                    detokenize=False)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        first_token_s, steps = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            if first_token_s is None and len(outputs) == len(ids) and all(outputs.values()):
                first_token_s = time.perf_counter() - start
        seconds = time.perf_counter() - start
        send(reply, {"outputs": [outputs[rid] for rid in ids], "seconds": seconds,
                     "first_token_s": first_token_s, "steps": steps})


def send(reply: Any, message: dict[str, Any]) -> None:
    reply.write(json.dumps(message) + "\n")
    reply.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="absolute checkpoint path (vLLM needs it absolute)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()
    with os.fdopen(args.reply_fd, "w") as reply:
        try:
            serve(args, reply)
        except BaseException as exc:  # the parent reads the reason instead of a closed pipe
            traceback.print_exc()
            send(reply, {"error": f"{type(exc).__name__}: {exc}"})
            raise


if __name__ == "__main__":  # vLLM's CPU engine spawns helpers that re-import the main module
    main()
