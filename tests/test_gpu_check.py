"""`pipeserve gpu-check` on a host without a GPU: the command exits 2 with one line, its report (rows,
thresholds, gpu-check.json keys, markdown) and section runner (time limits, failures, isolation) work,
and the sections' own functions run on the CPU (Triton interpreted, tiny shapes) with every kernel
and engine check passing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from pipeserve.gpu_check import kernels, parity, quant, speed, sync
from pipeserve.gpu_check.environment import ceilings, environment
from pipeserve.gpu_check.models import build_tiny_model
from pipeserve.gpu_check.report import AGREEMENT, THRESHOLDS, CorrectnessRow, Report, SpeedRow
from pipeserve.gpu_check.runner import SECTIONS, Context, Section, run_sections
from tests.conftest import REPO

HERE = "tests.test_gpu_check"
# serial: sections run under time limits and a time budget, which a second worker beside them would eat.
pytestmark = pytest.mark.serial


# Sections for the runner tests (imported by the runner's child processes).
def good_section(ctx: Context) -> None:
    ctx.row(CorrectnessRow.measured("good", 1e-6, THRESHOLDS["fp32"]))
    ctx.row(SpeedRow("decode_b1_llama1b", 2.5, "ms/token", 80.0))


def slow_section(ctx: Context) -> None:
    ctx.row(SpeedRow("before the hang", 1.0, "s"))
    print("slow section: hanging", flush=True)  # the test's cue (stdout is the parent's)
    time.sleep(60)


def failing_section(ctx: Context) -> None:
    ctx.row(CorrectnessRow.measured("kept", 0.0, THRESHOLDS["bf16"]))
    raise RuntimeError("kernel launch failed: out of resources\nsecond line")


def ceiling_section(ctx: Context) -> None:
    ctx.emit("ceilings", {"copy_gbps": 3000.0, "bf16_tflops": 700.0})


def reads_ceilings(ctx: Context) -> None:
    ctx.row(SpeedRow("seen", ctx.ceilings["copy_gbps"], "GB/s"))


def test_without_cuda_it_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "pipeserve.cli", "gpu-check", "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stderr


def test_help_documents_out_and_quick():
    proc = subprocess.run([sys.executable, "-m", "pipeserve.cli", "gpu-check", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "--out" in proc.stdout and "gpu-check.json" in proc.stdout
    assert "--quick" in proc.stdout and "environment, kernel, parity and serving" in proc.stdout
    assert "--sections" in proc.stdout


def test_thresholds_as_stated():
    assert THRESHOLDS["fp32"] == 1e-4 and THRESHOLDS["tf32"] == 1e-3 and THRESHOLDS["bf16"] == 1e-2
    assert THRESHOLDS["int8"] == 1e-2 and THRESHOLDS["int8 twice"] == 2e-2 and THRESHOLDS["fp8"] == 7e-2
    assert CorrectnessRow.measured("x", 9e-5, 1e-4).passed
    assert not CorrectnessRow.measured("x", 2e-4, 1e-4).passed
    assert not CorrectnessRow.measured("x", math.nan, 1e-4).passed  # poison never passes
    assert not CorrectnessRow.measured("x", math.inf, 1e-4).passed
    assert CorrectnessRow.check("y", True).passed and not CorrectnessRow.check("y", False).passed


def test_report_json_markdown_and_exit_status(tmp_path):
    report = Report()
    for record in [
        {"kind": "environment", "data": {"gpu": "H100", "torch": "2.11", "triton": "3.6.0", "cuda": "13.0"}},
        {"kind": "ceilings", "data": {"copy_gbps": 3000.0, "bf16_tflops": 700.0}},
        {"kind": "correctness", "data": {"name": "kernel a", "passed": True, "error": 1e-6,
                                         "threshold": 1e-4, "detail": ""}},
        {"kind": "speed", "data": {"name": "decode_b1_llama8b", "value": 7.1, "unit": "ms/token",
                                   "pct_of_floor": 82.5, "detail": "a | b"}},
    ]:
        report.add(record)
    assert report.exit_status() == 0
    report.correctness.append(CorrectnessRow.measured("kernel b", 0.5, 1e-2))
    assert report.exit_status() == 1 and [r.name for r in report.failed] == ["kernel b"]
    json_path, md_path = report.write(tmp_path / "out")
    doc = json.loads(json_path.read_text())
    assert set(doc) == {"environment", "ceilings", "correctness", "speed", "sections"}
    assert {"gpu", "torch", "triton", "cuda"} <= set(doc["environment"])
    assert set(doc["ceilings"]) == {"copy_gbps", "bf16_tflops"}
    assert {"name", "passed", "error", "threshold"} <= set(doc["correctness"][0])
    assert doc["speed"][0]["pct_of_floor"] == 82.5  # a percentage, not a fraction
    assert {"name", "value", "unit", "pct_of_floor"} <= set(doc["speed"][0])
    md = md_path.read_text()
    assert "| kernel b | FAIL | 0.5 | 0.01 |" in md and "a \\| b" in md and "## Sections" in md


@pytest.mark.slow  # a process per section, one of them timed out on purpose
def test_sections_run_isolated_with_time_limits(capsys):
    sections = [
        Section("ceilings", f"{HERE}:ceiling_section", 60, True, False),
        Section("good", f"{HERE}:good_section", 60, True, True),
        Section("slow", f"{HERE}:slow_section", 8, True, False),
        Section("failing", f"{HERE}:failing_section", 60, True, True),
        Section("after", f"{HERE}:reads_ceilings", 60, True, False),
        Section("full only", f"{HERE}:good_section", 60, False, True),
    ]
    lines: list[str] = []
    start = time.perf_counter()
    report = run_sections(sections, "cpu", quick=True, echo=lines.append)
    assert time.perf_counter() - start < 50  # the hang was cut at its limit
    status = {s.name: (s.status, s.reason) for s in report.sections}
    assert list(status) == ["ceilings", "good", "slow", "failing", "after"]  # --quick leaves one out
    assert status["good"] == ("ok", "") and status["ceilings"][0] == "ok"
    assert status["slow"] == ("timeout", "over its 8 s limit")
    assert status["failing"] == ("failed", "RuntimeError: kernel launch failed: out of resources")
    slow = next(s for s in report.sections if s.name == "slow")
    assert 7 < slow.seconds < 30
    # Rows emitted before a hang or a failure are kept; a failed correctness section fails the check.
    assert [r.name for r in report.speed] == ["decode_b1_llama1b", "before the hang", "seen"]
    assert report.speed[-1].value == 3000.0  # later sections see the measured ceilings
    assert [(r.name, r.passed) for r in report.correctness] == [
        ("good", True), ("kept", True), ("failing section", False)]
    assert report.exit_status() == 1
    assert any(line.startswith("gpu-check: slow timeout in") for line in lines)


def test_every_section_has_a_limit_and_quick_is_env_kernels_parity():
    assert {s.name for s in SECTIONS if s.quick} == {"environment", "kernels", "parity", "serving"}
    assert sum(s.limit_s for s in SECTIONS if s.quick) <= 600 and all(s.limit_s > 0 for s in SECTIONS)
    assert {s.name for s in SECTIONS if s.correctness} == {"kernels", "parity", "serving", "sync"}


def test_environment_and_ceilings_on_the_cpu():
    ctx = Context("cpu", quick=True)
    environment(ctx)
    ceilings(ctx)
    env, ceil = ctx.emitted[0]["data"], ctx.emitted[1]["data"]
    assert {"gpu", "torch", "triton", "cuda", "python", "sm_count", "memory_gb", "driver"} <= set(env)
    assert env["torch"] == torch.__version__
    assert ceil["copy_gbps"] > 0 and ceil["bf16_tflops"] > 0


def test_an_unwritten_output_fails_its_row():
    def unwritten() -> kernels.Pair:
        with kernels.poisoned():
            out = torch.empty(4)
        return out, torch.ones(4)

    row = kernels.check_case(kernels.Case("forgetful", "fp32", unwritten))
    assert not row.passed and row.error == math.inf and "unwritten" in row.detail
    broken = kernels.check_case(kernels.Case("raises", "bf16", lambda: (torch.ones(1) / 0, 1 / 0)))
    assert not broken.passed and broken.detail.startswith("ZeroDivisionError")
    assert kernels.poison_(torch.empty(2, dtype=torch.int8)).tolist() == [-128, -128]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_kernel_matches_its_reference_on_the_cpu():
    ctx = Context("cpu", quick=True)
    kernels.run(ctx)
    rows = [CorrectnessRow(**r["data"]) for r in ctx.emitted]
    assert len(rows) >= 40
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    names = " ".join(r.name for r in rows)
    for op in ("store_kv", "decode_attention", "prefill_attention", "rms_norm", "silu_and_mul",
               "apply_rope", "per_token_quant", "rms_norm_quant", "silu_and_mul_quant", "w4a16_gemm",
               "int8_gemm", "fp8_gemm", "fused_moe float", "fused_moe int8", "fused_moe fp8",
               "fused_moe int4", "fused_moe nf4"):
        assert op in names, op


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_parity_functions_on_the_cpu(tmp_path):
    model = build_tiny_model(str(tmp_path / "llama"), "llama")
    rows = parity.mode_parity("llama", model, "cpu", 4)  # reference vs Triton (interpreted) eager
    assert [r.name for r in rows] == ["parity llama prefix cache hits (reference)",
                                      "parity llama prefix cache hits (triton eager)",
                                      "parity llama triton eager = reference"]
    assert all(r.passed for r in rows), rows
    assert parity.hf_parity("llama", model, "cpu", 4, "cpu").passed
    agreement = parity.quant_agreement(model, "cpu", "w8a8-int8", "cpu", "float32", 16)
    assert agreement >= AGREEMENT["w8a8-int8"]


def test_first_difference_names_the_step():
    assert parity.first_difference([[1, 2, 3]], [[1, 2, 4]]) == "prompt 0 step 2: 3 != 4"
    assert parity.first_difference([[1]], [[1, 2]]) == "prompt 0: 1 tokens != 2"


def test_one_sync_row():
    assert sync.one_sync_row([1] * 5).passed
    assert not sync.one_sync_row([1, 2, 1]).passed and "[1, 2, 1]" in sync.one_sync_row([1, 2, 1]).detail
    assert not sync.one_sync_row([]).passed


def test_speed_floors_and_random_weights(tmp_path):
    assert speed.pct(2.0, 2.5) == 80.0 and speed.pct(None, 1.0) is None
    model_dir = build_tiny_model(str(tmp_path / "llama"), "llama")
    os.remove(os.path.join(model_dir, "model.safetensors"))  # config.json and tokenizer only
    from pipeserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, device="cpu", dtype="float32", num_pages=16, load_format="dummy")
    model = llm.engine.model
    weights = dict(model.named_parameters())
    assert float(weights["layers.0.input_layernorm.weight"].min()) == 1.0
    assert 0.01 < float(weights["layers.0.mlp.down_proj.weight"].std()) < 0.03
    # Bytes a decode step reads: everything but all embedding rows bar one (the LM head is untied).
    embed = model.embed_tokens.weight
    total = sum(p.numel() * 4 for p in model.parameters())
    assert speed.weight_bytes(model) == total - (embed.numel() - embed.shape[1]) * 4
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert speed.decode_seconds(llm.engine, 2, prompt_len=4, warm=2, steps=3) > 0
    assert not llm.engine.has_work()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sync_section_drives_steady_decode_steps(tmp_path, proposer):
    # On the CPU (Triton interpreted), counting the runners' readbacks instead of CUDA's syncs: every
    # counted call is one engine step that still has all 8 requests running, reads back once (a
    # draft model's rounds never), and speculation verifies.
    model_dir = build_tiny_model(str(tmp_path / "llama"), "llama")
    running: list[int] = []
    engines = []

    def count(step) -> int:
        engine = step.__self__  # the engine the bound step belongs to
        runners = [engine.runner] + ([engine.speculator.draft.runner] if proposer == "draft" else [])
        before = sum(r.buffers.readbacks for r in runners)
        step()
        running.append(len(engine.requests))
        engines.append(engine)
        return sum(r.buffers.readbacks for r in runners) - before

    # Two warm steps: the prefill and the first decode (no graphs to capture on the CPU).
    counts = sync.step_syncs(model_dir, "cpu", count, dtype="float32", counted=4, proposer=proposer, warm=2)
    assert counts == [1] * 4 and sync.one_sync_row(counts, proposer).passed
    assert running == [8] * 4
    assert engines[0].stats()["spec_verifications"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serving_section_on_the_cpu():
    # `pipeserve up` on the CPU: SERVING, and the gRPC stream and the HTTP completion give the offline text.
    from pipeserve.gpu_check import serving

    ctx = Context("cpu", quick=True)
    serving.run(ctx, startup_s=300.0)
    rows = {r["data"]["name"]: r["data"] for r in ctx.emitted}
    assert rows["serving_start_tiny"]["value"] > 0
    for name in ("serving grpc stream equals offline LLM", "serving http completion equals offline LLM"):
        assert rows[name]["passed"], rows[name]


def test_sections_option_selects_in_order():
    from pipeserve.gpu_check.cli import select_sections

    assert [s.name for s in select_sections("speed,ceilings")] == ["ceilings", "speed"]
    assert select_sections(None) == SECTIONS
    with pytest.raises(SystemExit, match="no section nope"):
        select_sections("kernels,nope")


@pytest.mark.slow  # a process per section
@pytest.mark.timeout(120)
def test_sigterm_ends_the_run_and_keeps_the_report(tmp_path):
    # `timeout` around gpu-check: the section in flight is killed and reported, later ones are not
    # run, and the rows measured so far are written.
    script = (
        "import sys\n"
        "from pipeserve.gpu_check.runner import Section, run_sections, stop_on_sigterm\n"
        "stop_on_sigterm()\n"
        f"sections = [Section('good', '{HERE}:good_section', 60, True, True),\n"
        f"            Section('slow', '{HERE}:slow_section', 60, True, False),\n"
        f"            Section('after', '{HERE}:good_section', 60, True, True)]\n"
        "report = run_sections(sections, 'cpu', True, echo=lambda line: print(line, flush=True))\n"
        f"report.write({str(tmp_path)!r})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("gpu-check: good ok")
    # Inside the slow section, its row written: wait for its cue rather than a fixed time, since
    # starting the section's process can take seconds on a loaded machine.
    while (line := proc.stdout.readline()) and not line.startswith("slow section: hanging"):
        pass
    assert line, "the slow section never started"
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [(s["name"], s["status"]) for s in doc["sections"]] == [("good", "ok"), ("slow", "timeout")]
    assert "SIGTERM" in doc["sections"][1]["reason"]
    assert [r["name"] for r in doc["speed"]] == ["decode_b1_llama1b", "before the hang"]


def test_quant_rotation_counts():
    assert quant.copies(33_554_432, 50 * 2**20) == 4  # 4096 x 4096 bf16 against an H100's L2
    assert quant.copies(117_440_512, 50 * 2**20) == 1  # 4096 x 14336 bf16 is past it alone
    assert quant.copies(1, 2**30) == quant.MAX_COPIES and quant.copies(10, 0) == 1
    seen: list[int] = []
    step = quant.rotating([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(5):
        step()
    assert seen == [0, 1, 2, 0, 1]


def test_quant_kernel_rows_on_the_cpu():
    # The section's parts at tiny shapes (Triton interpreted): every row present with a positive
    # value, and every kernel's output within its bound of its baseline.
    ctx = Context("cpu", quick=False, ceilings={"copy_gbps": 10.0, "bf16_tflops": 1.0})
    plan, checks = quant.Plan.for_device(torch.device("cpu")), quant.Checks()
    for part in (quant.attention_rows, quant.gemm_rows, quant.moe_rows, quant.norm_quant_rows):
        part(ctx, plan, checks)
    rows = {r["data"]["name"]: SpeedRow(**r["data"]) for r in ctx.emitted}
    gemms = [f"quant_gemm_{k}_{n}x{kk}_m{m}" for n, kk in plan.gemm_shapes for m in plan.gemm_m
             for k in ("fp8", "int8", "w4a16")]
    moes = [f"quant_moe_tiny_{k}_t3" for k in ("bf16", "int8", "fp8")]
    norms = [f"quant_rms_norm_quant_{q}_m{m}_h64" for m in plan.norm_m for q in ("int8", "fp8")]
    attention = [f"quant_attention_{k}_b2_ctx64" for k in ("bf16", "int8", "fp8")]
    assert list(rows) == attention + gemms + moes + norms
    assert rows["quant_attention_bf16_b2_ctx64"].unit == "GB/s"
    for name, row in rows.items():
        assert row.value is not None and row.value >= 0 and row.pct_of_floor is not None, name
        assert (row.unit == "x") == (name != "quant_attention_bf16_b2_ctx64"), name
        assert " us" in row.detail and "error" in row.detail and "WRONG" not in row.detail, name
    assert not checks.failed, checks.failed
    assert len(checks.errors) == 3 + len(gemms) + len(moes) + 2 * len(norms)
    assert "attention fp8" in checks.errors and "moe tiny fp8 t3" in checks.errors


def test_quant_checks_name_a_wrong_kernel():
    checks = quant.Checks()
    assert checks.compare("good", torch.ones(3), torch.ones(3), "bf16") == "error 0.0e+00"
    assert "WRONG" in checks.compare("bad", torch.zeros(3), torch.ones(3), "bf16")
    assert "WRONG" in checks.compare("nan", torch.full((3,), math.nan), torch.ones(3), "fp8")
    assert checks.failed == ["bad: error 1 > 0.01", "nan: error inf > 0.07"]


def test_moe_loop_is_the_reference_moe():
    from pipeserve.engine.backend import get_backend

    g = torch.Generator().manual_seed(0)
    x, logits = torch.randn(7, 16, generator=g), torch.randn(7, 4, generator=g)
    w13, w2 = torch.randn(4, 24, 16, generator=g) * 0.1, torch.randn(4, 16, 12, generator=g) * 0.1
    for renormalize in (True, False):
        want = get_backend("reference").fused_moe(x, logits, w13, w2, 2, renormalize)
        torch.testing.assert_close(quant.moe_loop(x, logits, w13, w2, 2, renormalize), want)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("weights", ["w8a8-int8", "w8a8-fp8"])
def test_dummy_weights_quantize_at_load(tmp_path, weights):
    model_dir = build_tiny_model(str(tmp_path / "llama"), "llama")
    os.remove(os.path.join(model_dir, "model.safetensors"))
    from pipeserve.engine import LLM, SamplingParams

    llm = LLM(model_dir, device="cpu", dtype="float32", num_pages=16, load_format="dummy",
              quantization=weights)
    codes = dict(llm.engine.model.named_buffers())
    dtype = torch.int8 if weights == "w8a8-int8" else torch.float8_e4m3fn
    assert any(t.dtype == dtype for t in codes.values()), sorted(codes)[:8]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_end_to_end_skips_every_engine_under_the_reserve():
    ctx = Context("cpu", quick=False)
    quant.end_to_end_rows(ctx, "/nonexistent", 30.0, {}, clock=lambda: 0.0)  # no engine is built
    rows = [SpeedRow(**r["data"]) for r in ctx.emitted]
    assert len(rows) == 2 * len(quant.END_TO_END_MODES)
    assert rows[0].name == "quant_e2e_bf16_kvauto_b1" and rows[-1].name == "quant_e2e_w8a8-fp8_kvfp8_b64"
    assert all(r.value is None and r.detail.startswith("skipped for time: 30 s") for r in rows)


def test_end_to_end_a_failing_engine_keeps_the_next():
    ctx = Context("cpu", quick=False)
    with pytest.raises(RuntimeError, match="bf16_kvauto: .*w8a8-int8_kvint8: "):
        quant.end_to_end_rows(ctx, "/nonexistent", 1e9, dict(device="cpu"),
                              modes=[("none", "auto"), ("w8a8-int8", "int8")])
    rows = [SpeedRow(**r["data"]) for r in ctx.emitted]
    assert [r.name for r in rows] == ["quant_e2e_bf16_kvauto_b1", "quant_e2e_bf16_kvauto_b64",
                                      "quant_e2e_w8a8-int8_kvint8_b1", "quant_e2e_w8a8-int8_kvint8_b64"]
    assert all(r.value is None and r.detail.startswith("failed: ") for r in rows)


@pytest.mark.slow  # four tiny engines on the CPU: about 15-25 s on a loaded 2-core host
@pytest.mark.timeout(600)
def test_end_to_end_rows_and_the_time_budget(tmp_path):
    # Two engines of the tiny model fit (their rows measured); then the fake clock jumps, and the
    # modes left must be skipped rows, not engines started.
    model_dir = build_tiny_model(str(tmp_path / "llama"), "llama")
    now = [0.0]
    built: list[str] = []

    def clock() -> float:
        return now[0]

    ctx = Context("cpu", quick=False)
    options = dict(device="cpu", dtype="float32", num_pages=64, max_num_seqs=4)
    modes = [("none", "auto"), ("w8a8-int8", "int8"), ("w8a8-fp8", "auto"), ("none", "fp8")]

    real_row = ctx.row

    def row(r: SpeedRow) -> None:
        real_row(r)
        built.append(r.name)
        if r.name == "quant_e2e_w8a8-int8_kvint8_b4":
            now[0] = 100.0 - quant.END_TO_END_RESERVE_S + 1  # under the reserve from here on

    ctx.row = row  # type: ignore[method-assign]
    quant.end_to_end_rows(ctx, model_dir, 100.0, options, batches=(1, 4), warm=2, steps=2, modes=modes,
                          clock=clock)
    rows = [SpeedRow(**r["data"]) for r in ctx.emitted]
    assert [r.name for r in rows] == [f"quant_e2e_{tag}_b{b}" for tag in
                                      ("bf16_kvauto", "w8a8-int8_kvint8", "w8a8-fp8_kvauto", "bf16_kvfp8")
                                      for b in (1, 4)]
    measured, skipped = rows[:4], rows[4:]
    assert all(r.value is not None and r.value > 0 and r.unit == "ms/step" for r in measured)
    assert "1.00x bf16" in measured[0].detail and "x bf16 / auto KV" in measured[2].detail
    assert all(r.value is None and r.detail.startswith("skipped for time") for r in skipped)
    print("\n".join(f"{r.name}: {r.value} {r.unit}; {r.detail}" for r in rows))


def test_quant_section_limit_and_budget():
    quant_section = next(s for s in SECTIONS if s.name == "quant")
    assert (quant_section.limit_s, quant_section.quick, quant_section.correctness) == (240, False, False)
    assert quant.BUDGET_S + 10 <= quant_section.limit_s


def test_profile_rows_on_the_cpu(tmp_path):
    # The profile section's code on a tiny CPU engine: a device-time row, then the ops by time, each
    # with its share and calls per step.
    from pipeserve.engine import LLM
    from pipeserve.gpu_check import profile

    model_dir = build_tiny_model(str(tmp_path / "llama"), "llama")
    llm = LLM(model_dir, device="cpu", dtype="float32", num_pages=32, step_executor="eager")
    prof = profile.profile_steps(llm.engine, warm=1, steps=3, prompt_len=5)
    assert prof.wall_ms > 0 and prof.device_ms > 0 and prof.kernels
    times = [k.us_per_step for k in prof.kernels]
    assert times == sorted(times, reverse=True)
    assert not llm.engine.has_work()
    ctx = Context("cpu", quick=False)
    profile.profile_rows(ctx, "tiny_b1_eager", prof, top=3)
    rows = [r["data"] for r in ctx.emitted]
    names = ["profile_tiny_b1_eager"] + [f"profile_tiny_b1_eager_0{i}" for i in (1, 2, 3)]
    assert [r["name"] for r in rows] == names
    assert rows[0]["unit"] == "ms/step" and "busy" in rows[0]["detail"]
    assert all(r["unit"] == "us/step" and "x/step" in r["detail"] for r in rows[1:])
