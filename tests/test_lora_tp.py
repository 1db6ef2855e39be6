"""LoRA adapters with tensor parallelism on the CPU (gloo): each rank's adapter factors are cut the way
its base layers are (the rank's delta weight is its shard of the full delta weight, so the row-parallel
partial deltas sum to the full delta once), the slot writes travel with the step plan, and TP=2 gives
the greedy tokens of TP=1 with the same random PEFT adapters (fp32, logprobs within 1e-4): a step
mixing two adapters and the base, and more adapters than slots (swaps on every rank) through chunked
prefill, mixed batches and preemption, n-gram proposals verified with an adapter, on stories260K and
on a tiny Llama whose one KV head both ranks share."""

from __future__ import annotations

import os

import pytest
import torch

from pipeserve import LLM, LoRARequest, SamplingParams
from pipeserve.engine.lora.layout import DOWN, GATE_UP, KINDS, OUT, QKV, fused_shapes
from pipeserve.engine.lora.shard import LoRAShard
from pipeserve.engine.lora.slots import SlotTable
from pipeserve.engine.lora.tensor_parallel import pack, unpack
from pipeserve.model_config import ModelConfig
from tests.lora_adapters import ALL_LINEAR, ATTENTION, build_adapter

MLP_AND_O = ["gate_proj", "down_proj", "o_proj"]  # row-parallel projections and half of a fused one
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
PROMPTS = [[1, 43, 107, 61, 78, 30], [1, 70, 80, 90, 100], [1, 5, 9, 200, 17, 33, 64, 12, 7, 21]]


def config(**overrides: object) -> ModelConfig:
    from tests.models import BASE

    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **BASE, **overrides})


