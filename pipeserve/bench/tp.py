"""`pipeserve bench tp`: tensor parallelism on this machine, in process.

1. Step time: one random-weight Llama checkpoint served by an engine with --tensor-parallel-size 1
   (on --threads torch threads) and one with T ranks (each on threads / T), decoding the same batch
   of synthetic prompts in turn, --repeats times alternated; median ms per decode step and the
   batch's prefill time. On a CPU host the ranks share the host's cores and its memory bandwidth,
   so this shows what the collectives and the step plan cost, not what T GPUs would gain.
2. Step plan transport: the plan of a decode step of each batch size (header and payload of
   pipeserve/engine/parallel/step_plan.py), sent to a second process and acknowledged, --plan-iters
   times, over the gloo group (what the engine uses) and over a ZeroMQ ipc:// PUSH/PULL pair with the
   same bytes; median microseconds per round trip (plan one way, a one-element ack back).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeserve.bench.harness import run_batch, synthetic_prompts
from pipeserve.bench.report import machine_info, print_table, write_json

VOCAB = 4096
MAX_PAGES = 64  # block-table width of a decode plan (1024 tokens of context in pages of 16)


def config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.kv_heads, "head_dim": 64,
        "vocab_size": VOCAB, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks of the TP engine")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16], help="decode batch sizes to time")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=5, help="alternated runs of each engine per batch")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the TP=1 engine, split among the TP ranks (default: the "
                        "cores this process may use)")
    parser.add_argument("--plan-iters", type=int, default=300, help="round trips per transport and batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")


# -- step plan transport ------------------------------------------------------------------------
def _plan(batch: int) -> tuple[Any, Any]:
    """A decode step's model input for `batch` rows, as the runner stages it."""
    import torch

    from pipeserve.engine.kv.metadata import AttentionMetadata

    i32, i64 = torch.int32, torch.int64
    tables = torch.randint(0, 4096, (batch, MAX_PAGES), dtype=i32)
    lens = torch.full((batch,), 512, dtype=i32)
    meta = AttentionMetadata(torch.arange(batch, dtype=i64), batch, tables, lens,
                             torch.zeros(0, MAX_PAGES, dtype=i32), torch.zeros(1, dtype=i32),
                             torch.zeros(0, dtype=i32), 0, 0, 512, sample_max_seq_len=512)
    return torch.arange(batch, dtype=i64), meta


def _echo(port: int, address: str, batches: list[int], iters: int) -> None:
    """The second process: receive each plan and acknowledge it, first over gloo, then over zmq."""
    import torch
    import zmq
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from pipeserve.engine.parallel.group import HOST, TPGroup
    from pipeserve.engine.parallel.step_plan import StepReceiver

    store = TCPStore(HOST, port, 2, False, timeout=datetime.timedelta(seconds=120))
    group = TPGroup(1, 2, store, torch.device("cpu"))
    receiver, ack = StepReceiver(group, None), torch.zeros(1)
    for _ in batches:
        for _ in range(iters):
            receiver.receive()
            group.all_reduce(ack)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(address + "-plan")
    push.connect(address + "-ack")
    for _ in batches:
        for _ in range(iters):
            header, payload = pull.recv_multipart()
            torch.frombuffer(bytearray(payload), dtype=torch.int64)  # what a worker would build from it
            push.send(b"")
    ctx.destroy(linger=0)


