"""The real-size suite (issue 44, item 3) never rots: `benchmarks/size_run.py --smoke` runs GPT-2 and Llama
at tiny sizes on the CPU, eager and cgtrees, each row in a fresh process (cgtrees's kernels through Triton's
interpreter, which the runner turns on), and every row comes back measured and matching eager; a vision row
says it is skipped where timm or torchvision do not import. The rest checks, on made-up figures, what the
GPU run relies on: kernel categories and idle time, the report's block of docs/benchmarks.md and its
profile of a miss, merging calls, the --budget guard and DDP's skip without GPUs."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from bench_helpers import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("step_ms", "step_ms_min", "step_ms_max", "throughput", "first_step_s", "first3_s", "compile_s",
          "loss_abs_err", "loss_rel_err", "grad_abs_err", "grad_rel_err", "worst_grad", "items_per_step")


def test_smoke_measures_gpt2_and_llama_and_skips_vision_with_a_message(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "CGTREES_INTERPRET"}  # the runner sets it for cgtrees
    done = subprocess.run([sys.executable, "benchmarks/size_run.py", "--smoke", "--models",
                           "gpt2_small,llama_1b,vit_b16_infer", "--out-dir", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "summary" in done.stdout and "cgtrees / inductor" not in done.stdout  # no Inductor row in a smoke run
    data = json.loads((out / "size-gpt2_small_llama_1b_vit_b16_infer-eager_cgtrees-smoke.json").read_text())
    rows = {(r["model"], r["backend"]): r for r in data["rows"]}
    assert set(rows) == {(m, b) for m in ("gpt2_small", "llama_1b", "vit_b16_infer") for b in ("eager", "cgtrees")}
    assert data["meta"]["smoke"] and data["meta"]["command"].startswith("python benchmarks/size_run.py")

    for (model, backend), r in rows.items():
        name = f"{model}/{backend}"
        vision = model == "vit_b16_infer"
        if vision and r["status"] == "skipped":  # the CPU machine: timm/torchvision do not import
            assert "vit_b16_infer needs timm/torchvision" in r["error"], r["error"]
            continue
        assert r["ok"] and r["status"] == "ok", f"{name}: {r['error']}\n{r.get('traceback', '')}"
        assert r["device"] == "cpu" and r["smoke"] and r["world"] == 1 and r["mode"] == ("infer" if vision else "train")
        for key in FIELDS if not vision else ("step_ms", "throughput", "first3_s", "out_abs_err", "out_rel_err"):
            assert key in r, f"{name}: no {key}"
        assert 0 < r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"] and len(r["step_ms_all"]) == 2, name
        assert 0 < r["first_step_s"] <= r["first3_s"], name
        assert (r["items_per_step"], r["unit"]) == ((2, "images") if vision else (2 * 16, "tokens")), name
        assert math.isclose(r["throughput"], r["items_per_step"] / r["step_ms"] * 1e3), name
        # bf16: eager against itself is exact (nondeterminism would show here); cgtrees rounds otherwise
        # (1e-3-1e-2 measured on the language models).
        bound = 1e-6 if backend == "eager" else 5e-2
        if vision:  # inference: the output is compared, no gradient
            assert r["out_rel_err"] <= bound and "grad_rel_err" not in r, f"{name}: output off by {r['out_rel_err']}"
        else:
            assert math.isfinite(r["loss"]) and 4 < r["loss"] < 7, f"{name}: loss {r['loss']} (ln 256 = 5.5)"
            assert len(r["grad_errors"]) == 4, f"{name}: {r['grad_errors']}"
            assert r["loss_rel_err"] <= bound and r["grad_rel_err"] <= bound, \
                f"{name}: loss {r['loss_rel_err']}, gradient {r['worst_grad']} {r['grad_rel_err']}"
        assert "peak_reserved_gb" not in r, name  # CUDA only
        if backend == "eager" and not vision:  # bf16 autocast against fp32: rounding, not 0, not wild
            assert 0 < r["autocast_loss_rel_err"] < 0.1 and 0 < r["autocast_grad_rel_err"] < 0.1, r
        assert ("autocast_loss_rel_err" in r) == (backend == "eager" and not vision), name
        if backend == "cgtrees":
            ours = r["counters"]["cgtrees"]
            assert ours.get("kernels_generated", 0) > 0 and ours.get("graph_fallbacks", 0) == 0, f"{name}: {ours}"
            assert r["compile_s"] > 0, name

    # The report over that folder: the smoke rows, said to be smoke rows.
    size_report = bench("size_report")
    loaded, metas = size_report.load([str(out)])
    block = size_report.block(loaded)
    assert block.startswith(size_report.BEGIN) and block.rstrip().endswith(size_report.END)
    assert "**Smoke rows**" in block and "| gpt2_small | train | tiny (smoke) |" in block
    assert "No row has an Inductor row beside it" in block
    assert len(metas) == 1


def test_kernels_fall_into_categories_and_idle_is_the_step_less_the_busy_union():
    worker = bench("size_worker")
    names = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": "gemm",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "gemm",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, bf16>>": "attention",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64": "attention",
        "red_fused_layernorm_gelu_0": "generated", "pw_fused_copy_mul_3": "generated",
        "triton_per_fused_native_layer_norm_0": "generated",
        "Memcpy DtoD (Device -> Device)": "copies", "Memset (Device)": "copies",
        "void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>": "copies",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "copies",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>":
            "optimizer",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>": "other",
        "void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps>>": "other",
    }
    for name, kind in names.items():
        assert worker.category(name) == kind, name
    # Over 2 steps: a GEMM and an all-reduce that overlap (a second stream), a copy later, 30 us idle per step.
    kernels = [("nvjet_a", 0.0, 100.0), ("ncclDevKernel_AllReduce", 50.0, 150.0), ("Memset (Device)", 200.0, 210.0),
               ("nvjet_a", 300.0, 400.0)]
    prof = worker.kernel_profile(kernels, steps=2, step_ms=0.11)
    assert prof["categories_ms"]["gemm"] == pytest.approx(0.1) and prof["categories_ms"]["communication"] == 0.05
    assert prof["busy_ms"] == pytest.approx(0.13)  # (150 + 10 + 100) us over 2 steps: the overlap counts once
    assert prof["idle_ms"] == 0.0  # never negative: the step here is shorter than the busy time
    assert worker.kernel_profile(kernels, 2, 0.2)["idle_ms"] == pytest.approx(0.07)
    assert prof["top"][0] == {"name": "nvjet_a", "ms": pytest.approx(0.1), "launches": 1.0, "category": "gemm"}
    # Families: one layer's generated kernel, once per layer under its index, adds up; library kernels keep their names.
    layers = [("pw_fused_gelu_3", 0.0, 10.0), ("pw_fused_gelu_17", 20.0, 30.0), ("triton_poi_fused_gelu_9", 40.0, 45.0),
              ("nvjet_sm90_tst_128x256_64x4_2", 50.0, 52.0)]
    families = {f["name"]: (f["ms"], f["launches"]) for f in worker.kernel_profile(layers, 1, None)["top_families"]}
    assert families == {"pw_fused_gelu": (pytest.approx(0.02), 2), "triton_poi_fused_gelu": (pytest.approx(0.005), 1),
                        "nvjet_sm90_tst_128x256_64x4_2": (pytest.approx(0.002), 1)}
    # The profiler's API as the worker calls it (no kernels on a CPU: every category 0, all idle).
    x = torch.randn(16, 16)
    cpu = worker.profile(lambda: x @ x, torch.device("cpu"), 2, 1.0)
    assert cpu["busy_ms"] == 0 and cpu["idle_ms"] == 1.0 and set(cpu["categories_ms"]) == set(worker.CATEGORY_NAMES)


def test_relative_errors_judge_a_zero_gradient_against_the_others():
    worker = bench("size_worker")
    want = worker.Values(torch.tensor(2.0), {"w": torch.ones(4), "key_bias": torch.full((4,), 1e-9), "frozen": None})
    got = worker.Values(torch.tensor(2.002), {"w": torch.ones(4) * 1.01, "key_bias": torch.full((4,), 2e-9),
                                              "frozen": None})
    e = worker.errors(got, want, train=True)
    assert e["loss_abs_err"] == pytest.approx(2e-3, rel=1e-3) and e["loss_rel_err"] == pytest.approx(1e-3, rel=1e-3)
    assert e["worst_grad"] == "w" and e["grad_rel_err"] == pytest.approx(0.01, rel=1e-3)
    assert e["grad_errors"]["key_bias"]["rel"] < 1e-5 and set(e["grad_errors"]) == {"w", "key_bias"}
    inference = worker.errors(worker.Values(torch.ones(2, 3)), worker.Values(torch.ones(2, 3) * 2), train=False)
    assert inference["out_rel_err"] == 0.5 and inference["loss"] is None and "grad_rel_err" not in inference


def test_a_vision_case_steps_with_channels_last_bf16_and_the_loss_outside(monkeypatch):
    """timm and torchvision do not import on the CPU machine: a small conv net stands in for ResNet-50 through
    the same builder, so the vision paths (channels_last, bf16 weights, loss outside, fused SGD) run here."""
    real_sizes, worker = bench("real_sizes"), bench("size_worker")

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))

    def train(device, smoke, seed):
        return real_sizes._vision_case(net(), device, 4, 16, 10, seed, train=True, channels_last=True,
                                       optimizer=real_sizes.sgd)

    def infer(device, smoke, seed):
        return real_sizes._vision_case(net(), device, 4, 16, 10, seed, train=False, dtype=torch.bfloat16)

    for name, builder, mode in (("fake_train", train, "train"), ("fake_infer", infer, "infer")):
        monkeypatch.setitem(real_sizes.SUITE, name, real_sizes.Spec(mode, (), "tiny", "-"))
        monkeypatch.setitem(real_sizes.BUILDERS, name, builder)
        spec = {"model": name, "backend": "eager", "mode": mode, "world": 1, "rank": 0, "device": "cpu",
                "smoke": True, "warmup": 0, "steps": 2, "profile_steps": 0}
        row = worker.run_row(spec)
        assert row["ok"], f"{name}: {row['error']}\n{row.get('traceback')}"
        assert row["unit"] == "images" and row["items_per_step"] == 4 and row["step_ms"] > 0
        key = "loss" if mode == "train" else "out"
        assert row[f"{key}_rel_err"] == 0.0, row  # eager against itself
        assert ("grad_rel_err" in row) == (mode == "train")
    case = train(torch.device("cpu"), True, 0)
    assert case.model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert infer(torch.device("cpu"), True, 0).model[0].weight.dtype == torch.bfloat16


def _row(model, backend, step_ms, **more):
    row = {"model": model, "backend": backend, "mode": "train", "sizes": "124M, 8 x 1024 tok", "unit": "tokens",
           "status": "ok", "ok": True, "error": None, "step_ms": step_ms, "step_ms_min": step_ms * 0.99,
           "step_ms_max": step_ms * 1.02, "throughput": 8192 / step_ms * 1e3, "first3_s": 40.0, "compile_s": 39.0,
           "peak_reserved_gb": 20.5, "peak_allocated_gb": 18.0, "steady_reserved_gb": 19.0,
           "steady_allocated_gb": 17.0, "loss_abs_err": 1e-3, "loss_rel_err": 1e-4, "grad_abs_err": 1e-4,
           "grad_rel_err": 3e-3, "worst_grad": "transformer.wte.weight", "device_name": "NVIDIA H100 80GB HBM3",
           "torch": "2.11.0+cu130", "counters": {"graph_breaks": 3}}
    return {**row, **more}


def _profile(gemm, generated, idle):
    return {"steps": 5, "categories_ms": {"gemm": gemm, "attention": 10.0, "generated": generated, "copies": 1.0,
                                          "optimizer": 4.0, "communication": 0.0, "other": 0.5},
            "busy_ms": gemm + generated + 15.5, "idle_ms": idle,
            "top": [{"name": "nvjet_tst_128x256", "ms": gemm / 2, "launches": 48.0, "category": "gemm"}]}


def test_report_block_holds_the_table_errors_and_the_profile_of_each_miss(tmp_path):
    size_report, run = bench("size_report"), bench("run")
    rows = [_row("gpt2_small", "eager", 200.0, autocast_loss_rel_err=2e-3, autocast_grad_rel_err=5e-2),
            _row("gpt2_small", "inductor", 100.0, profile=_profile(60, 20, 4.5)),
            _row("gpt2_small", "reduce-overhead", 98.0),
            _row("gpt2_small", "cgtrees", 110.0, profile=_profile(60, 28, 6.5)),
            {"model": "llama_1b", "backend": "cgtrees", "mode": "train", "sizes": "1.1B, 4 x 1024 tok",
             "status": "error", "ok": False, "error": "first steps: OutOfMemoryError: CUDA out of memory"},
            {"model": "gpt2_small_ddp", "backend": "eager", "mode": "train", "sizes": "124M, 2 x 8 x 1024 tok",
             "status": "skipped", "ok": False, "error": "needs 2 GPUs (torch.cuda.device_count() >= 2), found 1"}]
    block = size_report.block(rows)
    assert "| gpt2_small | train | 124M, 8 x 1024 tok | 200.0 | 100.0 | 98.0 | 110.0 | 1.10x | " \
           "41.0k / 81.9k / 83.6k / 74.5k tok/s | 39.0 / 39.0 / 39.0 | 20.5 / 20.5 / 20.5 / 20.5 | " \
           "H100 80GB HBM3 | 2.11.0+cu130 | - |" in block
    assert "| gpt2_small | 1e-04 / 1e-04 / 1e-04 / 1e-04 | 1e-03 / 1e-03 / 1e-03 / 1e-03 | " \
           "3e-03 / 3e-03 / 3e-03 / 3e-03 | `transformer.wte.weight` | 2e-03 / 5e-02 | 18.0 / 18.0 / 18.0 / 18.0 | " \
           "19.0 / 19.0 / 19.0 / 19.0 | 108.9-112.2 | 3 / 3 / 3 |" in block
    # The miss: its profile beside Inductor's, then its top kernels; reduce-overhead is faster: no profile.
    assert "| gpt2_small / inductor | 100.0 | 60.00 | 10.00 | 20.00 | 1.00 | 4.00 | 0.00 | 0.50 | 95.50 | 4.50 |" \
        in block
    assert "| gpt2_small / cgtrees (1.10x) | 110.0 | 60.00 | 10.00 | 28.00 | 1.00 | 4.00 | 0.00 | 0.50 | 103.50 | " \
           "6.50 |" in block
    assert "| gpt2_small | 30.000 | 48 | gemm | `nvjet_tst_128x256` |" in block
    assert "gpt2_small / reduce-overhead" not in block
    assert "- llama_1b / cgtrees: error: first steps: OutOfMemoryError" in block
    assert "- gpt2_small_ddp / eager: skipped: needs 2 GPUs" in block
    assert "cgtrees / inductor: 1.10x" in size_report.screen(rows)

    # Only its block is rewritten; the own suite's report, rewritten by run.py, keeps it as it is.
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nown suite\n\n{size_report.block([])}\n## How to read the tables\n")
    size_report.write(str(doc), rows)
    text = doc.read_text()
    assert text.count(size_report.BEGIN) == 1 and "No results yet" not in text and "1.10x" in text
    assert text.startswith("# Benchmarks\n\nown suite\n\n") and text.endswith("\n## How to read the tables\n")
    run.main(["--from-json", os.path.join(ROOT, "benchmarks", "results", "7-mlp_small.json"), "--markdown", str(doc)])
    rebuilt = doc.read_text()
    assert "own suite" not in rebuilt and block in rebuilt


def test_the_newest_call_wins_unless_it_did_not_measure_the_row(tmp_path):
    size_report = bench("size_report")
    old = {"meta": {"date": "2026-11-27 10:00:00 UTC", "commit": "aaa"},
           "rows": [_row("gpt2_small", "cgtrees", 120.0), _row("gpt2_small", "inductor", 100.0)]}
    new = {"meta": {"date": "2026-11-27 11:00:00 UTC", "commit": "bbb"},
           "rows": [_row("gpt2_small", "cgtrees", 105.0),
                    {**_row("gpt2_small", "inductor", 1.0), "status": "not run", "ok": False}]}
    (tmp_path / "b.json").write_text(json.dumps(old))  # names in the other order: the dates decide
    (tmp_path / "a.json").write_text(json.dumps(new))
    (tmp_path / "own.json").write_text(json.dumps({"meta": {}, "rows": [{"workload": "mlp_small"}]}))  # not ours
    rows, metas = size_report.load([str(tmp_path)])
    by = {r["backend"]: r for r in rows}
    assert by["cgtrees"]["step_ms"] == 105.0 and by["cgtrees"]["commit"] == "bbb"
    assert by["inductor"]["step_ms"] == 100.0 and by["inductor"]["commit"] == "aaa"
    assert [m["file"] for m in metas] == ["b.json", "a.json"]


def test_a_spent_budget_starts_nothing_and_ddp_is_skipped_without_two_gpus(tmp_path):
    size_run = bench("size_run")
    out = tmp_path / "x.json"
    assert size_run.main(["--models", "gpt2_small,llama_1b", "--budget", "0", "--device", "cuda",
                          "--out", str(out)]) == 0  # no worker starts, so no GPU is needed
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8 and all(r["status"] == "not run" and "--budget of 0s" in r["error"] for r in rows)

    if torch.cuda.device_count() < 2:  # else the rows would run
        args = size_run.parse_args(["--models", "gpt2_small_ddp", "--backends", "eager,cgtrees", "--device", "cuda"])
        skipped = size_run.measure_all(args, lambda rows: None)
        assert [r["status"] for r in skipped] == ["skipped", "skipped"]
        assert "needs 2 GPUs (torch.cuda.device_count() >= 2)" in skipped[0]["error"]
    assert size_run.parse_args(["--smoke", "--out-dir", "d"]).out.endswith("-eager_cgtrees-smoke.json")
    with pytest.raises(SystemExit):
        size_run.parse_args(["--models", "gpt3"])
