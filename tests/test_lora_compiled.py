"""LoRA adapters in the compiled steps (executor/padded.py, inductor.py, cuda_graph.py): each row's
adapter slot is a staged input of the compiled forward pass and the LoRA layers apply it with fixed
shapes (the backend's add_lora_slots), so the Inductor step on the CPU gives the eager LoRA engine's
greedy tokens (fp32) in steps mixing adapters and the base, and swaps between steps (more adapters
than slots) need no recompile. The device test runs the same on $PIPESERVE_TEST_DEVICE: CUDA graphs
captured with the adapters on a GPU (the Inductor step on the CPU)."""

from __future__ import annotations

import pytest
import torch

from pipeserve import LLM, LoRARequest, SamplingParams
from pipeserve.engine.backend import get_backend
from pipeserve.engine.executor.cuda_graph import CudaGraphStep
from pipeserve.engine.executor.inductor import InductorStep
from pipeserve.engine.executor.select import StepPlan, choose
from tests.conftest import TEST_DEVICE
from tests.lora_adapters import ATTENTION, build_adapter, mixed_adapters, mixed_workload

OPTIONS = dict(dtype="float32", page_size=4, enable_lora=True, max_lora_rank=16)


@pytest.fixture(scope="module")
def llama_adapters(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[LoRARequest]]:
    model_dir = tiny_model("llama")
    return model_dir, mixed_adapters(model_dir, str(tmp_path_factory.mktemp("compiled-lora")), seed=40)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (a recompile, or a silent fall back, changes it)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def recorded_steps(llm: LLM) -> list[tuple[int, frozenset[int]]]:
    """(rows, the adapter slots of its rows: -1 for the base) of every step the engine runs through
    its compiled step, appended as it runs."""
    executor = llm.engine.runner.executor
    manager = llm.engine.lora
    assert executor.mode in ("inductor", "cuda-graph") and manager is not None
    steps, run = [], executor.run

    def recorded(flat):
        steps.append((flat.num_rows, frozenset(int(s) for s in manager.request_slots[flat.row_slots])))
        return run(flat)

    executor.run = recorded  # type: ignore[method-assign]
    return steps


def generate(llm: LLM, prompts, params, loras) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, lora_request=loras)]


def workload(requests: list[LoRARequest]) -> tuple[list[list[int]], list[SamplingParams], list]:
    """Eight requests over three adapters and the base, of different lengths, four at a time: decode
    steps of 1 to 4 rows (buckets 1, 2 and 4, padded rows among them) mixing them."""
    return mixed_workload(requests, seed=11)


@pytest.mark.slow
def test_compiled_lora_steps_equal_eager_fp32(llama_adapters) -> None:
    """The Inductor step with three adapters and the base in one step, and steps of padded buckets:
    every request's greedy tokens are the eager LoRA engine's."""
    model_dir, requests = llama_adapters
    prompts, params, loras = workload(requests)
    options = dict(device="cpu", max_num_seqs=4, max_loras=3, **OPTIONS)
    expected = generate(LLM(model_dir, step_executor="eager", **options), prompts, params, loras)
    base = generate(LLM(model_dir, step_executor="eager", **options), prompts, params, [None] * len(prompts))
    assert all(e != b for e, b, r in zip(expected, base, loras, strict=True) if r is not None)
    llm = LLM(model_dir, step_executor="compiled", **options)
    assert isinstance(llm.engine.runner.executor, InductorStep)
    steps = recorded_steps(llm)
    assert generate(llm, prompts, params, loras) == expected
    assert llm.engine.stats()["pages_used"] == 0
    assert any(len(s - {-1}) == 3 and -1 in s for _, s in steps)  # three adapters and the base
    assert {rows for rows, _ in steps} >= {2, 3, 4}  # buckets 2 and 4, a padded row in 4


@pytest.mark.slow
def test_swaps_between_compiled_steps_without_recompiling(llama_adapters) -> None:
    """Four adapters through two slots: each swap rewrites a slot in place between compiled steps, the
    next step reads the new adapter, every request gets the tokens of its adapter alone, and no bucket
    compiles again (the slot table and the rows' slots are inputs of the compiled graphs)."""
    model_dir, requests = llama_adapters
    prompt = [1, 43, 107, 61, 78, 30, 9]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = LLM(model_dir, device="cpu", step_executor="eager", max_loras=1, **OPTIONS)
    expected = [generate(alone, [prompt], [params], [r])[0] for r in requests]
    assert len({tuple(e) for e in expected}) == len(requests)  # each adapter its own tokens
    llm = LLM(model_dir, device="cpu", step_executor="compiled", max_loras=2, max_cpu_loras=4, max_num_seqs=2,
              **OPTIONS)
    executor = llm.engine.runner.executor
    assert isinstance(executor, InductorStep)
    llm.engine.runner.warm_up(every_bucket=True)  # buckets 1 and 2, before any adapter is in a slot
    graphs, buckets = compiled_graphs(), set(executor._steps)
    steps = recorded_steps(llm)
    loras = [*requests, *requests[::-1]]
    assert generate(llm, [prompt] * len(loras), [params] * len(loras), loras) == expected + expected[::-1]
    assert llm.engine.stats()["lora_swaps"] >= 4
    assert any(len(s - {-1}) == 2 for _, s in steps)  # two adapters in one compiled step
    assert compiled_graphs() == graphs and set(executor._steps) == buckets == {1, 2}


