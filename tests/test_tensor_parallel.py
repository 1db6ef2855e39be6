"""Tensor parallelism on the CPU (gloo): TP=2 generates the same greedy tokens as TP=1 in fp32, with
logprobs within 1e-4, through mixed batches, chunked prefill and preemption; for GQA with fewer KV
heads than ranks, Qwen2's biases, Mistral, the real stories260K, mixtures of experts, the int8 KV
cache and W8A8. Its other ranks never outlive their engine, however it ends; a rank that fails to
start or dies mid-generation, killed or raising, makes the engine raise that rank's own error."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from pipeserve.config import EngineConfig
from pipeserve.engine import LLM, SamplingParams
from pipeserve.engine.model.tensor_parallel import ShardPlan, check_shardable, local_config
from pipeserve.local_cluster import ROOT, LocalCluster
from pipeserve.model_config import ModelConfig
from pipeserve.preflight import StartupError, resolve

# A small pool, short chunks and few slots: prompts are chunked, batched with decodes and preempted.
PRESSURE = dict(page_size=4, num_pages=14, max_num_batched_tokens=12, max_num_seqs=4)
PROMPTS = [[1, *range(5, 5 + n)] for n in (3, 29, 11, 1, 17, 24)]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True)


def generate(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    outs = llm.generate(PROMPTS, PARAMS)
    assert llm.engine.stats()["pages_used"] == 0
    return [o.token_ids for o in outs], [[lp["logprob"] for lp in o.logprobs or []] for o in outs]


def assert_same(model_dir: str, atol: float = 1e-4, **options: object) -> LLM:
    """TP=2 against TP=1 on the same engine options; returns the TP=2 LLM (still running)."""
    # TP=2 steps run eager, and TP=1 too: quantized caches or experts would compile Inductor here.
    base = LLM(model_dir, device="cpu", dtype="float32", step_executor="eager", **PRESSURE, **options)
    want_ids, want_lps = generate(base)
    tp = LLM(model_dir, device="cpu", dtype="float32", tensor_parallel_size=2, **PRESSURE, **options)
    got_ids, got_lps = generate(tp)
    assert got_ids == want_ids
    for got, want in zip(got_lps, want_lps, strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=atol, rtol=0)
    assert tp.engine.stats()["preemptions"] == base.engine.stats()["preemptions"] > 0
    return tp


def workers_of(llm: LLM) -> list[int]:
    assert llm.engine.tp is not None and llm.engine.tp.ranks is not None
    return [p.pid for p in llm.engine.tp.ranks.procs]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"workers {[p for p in pids if alive(p)]} still running"
        time.sleep(0.1)


# -- sharding, without processes ----------------------------------------------------------------
def config(**overrides: object) -> ModelConfig:
    from tests.models import BASE

    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **BASE, **overrides})


def test_local_config_splits_heads_and_replicates_kv_heads_fewer_than_ranks() -> None:
    cfg = config(num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    local = local_config(cfg, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 80)
    # Query heads 0-3 read KV head 0, 4-7 KV head 1: ranks 0, 1 keep head 0; ranks 2, 3 head 1.
    assert [ShardPlan(cfg, r, 4).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert [ShardPlan(cfg, r, 2).kv_start for r in range(2)] == [0, 1]


def test_shards_reassemble_the_checkpoint_tensors() -> None:
    cfg = config(num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=7)
    q, kv = cfg.q_size, cfg.kv_size
    full = torch.randn(q + 2 * kv, cfg.hidden_size)
    pieces = [ShardPlan(cfg, r, 2) for r in range(2)]
    qkv = [{} for _ in pieces]
    for plan, got in zip(pieces, qkv, strict=True):
        for lo, hi in ((0, q), (q, q + kv), (q + kv, q + 2 * kv)):
            index, part = plan.piece("layers.0.self_attn.qkv_proj.weight", (slice(lo, hi),), full[lo:hi])
            got[index[0].start] = part
    assert torch.equal(torch.cat([qkv[0][0], qkv[1][0]]), full[:q])  # query heads split
    assert torch.equal(torch.cat([qkv[0][16], qkv[1][16]]), full[q : q + kv])  # one KV head each
    assert torch.equal(torch.cat([qkv[0][24], qkv[1][24]]), full[q + kv :])
    emb = torch.randn(7, cfg.hidden_size)
    rows = [p.piece("embed_tokens.weight", (), emb)[1] for p in pieces]
    assert rows[1].shape[0] == 4 and torch.equal(rows[1][3], torch.zeros(cfg.hidden_size))  # padding
    assert torch.equal(torch.cat(rows)[:7], emb)
    down = torch.randn(cfg.hidden_size, cfg.intermediate_size)
    cols = [p.piece("layers.0.mlp.down_proj.weight", (), down)[1] for p in pieces]
    assert torch.equal(torch.cat(cols, 1), down)  # row-parallel: input columns split
    up = torch.randn(cfg.intermediate_size, cfg.hidden_size)
    inter = cfg.intermediate_size
    placed = [p.piece("layers.0.mlp.gate_up_proj.weight", (slice(inter, 2 * inter),), up) for p in pieces]
    assert [index for index, _ in placed] == [(slice(inter // 2, inter),)] * 2
    assert torch.equal(torch.cat([part for _, part in placed]), up)


def test_models_that_do_not_split_are_named() -> None:
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        check_shardable(config(), 3)
    with pytest.raises(ValueError, match="3 KV heads"):
        check_shardable(config(num_attention_heads=6, num_key_value_heads=3), 2)
    with pytest.raises(ValueError, match="intermediate size 250"):
        check_shardable(config(intermediate_size=250), 4)
    check_shardable(config(num_attention_heads=8, num_key_value_heads=1), 8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_the_edges_refuse_them_before_any_process_starts(stories_dir: str) -> None:
    with pytest.raises(ValueError, match="8 attention heads"):  # 8 heads, 4 KV heads
        LLM(stories_dir, device="cpu", tensor_parallel_size=3)
    with pytest.raises(StartupError, match="tensor_parallel_size 3 does not divide"):
        resolve(EngineConfig(model=stories_dir, tensor_parallel_size=3))


# -- TP=2 against TP=1 ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("llama", dict(num_key_value_heads=1)),  # GQA: one KV head for two ranks
        ("qwen2", {}),  # q/k/v biases, sharded with their rows
        ("mistral", dict(sliding_window=16)),
        ("mixtral", {}),  # every expert split along its intermediate dim
        ("qwen2_moe", {}),  # a dense layer, a sparse one with a shared expert
    ],
)
def test_tp2_matches_tp1(tiny_model, kind: str, overrides: dict[str, object]) -> None:
    assert_same(tiny_model(kind, **overrides)).engine.close()


@pytest.mark.slow
def test_tp2_matches_tp1_on_stories260k(stories_dir: str) -> None:
    tp = assert_same(stories_dir)
    # One step of 1000 prompt tokens: a plan too large to travel inside the header's broadcast.
    prompts = [[1, *range(3 + i, 203 + i)] for i in range(5)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    base = LLM(stories_dir, device="cpu", dtype="float32", max_num_batched_tokens=1024)
    big = LLM(stories_dir, device="cpu", dtype="float32", max_num_batched_tokens=1024, tensor_parallel_size=2)
    assert [o.token_ids for o in big.generate(prompts, params)] == [
        o.token_ids for o in base.generate(prompts, params)]
    assert big.engine.step_count == 3
    tp.engine.close()
    big.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tp2_verifies_speculative_proposals_in_its_step(stories_dir: str, method: str) -> None:
    """Verification chunks ride the one step plan; only rank 0 proposes (and holds the draft)."""
    prompts = ["Once upon a time, there was a little girl. Once upon a time, there", "The cat sat. The cat"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    base = LLM(stories_dir, device="cpu", dtype="float32")
    want = [o.token_ids for o in base.generate(prompts, params)]
    tp = LLM(stories_dir, device="cpu", dtype="float32", tensor_parallel_size=2, speculative_method=method,
             draft_model=stories_dir if method == "draft" else None, speculative_adaptive=False)
    assert [o.token_ids for o in tp.generate(prompts, params)] == want
    assert tp.engine.stats()["spec_accepted_tokens"] > 0
    tp.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_tp2_matches_tp1_with_quantized_kv_cache_and_prefix_caching(tiny_model, kv_cache_dtype: str) -> None:
    # A key one ulp apart (the rank's matmul sums in another order) may round to the next code.
    tp = assert_same(tiny_model("llama", num_key_value_heads=1), atol=1e-3, kv_cache_dtype=kv_cache_dtype)
    again, _ = generate(tp)  # the prompts' pages come from the prefix cache now
    assert again == generate(tp)[0]
    assert tp.engine.stats()["prefix_cache_hits"] > 0
    tp.engine.close()


@pytest.mark.slow
def test_tp2_w8a8_stays_close_to_tp1(tiny_model) -> None:
    """W8A8 shards its scales with its weights (per-output-channel scales split with the
    column-parallel rows); the row-parallel down_proj quantizes its input per token over the rank's
    slice, so TP=2 differs from TP=1 by quantization error only."""
    model = tiny_model("llama", num_key_value_heads=1)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = LLM(model, device="cpu", dtype="float32", quantization="w8a8-int8", tensor_parallel_size=tp,
                  step_executor="eager")
        runs.append(llm.generate(PROMPTS, params))
        llm.engine.close()
    for one, two in zip(*runs, strict=True):
        assert one.token_ids == two.token_ids
        assert abs(one.logprobs[0]["logprob"] - two.logprobs[0]["logprob"]) < 0.05


def prompt_logprobs(tiny_model, tp: int) -> list[tuple[list[int], Any]]:
    """Chunked prefills where some requests ask for prompt logprobs: steps that read out sampled and
    prompt rows together, prompt rows alone, and every row."""
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", tensor_parallel_size=tp, page_size=4,
              max_num_batched_tokens=4)
    prompts = [[1, 5, 9, 13, 2, 7, 30, 31, 4, 11, 19, 3, 8], [1, 40, 41], [1, 6]]
    outs = [llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                               prompt_logprobs=k))[0]
            for ids, k in zip(prompts, (3, None, 2), strict=True)]
    together = llm.generate(prompts, [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                     prompt_logprobs=k) for k in (3, None, 2)])
    llm.engine.close()
    return [(o.token_ids, o.prompt_logprobs) for o in outs + together]


@pytest.mark.slow
def test_tp2_prompt_logprobs_match_tp1(tiny_model) -> None:
    """Prompt rows read out beside the sampled ones take one logits pass (a collective every rank
    joins), so TP=2 scores the prompt as TP=1 does."""
    for (ids1, lp1), (ids2, lp2) in zip(prompt_logprobs(tiny_model, 1), prompt_logprobs(tiny_model, 2),
                                        strict=True):
        assert ids1 == ids2
        assert (lp1 is None) == (lp2 is None)
        if lp1 is not None:
            assert lp1[0] is None and lp2[0] is None and len(lp1) == len(lp2) > 1
            assert [list(e["top"]) for e in lp1[1:]] == [list(e["top"]) for e in lp2[1:]]
            want, got = ([e["logprob"] for e in lp[1:]] for lp in (lp1, lp2))
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)


# -- lifetime ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dropping_the_llm_stops_its_workers(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", tensor_parallel_size=2, num_pages=32)
    pids = workers_of(llm)
    assert all(alive(p) for p in pids)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    del llm
    gc.collect()
    wait_gone(pids)


# -- a rank that fails -----------------------------------------------------------------------------
# Ranks' targets: spawned interpreters import them from this module.
def raising_rank(config: EngineConfig, rank: int, world: int, port: int, threads: int, pipe: Any) -> None:
    """A rank whose start fails with an error of its own (a missing file, no memory, a bug...)."""
    from pipeserve.engine.parallel import group

    try:
        raise ValueError(f"rank {rank} cannot load its shard")
    except ValueError:
        group.report_failure(pipe)
        raise


def killed_rank(config: EngineConfig, rank: int, world: int, port: int, threads: int, pipe: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def rank_raising_on_its_first_step(config: EngineConfig, rank: int, world: int, port: int, threads: int,
                                   pipe: Any) -> None:
    """The real rank, whose runner raises once the first step's plan has arrived."""
    from pipeserve.engine.parallel import worker

    class Raising(worker.RankRunner):
        def run(self) -> None:
            assert self.receiver.receive() is not None
            raise RuntimeError("rank 1's forward pass broke")

    worker.RankRunner = Raising  # type: ignore[misc]  # this interpreter is the rank's own
    worker.main(config, rank, world, port, threads, pipe)