# -- sharding, without processes ----------------------------------------------------------------
def expected_weight_shard(cfg: ModelConfig, kind: str, full: torch.Tensor, rank: int,
                          world: int) -> torch.Tensor:
    """The rank's part of a full [out, in] weight of `kind`, as the base layers split theirs: query heads
    by rank, the KV heads the rank's query heads read, gate and up slices; o and down by input."""
    q, kv, d, inter = cfg.q_size, cfg.kv_size, cfg.head_dim, cfg.intermediate_size
    lq, li = q // world, inter // world
    kv_heads = max(1, cfg.num_kv_heads // world)
    kv_start = rank * kv_heads if cfg.num_kv_heads >= world else rank * cfg.num_kv_heads // world
    if kind == QKV:
        k0 = q + kv_start * d
        return torch.cat([full[rank * lq : (rank + 1) * lq], full[k0 : k0 + kv_heads * d],
                          full[k0 + kv : k0 + kv + kv_heads * d]])
    if kind == GATE_UP:
        up = inter + rank * li
        return torch.cat([full[rank * li : (rank + 1) * li], full[up : up + li]])
    size = lq if kind == OUT else li
    return full[:, rank * size : (rank + 1) * size]


@pytest.mark.parametrize("kv_heads", [2, 1])  # one KV head per rank; one KV head both ranks keep
def test_each_rank_holds_its_shard_of_the_delta_weight(kv_heads: int) -> None:
    cfg = config(num_key_value_heads=kv_heads)
    world, rank_r = 2, 3
    torch.manual_seed(0)
    for kind in KINDS:
        shape = fused_shapes(cfg)[kind]
        n = len(shape.subs) * rank_r
        a, b = torch.randn(shape.d_in, n), torch.randn(n, shape.d_out)  # A^T, B
        delta = (a @ b).t()  # [out, in], as the base weight
        parts = []
        for rank in range(world):
            shard = LoRAShard(cfg, rank, world)
            local = fused_shapes(shard.local)[kind]
            dst = torch.full((local.d_in, n), float("nan")), torch.full((n, local.d_out), float("nan"))
            shard.copy(0, kind, dst, (a, b))
            got = (dst[0] @ dst[1]).t()
            assert torch.allclose(got, expected_weight_shard(cfg, kind, delta, rank, world), atol=1e-5), kind
            parts.append(dst)
        if kind in (OUT, DOWN):  # row-parallel: the ranks' partial deltas of an input sum to the full one
            x = torch.randn(5, shape.d_in)
            xs = x.chunk(world, dim=1)
            total = sum(xr @ ar @ br for xr, (ar, br) in zip(xs, parts, strict=True))
            assert torch.allclose(total, x @ a @ b, atol=1e-4)


def test_slot_loads_pack_and_unpack() -> None:
    cfg = config()
    table = SlotTable(cfg, 2, 4, torch.float32, torch.device("cpu"), LoRAShard(cfg, 1, 2))
    shapes = fused_shapes(cfg)
    factors = {}
    for key in [(0, QKV), (1, DOWN), (1, GATE_UP)]:
        n = len(shapes[key[1]].subs) * 4
        factors[key] = (torch.randn(shapes[key[1]].d_in, n), torch.randn(n, shapes[key[1]].d_out))
    o_proj = {(1, OUT): (torch.randn(cfg.q_size, 4), torch.randn(4, cfg.hidden_size))}
    loads = pack(table, [(1, 7, factors), (0, 9, o_proj)], torch.device("cpu"))
    (slot, adapter_id, got), (slot2, id2, got2) = unpack(table, loads, torch.float32)
    assert (slot, adapter_id, slot2, id2) == (1, 7, 0, 9)
    assert got.keys() == factors.keys() and list(got2) == [(1, OUT)]
    for key, (a, b) in factors.items():
        assert torch.equal(got[key][0], a) and torch.equal(got[key][1], b)
    table.load_factors(slot, adapter_id, got)
    assert table.kinds[1] == {QKV, DOWN, GATE_UP} and table.ids[1] == 7
    assert not table.tables[(0, OUT)][0][1].any()  # kinds it does not target are zero


# -- TP=2 against TP=1 ----------------------------------------------------------------------------
# Each starts a TP=2 group (a rank process over gloo): `slow`, with the other TP=2 runs.
def adapters(model_dir: str, tmp: str, specs: list[tuple[int, list[str]]]) -> list[LoRARequest]:
    out = []
    for i, (rank, targets) in enumerate(specs):
        path = os.path.join(tmp, f"adapter{i}")
        build_adapter(model_dir, path, rank, targets, seed=i)
        out.append(LoRARequest(f"adapter{i}", i + 1, path))
    return out


def run(llm: LLM, prompts: list[list[int]],
        loras: list[LoRARequest | None]) -> tuple[list[list[int]], torch.Tensor]:
    outs = llm.generate(prompts, PARAMS, lora_request=loras)
    assert llm.engine.stats()["pages_used"] == 0
    logprobs = torch.tensor([[lp["logprob"] for lp in o.logprobs or []] for o in outs])
    return [o.token_ids for o in outs], logprobs


def assert_same(model_dir: str, prompts: list[list[int]], loras: list[LoRARequest | None],
                **options: object) -> tuple[LLM, LLM]:
    """TP=2 against TP=1 (both eager, as TP=2 steps run) on the same options; both LLMs, running."""
    base = LLM(model_dir, device="cpu", dtype="float32", step_executor="eager", enable_lora=True,
               max_lora_rank=16, **options)
    want_ids, want_lps = run(base, prompts, loras)
    tp = LLM(model_dir, device="cpu", dtype="float32", tensor_parallel_size=2, enable_lora=True,
             max_lora_rank=16, **options)
    got_ids, got_lps = run(tp, prompts, loras)
    assert got_ids == want_ids
    assert torch.allclose(got_lps, want_lps, atol=1e-4, rtol=0)
    # The adapters matter: a prompt's tokens differ with each adapter and the base (mix's order).
    k = len(prompts) // len(PROMPTS)
    assert all(len({tuple(ids) for ids in want_ids[i : i + k]}) == k for i in range(0, len(prompts), k))
    return base, tp


def mix(requests: list[LoRARequest | None]) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Every prompt with every adapter (and the base)."""
    pairs = [(p, r) for p in PROMPTS for r in requests]
    return [p for p, _ in pairs], [r for _, r in pairs]


@pytest.mark.slow
def test_tp2_step_mixing_two_adapters_and_the_base(stories_dir: str, tmp_path) -> None:
    """Rank 16 all-linear and rank 8 MLP + o_proj (row-parallel) adapters and the base in every step."""
    requests = adapters(stories_dir, str(tmp_path), [(16, ALL_LINEAR), (8, MLP_AND_O)])
    prompts, loras = mix([*requests, None])
    base, tp = assert_same(stories_dir, prompts, loras, max_loras=2, num_pages=128)
    # One prefill step, then a decode step per token: every row ran in the same steps.
    assert tp.engine.step_count == base.engine.step_count == PARAMS.max_tokens
    assert tp.engine.stats()["lora_swaps"] == 2
    tp.engine.close()


@pytest.mark.slow
def test_tp2_more_adapters_than_slots(stories_dir: str, tmp_path) -> None:
    """Three adapters through two slots, with chunked prefill beside decode rows and preemption: slots are
    rewritten between steps on every rank."""
    requests = adapters(stories_dir, str(tmp_path), [(8, ATTENTION), (16, ALL_LINEAR), (8, MLP_AND_O)])
    prompts, loras = mix([*requests, None])
    pressure = dict(page_size=4, num_pages=10, max_num_batched_tokens=12, max_num_seqs=4)
    base, tp = assert_same(stories_dir, prompts, loras, max_loras=2, **pressure)
    stats = tp.engine.stats()
    assert stats["lora_swaps"] == base.engine.stats()["lora_swaps"] > 2
    assert stats["preemptions"] == base.engine.stats()["preemptions"] > 0
    tp.engine.close()


@pytest.mark.slow
def test_tp2_shared_kv_head(tiny_model, tmp_path) -> None:
    """One KV head, kept by both ranks: each rank's k/v columns of B are that head's."""
    model_dir = tiny_model("llama", num_key_value_heads=1)
    requests = adapters(model_dir, str(tmp_path), [(8, ALL_LINEAR), (16, ["k_proj", "v_proj", "up_proj"])])
    prompts, loras = mix([*requests, None])
    _, tp = assert_same(model_dir, prompts, loras, max_loras=2, num_pages=64)
    tp.engine.close()


@pytest.mark.slow
def test_tp2_verifies_ngram_proposals_with_the_adapter(stories_dir: str, tmp_path) -> None:
    """Verification rows are gathered rows before the prefill chunks: the adapter's tokens, as without
    speculation."""
    (request,) = adapters(stories_dir, str(tmp_path), [(8, ALL_LINEAR)])
    prompts = ["Once upon a time, there was a little girl. Once upon a time, there", "The cat sat. The cat"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    base = LLM(stories_dir, device="cpu", dtype="float32", step_executor="eager", enable_lora=True)
    want = [o.token_ids for o in base.generate(prompts, params, lora_request=request)]
    assert want != [o.token_ids for o in base.generate(prompts, params)]
    tp = LLM(stories_dir, device="cpu", dtype="float32", tensor_parallel_size=2, enable_lora=True,
             speculative_method="ngram", speculative_adaptive=False)
    assert [o.token_ids for o in tp.generate(prompts, params, lora_request=request)] == want
    assert tp.engine.stats()["spec_accepted_tokens"] > 0
    tp.engine.close()