@pytest.mark.slow
def test_verification_rows_with_the_adapter_in_compiled_steps(llama_adapters) -> None:
    """n-gram speculation (k = 2, batch 1: buckets 1, 2 and 3): the verification rows run as compiled
    decode rows, each with its request's adapter; the tokens are the eager engine's without
    speculation, and proposals were accepted."""
    model_dir, requests = llama_adapters
    prompts = [[5, 17, 99, 3, 42, 5, 17, 99, 3, 42, 5, 17], [7, 8, 9, 7, 8, 9, 7]]
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)] * 2
    loras = [requests[1], requests[0]]
    options = dict(device="cpu", max_num_seqs=1, max_loras=1, **OPTIONS)
    expected = generate(LLM(model_dir, step_executor="eager", **options), prompts, params, loras)
    llm = LLM(model_dir, step_executor="compiled", speculative_method="ngram", prompt_lookup_min=1,
              num_speculative_tokens=2, speculative_adaptive=False, **options)
    executor = llm.engine.runner.executor
    verified, run = [], executor.run

    def recorded(flat):
        verified.append(flat.num_verify_rows)
        return run(flat)

    executor.run = recorded  # type: ignore[method-assign]
    assert generate(llm, prompts, params, loras) == expected
    assert any(verified) and llm.engine.stats()["spec_accepted_tokens"] > 0


@pytest.mark.slow
def test_mixture_of_experts_with_graph_breaks(tiny_model, tmp_path) -> None:
    """A mixture of experts compiles with graph breaks around the expert dispatch (whose frames are
    specialized on the per-expert row counts, adapters or not): the rows' slots still reach every
    attention layer's adapter (attention-only adapters) across the breaks, in two batches with the
    adapters on other rows, and the tokens are the eager engine's."""
    model_dir = tiny_model("qwen2_moe")
    requests = []
    for i in range(2):
        build_adapter(model_dir, str(tmp_path / f"a{i}"), 8, ATTENTION, seed=5 + i)
        requests.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
    prompts = [[5, 17, 99, 3, 42], [7, 8, 9, 7], [1, 2, 3]]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3
    options = dict(device="cpu", max_num_seqs=4, max_loras=2, **OPTIONS)
    eager = LLM(model_dir, step_executor="eager", **options)
    batches = [[requests[0], None, requests[1]], [requests[1], requests[0], None]]
    expected = [generate(eager, prompts, params, loras) for loras in batches]
    assert expected[0] != generate(eager, prompts, params, [None] * 3)
    llm = LLM(model_dir, step_executor="compiled", **options)
    executor = llm.engine.runner.executor
    assert isinstance(executor, InductorStep) and not executor.whole_graph
    for loras, want in zip(batches, expected, strict=True):
        assert generate(llm, prompts, params, loras) == want


@pytest.mark.slow
@pytest.mark.parametrize("method", ["w8a8-int8", "w4a16"])
def test_adapters_over_quantized_weights_compiled(llama_adapters, method: str) -> None:
    """Quantized base weights, which `auto` compiles with Inductor on the CPU (the native step runs
    none): the adapters' deltas added after the quantized products in compiled steps give the eager
    engine's tokens, with two adapters and the base in a step."""
    model_dir, requests = llama_adapters
    prompts = [[5, 17, 99, 3, 42], [7, 8, 9, 7], [1, 2, 3]]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3
    loras = [requests[1], None, requests[0]]
    options = dict(device="cpu", max_num_seqs=4, max_loras=2, quantization=method, **OPTIONS)
    expected = generate(LLM(model_dir, step_executor="eager", **options), prompts, params, loras)
    llm = LLM(model_dir, **options)
    assert isinstance(llm.engine.runner.executor, InductorStep)
    steps = recorded_steps(llm)
    assert generate(llm, prompts, params, loras) == expected
    assert any(len(s - {-1}) == 2 and -1 in s for _, s in steps)