@pytest.mark.slow
@pytest.mark.parametrize("target,error", [
    (raising_rank, r"rank 1 failed:\n.*ValueError: rank 1 cannot load its shard"),
    (killed_rank, r"rank 1 \(pid \d+\) was killed by SIGKILL"),
])
def test_a_rank_that_fails_to_start_fails_the_engine_with_its_error(
        tiny_model, monkeypatch: pytest.MonkeyPatch, target: Any, error: str) -> None:
    from pipeserve.engine.parallel import worker
    from pipeserve.engine.parallel.group import RankFailed

    monkeypatch.setattr(worker, "main", target)  # what the engine spawns
    with pytest.raises(RankFailed, match=f"(?s){error}"):
        LLM(tiny_model("llama"), device="cpu", dtype="float32", tensor_parallel_size=2, num_pages=32)


NO_MAIN_GUARD = """
import sys
from pipeserve.engine import LLM
LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2, num_pages=32)
print("started")
"""


@pytest.mark.slow
def test_a_script_without_a_main_guard_raises_instead_of_hanging(tiny_model, tmp_path: Path) -> None:
    """The spawned rank re-imports the script, which starts an engine while it bootstraps: the rank
    exits before it joins, and the script's engine raises (the test's timeout stands for a hang)."""
    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD)
    done = subprocess.run([sys.executable, str(script), tiny_model("llama")], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 1 and "started" not in done.stdout
    last = done.stderr.strip().splitlines()[-2:]
    assert last[0].startswith("pipeserve.engine.parallel.group.RankFailed: tensor-parallel rank 1"), last
    assert 'if __name__ == "__main__":' in last[1]


@pytest.mark.slow
def test_a_rank_killed_mid_generation_fails_the_next_step_with_its_error(tiny_model) -> None:
    """Not a hang: the engine process then exits, and its supervisor restarts it with new ranks."""
    from pipeserve.engine.parallel.group import RankFailed

    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", tensor_parallel_size=2, num_pages=32)
    engine = llm.engine
    engine.add("r", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a decode step
    assert engine.tp is not None and engine.tp.ranks is not None
    (rank,) = engine.tp.ranks.procs
    os.kill(rank.pid, signal.SIGKILL)
    rank.join()
    with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        engine.step()
    engine.close()  # nothing left to stop, and no error


@pytest.mark.slow
def test_a_rank_raising_mid_step_fails_the_step_with_its_error(tiny_model,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeserve.engine.parallel import worker
    from pipeserve.engine.parallel.group import RankFailed

    monkeypatch.setattr(worker, "main", rank_raising_on_its_first_step)
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", tensor_parallel_size=2, num_pages=32)
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed:\n.*RuntimeError: rank 1's forward pass broke"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    llm.engine.close()


SCRIPT = """
import sys, time
from pipeserve.engine import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2, num_pages=32)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    print(*[p.pid for p in llm.engine.tp.ranks.procs], flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_workers_never_outlive_their_engine_process(tiny_model, tmp_path: Path, end: str) -> None:
    """The interpreter exiting (no close) or rank 0 killed outright: the workers exit too."""
    script = tmp_path / "rank0.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), tiny_model("llama"), "wait" if end == "sigkill" else ""]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(alive(p) for p in pids)
        if end == "sigkill":
            proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) in (0, -signal.SIGKILL)
        wait_gone(pids)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_pipeserve_up_serves_with_two_ranks_and_restarts_the_engine_when_one_dies(stories_dir: str,
                                                                                   tmp_path: Path) -> None:
    prompt = [1, 403, 407, 261, 378, 302]
    want = LLM(stories_dir, device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids

    def ranks_of(engine: int) -> list[int]:
        """The engine's spawned children that run a rank (not multiprocessing's resource tracker)."""
        children = subprocess.run(["pgrep", "-P", str(engine)], capture_output=True, text=True).stdout.split()
        return [int(p) for p in children if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]

    with LocalCluster(tmp_path / "up.log", stories_dir, "--tensor-parallel-size", "2", "--dtype", "float32",
                      "--kv-cache-gb", "0.02", workers=1, startup=120) as cluster:
        (engine,) = cluster.pids("engine")
        out = cluster.client.generate(prompt, timeout=60, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert out.token_ids == want
        (rank,) = ranks_of(engine)
        os.kill(rank, signal.SIGKILL)
        wait_gone([rank])
        # The next step fails with the rank's error: that request ends, the engine process exits...
        with pytest.raises(grpc.RpcError):
            cluster.client.generate(prompt, timeout=60, max_tokens=12, temperature=0.0, ignore_eos=True)
        # ... and the launcher starts a new one, with a new rank, that serves the same tokens.
        cluster.wait(lambda: cluster.pids("engine") not in ([], [engine]), 60, "a restarted engine")
        cluster.client.wait_ready(timeout=180)
        out = cluster.client.generate(prompt, timeout=60, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert out.token_ids == want
        assert f"RankFailed: tensor-parallel rank 1 (pid {rank}) was killed by SIGKILL" in cluster.tail(400)
        ranks = ranks_of(cluster.pids("engine")[0])
        assert ranks and rank not in ranks
    wait_gone([engine, *ranks])