def plan_transport(batches: list[int], iters: int) -> list[dict[str, Any]]:
    """Median microseconds per plan round trip, gloo vs zmq, per decode batch size."""
    import torch
    import zmq
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from pipeserve.engine.parallel.group import HOST, TPGroup
    from pipeserve.engine.parallel.step_plan import StepSender

    address = f"ipc://{tempfile.mkdtemp(prefix='pipeserve-tp-')}/plan"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(address + "-plan")
    pull.bind(address + "-ack")
    store = TCPStore(HOST, 0, 2, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    child = mp.get_context("spawn").Process(target=_echo, args=(store.port, address, batches, iters),
                                            daemon=True)
    child.start()
    group = TPGroup(0, 2, store, torch.device("cpu"))
    sender, ack = StepSender(group), torch.zeros(1)
    gloo: dict[int, float] = {}
    for batch in batches:
        ids, meta = _plan(batch)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            sender.send(ids, ids, meta)
            group.all_reduce(ack)
            times.append(time.perf_counter() - start)
        gloo[batch] = statistics.median(times) * 1e6
    points = []
    for batch in batches:
        ids, meta = _plan(batch)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            parts = [ids, ids, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens]
            payload = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
            push.send_multipart([np.zeros(12, np.int64).tobytes(), payload.numpy().tobytes()])
            pull.recv()
            times.append(time.perf_counter() - start)
        points.append({"batch": batch, "payload_bytes": int(payload.numel()) * 8,
                       "gloo_us": gloo[batch], "zmq_us": statistics.median(times) * 1e6})
    child.join(60)
    ctx.destroy(linger=0)
    return points


# -- step time ----------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    import torch

    from pipeserve.demo import default_cache_dir, save_random_checkpoint
    from pipeserve.engine import LLM

    world = args.tensor_parallel_size
    if world < 2 or min(args.batch) < 1 or args.output_len < 2 or args.repeats < 1:
        raise SystemExit("pipeserve bench tp: need --tensor-parallel-size >= 2, --batch >= 1, "
                         "--output-len >= 2, --repeats >= 1")
    threads = args.threads or len(os.sched_getaffinity(0))
    load_start = os.getloadavg()
    cfg = config(args)
    tag = f"bench-tp-h{args.hidden}-l{args.layers}-kv{args.kv_heads}"
    path = save_random_checkpoint(str(Path(default_cache_dir()).parent / tag), cfg, seed=args.seed,
                                  dtype=torch.float32)
    max_batch = max(args.batch)
    options: dict[str, Any] = dict(device="cpu", dtype="float32", max_num_seqs=max_batch,
                                   max_num_batched_tokens=max_batch * args.input_len)
    per_rank = max(1, threads // world)
    torch.set_num_threads(threads)
    tp = f"tp{world}"
    # name -> (engine, torch threads of this process while it runs); tp1_per_rank: TP=1 on one rank's
    # share of the cores, the baseline that isolates what sharding adds from what threads do.
    engines = {"tp1": (LLM(path, **options).engine, threads),
               tp: (LLM(path, tensor_parallel_size=world, **options).engine, per_rank),
               "tp1_per_rank": (LLM(path, **options).engine, per_rank)}
    rng = np.random.default_rng(args.seed)
    points = []
    for batch in sorted(set(args.batch)):
        prompts = synthetic_prompts(rng, batch, args.input_len, VOCAB)
        steps: dict[str, list[float]] = {name: [] for name in engines}
        prefill: dict[str, list[float]] = {name: [] for name in engines}
        for engine, n in engines.values():
            torch.set_num_threads(n)
            run_batch(engine, prompts, 2)  # warm-up of this shape
        for _ in range(args.repeats):  # alternated, so drifting load hits all alike
            for name, (engine, n) in engines.items():
                torch.set_num_threads(n)
                timing = run_batch(engine, prompts, args.output_len)
                steps[name].append(statistics.median(timing.decode_step_s) * 1e3)
                prefill[name].append(timing.prefill_s * 1e3)
        point: dict[str, Any] = {"batch": batch}
        for name in engines:
            point[name] = {"ms_per_step": statistics.median(steps[name]), "ms_per_step_runs": steps[name],
                           "prefill_ms": statistics.median(prefill[name]), "prefill_ms_runs": prefill[name]}
        point["tp_over_tp1"] = point[tp]["ms_per_step"] / point["tp1"]["ms_per_step"]
        points.append(point)
    for engine, _ in engines.values():
        engine.close()
    transport = plan_transport(sorted(set(args.batch)), args.plan_iters)
    result = {
        "bench": "tp",
        "machine": {**machine_info(), "load_average": {"start": load_start, "end": os.getloadavg()}},
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {"threads": threads},
        "model": cfg,
        "points": points,
        "plan_transport": transport,
    }
    print(f"Llama h{args.hidden} x {args.layers} layers, {cfg['num_attention_heads']} heads / "
          f"{args.kv_heads} KV heads; TP=1 on {threads} threads, TP={world} on {per_rank} per rank, TP=1 "
          f"on {per_rank}; medians of {args.repeats} alternated runs, {args.input_len} in / "
          f"{args.output_len} out")  # fmt: skip
    print_table(
        "decode step and prefill, ms",
        ["batch", "TP=1 step", f"TP={world} step", f"TP={world} / TP=1", f"TP=1 on {per_rank} step",
         "TP=1 prefill", f"TP={world} prefill", f"TP=1 on {per_rank} prefill"],
        [[p["batch"], p["tp1"]["ms_per_step"], p[tp]["ms_per_step"], p["tp_over_tp1"],
          p["tp1_per_rank"]["ms_per_step"], p["tp1"]["prefill_ms"], p[tp]["prefill_ms"],
          p["tp1_per_rank"]["prefill_ms"]] for p in points],
    )  # fmt: skip
    print_table(
        "step plan round trip (plan + ack), us",
        ["batch", "payload bytes", "gloo broadcast", "zmq ipc"],
        [[p["batch"], p["payload_bytes"], p["gloo_us"], p["zmq_us"]] for p in transport],
    )
    if args.json:
        print(f"wrote {write_json(args.json, result)}")
    return 0