def test_auto_compiles_lora_steps_where_the_native_step_cannot_run(llama_adapters) -> None:
    """`auto` with LoRA: the native step where it runs the model, else the compiled step (an fp16
    model on the CPU: Inductor), as without LoRA; `compiled` is honoured. The reasons say so."""
    model_dir, _ = llama_adapters
    cpu, backend = torch.device("cpu"), get_backend("cpu")
    auto, compiled = (StepPlan(requested=r, max_rows=4) for r in ("auto", "compiled"))
    threads = torch.get_num_threads()
    for dtype, mode, why in [
        ("float16", "inductor", "native step: the KV cache is neither fp32 nor bf16"),
        ("float32", "native", f"dense float32 LlamaForCausalLM, {threads} threads"),
    ]:
        engine = LLM(model_dir, device="cpu", dtype=dtype, step_executor="eager", enable_lora=True,
                     num_pages=16).engine
        assert choose(auto, backend, engine.model, engine.pool, cpu) == (mode, why)
        assert choose(compiled, backend, engine.model, engine.pool, cpu) == ("inductor", "requested")


class ReplayedGraph:
    """A captured CUDA graph's stand-in on the CPU: replay reruns the captured forward pass over the
    very tensors it was captured with (the persistent buffers, which a graph reads at fixed addresses)
    into the output tensor of the capture, as a graph's replay writes its static output."""

    def __init__(self, forward, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        self.forward, self.args, self.out = forward, args, out
        self.replays = 0

    def replay(self) -> None:
        self.out.copy_(self.forward(*self.args))
        self.replays += 1


class CpuGraphs(CudaGraphStep):
    """The CUDA-graph executor with its capture replaced by ReplayedGraph (its buckets, padding, staged
    inputs and capture order are the real ones)."""

    def _capture(self, args: tuple[torch.Tensor, ...]) -> tuple[ReplayedGraph, torch.Tensor]:
        out = self.forward(*args)
        return ReplayedGraph(self.forward, args, out), out


@pytest.mark.slow
def test_cuda_graph_path_with_the_triton_kernels_on_the_cpu(llama_adapters, monkeypatch) -> None:
    """The CUDA-graph executor's path with LoRA, on the CPU: every bucket captured before serving
    with no adapter in any slot, then replayed over the persistent buffers with each step's slots,
    the Triton backend's add_lora_slots (BGMV under the interpreter) in every layer. Steps mixing
    two adapters and the base, four adapters through two slots: the eager Triton engine's tokens."""
    model_dir, requests = llama_adapters
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    prompt = [1, 43, 107, 61, 78, 30, 9]
    prompts = [prompt, prompt[:4], prompt, prompt[2:], prompt, prompt[1:]]
    loras = [requests[0], requests[1], None, requests[2], requests[3], requests[0]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * len(prompts)
    options = dict(device="cpu", backend="triton", step_executor="eager", max_loras=2, max_cpu_loras=4,
                   max_num_seqs=3, **OPTIONS)
    expected = generate(LLM(model_dir, **options), prompts, params, loras)
    llm = LLM(model_dir, **options)
    runner = llm.engine.runner
    graphs = CpuGraphs(model=runner.model, pool=runner.pool, buffers=runner.buffers, max_rows=3, max_batch=3,
                       lora=runner.lora)
    graphs.prepare()
    assert sorted(graphs._graphs) == [1, 2, 3]
    runner.executor = graphs
    steps = recorded_steps(llm)
    assert generate(llm, prompts, params, loras) == expected
    assert any(len(s - {-1}) == 2 and -1 in s for _, s in steps)
    # prepare() replays each bucket once after capturing it; serving only replays.
    assert sum(g.replays for g, _ in graphs._graphs.values()) == len(steps) + 3 > 3
    assert llm.engine.stats()["lora_swaps"] >= 4


@pytest.mark.slow
@pytest.mark.device
def test_compiled_lora_steps_equal_eager_on_the_test_device(llama_adapters) -> None:
    """On a GPU ($PIPESERVE_TEST_DEVICE=cuda): CUDA graphs captured with the adapters' fixed-shape
    Triton BGMV kernels, every bucket before serving, replayed with each step's slots, give the eager
    Triton engine's tokens; on the CPU the Inductor step does. Two adapters and the base per step,
    four adapters through two slots (swaps between replays)."""
    model_dir, requests = llama_adapters
    prompt = [1, 43, 107, 61, 78, 30, 9]
    prompts = [prompt, prompt[:4], prompt, prompt[2:], prompt, prompt[1:]]
    loras = [requests[0], requests[1], None, requests[2], requests[3], requests[0]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    options = dict(device=TEST_DEVICE, max_loras=2, max_cpu_loras=4, max_num_seqs=3, **OPTIONS)
    expected = generate(LLM(model_dir, step_executor="eager", **options), prompts, [params] * 6, loras)
    llm = LLM(model_dir, step_executor="compiled", **options)
    assert llm.engine.runner.executor.mode == ("inductor" if TEST_DEVICE == "cpu" else "cuda-graph")
    steps = recorded_steps(llm)
    assert generate(llm, prompts, [params] * 6, loras) == expected
    assert any(len(s - {-1}) == 2 and -1 in s for _, s in steps)
    assert llm.engine.stats()["lora_swaps"] >= 4 and llm.engine.stats()["pages_used"] == 0
