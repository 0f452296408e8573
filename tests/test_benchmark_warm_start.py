"""Issue 19's warm-start benchmark: the ``-pc`` backends (Dynamo's caching precompile) get the settings
they need and cache directories of their own, the report checks both warm-start targets per row
(0.5x the best Inductor warm start, 0.15x our best cold start) and that a cgtrees-pc warm process
compiled nothing, and a real cold and warm run of cgtrees-pc in fresh processes skips Dynamo's
trace and our compile while matching eager."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from bench_helpers import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pc_workers_get_dynamo_cache_settings_and_caches_of_their_own(monkeypatch):
    run = bench("run")
    monkeypatch.setenv("CGTREES_PRECOMPILE_CACHE", "1")  # a shell's own: never reaches a plain row
    monkeypatch.setenv("TORCH_CACHING_PRECOMPILE", "1")
    caches = {"CGTREES_CACHE_DIR": "/r/c"}
    plain, pc = run.worker_environ(caches, "cgtrees"), run.worker_environ(caches, "cgtrees-pc")
    assert "CGTREES_PRECOMPILE_CACHE" not in plain and "TORCH_CACHING_PRECOMPILE" not in plain
    assert pc["CGTREES_PRECOMPILE_CACHE"] == "1" and "TORCH_CACHING_PRECOMPILE" not in pc
    assert plain["CGTREES_CACHE_DIR"] == pc["CGTREES_CACHE_DIR"] == "/r/c"
    for name in ("inductor", "inductor-pc"):  # Inductor's setting is made in the worker, not inherited
        env = run.worker_environ(caches, name)
        assert "CGTREES_PRECOMPILE_CACHE" not in env and "TORCH_CACHING_PRECOMPILE" not in env

    args = run.parse_args(["--models", "mlp_small", "--modes", "train", "--no-floor", "--cold-warm",
                           "--backends", "inductor,inductor-pc,cgtrees,cgtrees-pc"])
    specs = run.plan(args, "cuda")
    assert [(s["backend"], s["phase"]) for s in specs] == [
        (b, p) for b in ("inductor", "inductor-pc", "cgtrees", "cgtrees-pc") for p in ("cold", "warm")]
    dirs = {s["backend"]: run.cache_env(Path("/r"), s) for s in specs}
    for var in run.CACHE_VARS:  # Dynamo's cache lives under TORCHINDUCTOR_CACHE_DIR: not shared either
        assert len({d[var] for d in dirs.values()}) == 4, var
    assert {p["backend"] for p in run.prime_specs(specs)} == {"inductor", "inductor-pc", "cgtrees", "cgtrees-pc"}


def test_worker_turns_dynamo_cache_on_before_torch_compile_for_pc_only(monkeypatch):
    worker = bench("worker")
    model = torch.nn.Linear(2, 2)
    with torch._dynamo.config.patch(caching_precompile=False):
        worker.compile_model(model, "inductor")
        assert not torch._dynamo.config.caching_precompile
        worker.compile_model(model, "inductor-pc")
        assert torch._dynamo.config.caching_precompile  # set here: Inductor has no setting of its own
    with torch._dynamo.config.patch(caching_precompile=False):
        monkeypatch.delenv("CGTREES_PRECOMPILE_CACHE", raising=False)
        with pytest.raises(RuntimeError, match="CGTREES_PRECOMPILE_CACHE"):
            worker.compile_model(model, "cgtrees-pc")  # else a plain warm start under the -pc name
        monkeypatch.setenv("CGTREES_PRECOMPILE_CACHE", "1")
        worker.use_dynamo_cache("cgtrees-pc")  # cgtrees turns Dynamo's setting on itself, at the lookup
        assert not torch._dynamo.config.caching_precompile
    assert worker.save_dynamo_cache("inductor") is None and worker.save_dynamo_cache("cgtrees-pc") is None
    found = {"cgtrees": {"graphs_compiled": 0, "precompile_loaded": 2}, "dynamo_cache": {"dynamo_cache_hit": 1}}
    figures = worker.start_figures(found, "cgtrees-pc")
    assert figures["graphs_compiled"] == 0 and figures["precompile_loaded"] == 2
    assert figures["dynamo_cache_hit"] == 1 and figures["dynamo_cache_miss"] == 0
    assert "graphs_compiled" not in worker.start_figures(found, "inductor-pc")


def _row(backend, phase, first3_s, **extra):
    return {"workload": "gpt_block", "mode": "train", "backend": backend, "phase": phase, "ok": True,
            "first_s": first3_s, "first3_s": first3_s, "step_s": 5e-3, "max_err": 1e-6, **extra}


def _rows():
    return [_row("inductor", "cold", 8.0), _row("inductor", "warm", 1.4),
            _row("inductor-pc", "cold", 8.2, dynamo_cache_miss=1, dynamo_cache_save="ok"),
            _row("inductor-pc", "warm", 0.9, dynamo_cache_hit=1, dynamo_cache_save="ok"),
            _row("cgtrees", "cold", 7.5, graphs_compiled=2), _row("cgtrees", "warm", 0.7, graphs_compiled=2),
            _row("cgtrees-pc", "cold", 7.6, graphs_compiled=2, precompile_loaded=0, dynamo_cache_miss=1),
            _row("cgtrees-pc", "warm", 0.3, graphs_compiled=0, precompile_loaded=2, dynamo_cache_hit=1,
                 dynamo_cache_miss=0, dynamo_cache_error=0)]


def test_report_checks_both_warm_start_targets_for_each_of_our_backends():
    report = bench("report")
    rows = _rows()
    found = {c.text for c in report.checks(rows)}
    assert "cgtrees warm <= 0.5x best inductor warm (inductor-pc): 0.78x MISS by 1.56x" in found
    assert "cgtrees warm <= 0.15x our best cold (cgtrees): 0.09x ok" in found
    assert "cgtrees-pc warm <= 0.5x best inductor warm (inductor-pc): 0.33x ok" in found
    assert "cgtrees-pc warm <= 0.15x our best cold (cgtrees): 0.04x ok" in found
    assert ("cgtrees-pc warm compiles no graph: graphs_compiled 0, precompile_loaded 2, dynamo_cache_hit 1, "
            "_miss 0, _error 0 ok") in found
    assert "<= 1x best other (inductor): 1.00x ok" in found  # issue 6's per call: the -pc rows left out

    text = report.tables(rows)
    assert "| figure | inductor | inductor-pc | cgtrees | cgtrees-pc | cgtrees / best other | target |" in text
    assert "| graphs compiled, warm (graphs_compiled) | - | - | 2 | 0 | - |" in text
    assert "| Dynamo cache hits, warm (dynamo_cache_hit) | - | 1 | - | 1 | - |" in text
    assert "| max abs error vs eager, warm | 1.0e-06 | 1.0e-06 | 1.0e-06 | 1.0e-06 | - |" in text

    # Inductor's precompile failed: the best Inductor warm start is its plain one; the failure is listed.
    failed = [r for r in rows if (r["backend"], r["phase"]) != ("inductor-pc", "warm")]
    failed.append({**_row("inductor-pc", "warm", None), "ok": False, "error": "warm: boom"})
    found = {c.text for c in report.checks(failed)}
    assert "cgtrees-pc warm <= 0.5x best inductor warm (inductor): 0.21x ok" in found
    assert "FAILED gpt_block/train/inductor-pc (warm): warm: boom" in report.summary(failed)

    # A cgtrees-pc warm process that compiled (Dynamo's cache missed): a miss, and a note saying why.
    recompiled = [r for r in rows if (r["backend"], r["phase"]) != ("cgtrees-pc", "warm")]
    recompiled.append(_row("cgtrees-pc", "warm", 0.7, graphs_compiled=2, precompile_loaded=0, dynamo_cache_hit=0,
                           dynamo_cache_miss=0, dynamo_cache_error=1, caching_precompile=True))
    summary = report.summary(recompiled)
    assert "MISS gpt_block/train graphs compiled, warm (graphs_compiled): cgtrees-pc warm compiles no graph: " \
           "graphs_compiled 2, precompile_loaded 0, dynamo_cache_hit 0, _miss 0, _error 1 MISS" in summary
    assert "note gpt_block/train/cgtrees-pc (warm): Dynamo's cache was not used (hit 0, miss 0, error 1" in summary

    # One of three warm processes compiled (its cache missed): the median one did not, the check still fails.
    runs = bench("run")
    warm = [_row("cgtrees-pc", "warm", t, graphs_compiled=c, precompile_loaded=2 - c)
            for t, c in ((0.3, 0), (0.9, 2), (0.4, 0))]
    kept = runs.median_row(warm)
    assert kept["first3_s"] == 0.4 and kept["graphs_compiled_runs"] == [0, 0, 2]
    mixed = [r for r in rows if (r["backend"], r["phase"]) != ("cgtrees-pc", "warm")] + [kept]
    assert "cgtrees-pc warm compiles no graph: graphs_compiled 0 (per process: 0, 0, 2), precompile_loaded 2, " \
           "dynamo_cache_hit None, _miss None, _error None MISS" in {c.text for c in report.checks(mixed)}

    # Result files from before issue 19 have no -pc rows: the plain targets only, nothing fails.
    old = [{k: v for k, v in r.items() if k != "graphs_compiled"} for r in rows if not r["backend"].endswith("-pc")]
    found = {c.text for c in report.checks(old)}
    assert "cgtrees warm <= 0.5x best inductor warm (inductor): 0.50x ok" in found
    assert "cgtrees warm <= 0.15x our best cold (cgtrees): 0.09x ok" in found
    assert not any("-pc" in t for t in found) and "-pc" not in report.tables(old)


def test_real_suite_summary_checks_the_warm_start_targets():
    real_report = bench("real_report")
    rows = [{**r, "workload": "gpt2"} for r in _rows()]
    screen = real_report.screen(rows)
    assert "issue 19: cgtrees-pc warm <= 0.5x best inductor warm (inductor-pc): 0.33x ok" in screen
    assert "issue 19: cgtrees warm <= 0.15x our best cold (cgtrees): 0.09x ok" in screen
    assert "issue 19: cgtrees-pc warm compiles no graph: graphs_compiled 0" in screen
    lines = {line.split()[2]: line for line in screen.splitlines() if line.startswith("gpt2")}
    assert set(lines) == {"inductor", "inductor-pc", "cgtrees", "cgtrees-pc"}
    details = real_report.details(rows, {})
    assert "| saved functions loaded, warm (precompile_loaded) | - | - | - | 2 | - |" in details
    section = real_report.section(rows, {})  # the page's table: the compiles-no-graph check beside warm starts
    assert "cgtrees-pc: 0.33x inductor-pc ok; cgtrees-pc: 0.04x own cold ok; cgtrees-pc: compiled 0 ok |" in section


def test_merged_report_keeps_the_precompile_block_and_checks_new_rows(tmp_path):
    """docs/warm_start.md rebuilt from an older result file (no -pc rows) and a newer one with them:
    the hand-written precompile section stays verbatim and the -pc targets are checked."""
    run = bench("run")
    original = open(os.path.join(ROOT, "docs", "warm_start.md")).read()
    start, end = original.index("<!-- precompile:begin -->"), original.index("<!-- precompile:end -->")
    block = original[start:end + len("<!-- precompile:end -->")]
    doc = tmp_path / "warm_start.md"
    doc.write_text(original)
    new = tmp_path / "pc.json"
    new.write_text(json.dumps({"meta": {"date": "today", "command": "pc"}, "rows": _rows()}))
    old = os.path.join(ROOT, "benchmarks", "results", "check-warm-median-mlp_small-norm_act.json")
    run.main(["--from-json", f"{old},{new}", "--markdown", str(doc), "--title", "Warm-start check (H100)"])
    text = doc.read_text()
    assert text.startswith("# Warm-start check (H100)\n")
    assert text.count(block) == 1 and "### mlp_small / infer" in text and "### gpt_block / train" in text
    assert "cgtrees-pc warm <= 0.5x best inductor warm (inductor-pc): 0.33x ok" in text
    assert "cgtrees warm <= 0.15x our best cold (cgtrees)" in text.split("### mlp_small / infer")[1]


def test_cgtrees_pc_cold_then_warm_process_skips_the_trace_and_matches_eager(tmp_path, monkeypatch):
    """Two fresh worker processes on shared cache directories, as ``--cold-warm`` runs them (about
    10 s on CPU): the warm one installs Dynamo's cache, compiles no graph, traces nothing, and its
    loss, output and gradients match eager's."""
    run = bench("run")
    monkeypatch.setenv("CGTREES_INTERPRET", "1")
    spec = {"workload": "mlp_small", "backend": "cgtrees-pc", "mode": "train", "device": "cpu", "smoke": True}
    env = run.cache_env(tmp_path, spec)
    cold, warm = (run.run_worker({**spec, "phase": phase}, env, 120) for phase in ("cold", "warm"))
    for row in (cold, warm):
        assert row["ok"], f"{row['phase']}: {row['error']}\n{row.get('traceback', '')}"
        assert row["rel_err_out"] < 1e-4 and row["rel_err_grad"] < 1e-4, row  # fp32: ~1e-6 measured
        assert math.isfinite(row["first3_s"]) and row["caching_precompile"] is True
    assert cold["graphs_compiled"] == 1 and cold["dynamo_cache_miss"] == 1, cold["counters"]
    # An error here is Dynamo failing to read our artifact; in a shared working tree, an edit of
    # backend/ between the two processes does that (another source hash: a miss, by design).
    assert warm["dynamo_cache_hit"] == 1 and warm["dynamo_cache_error"] == 0, warm["counters"]
    assert warm["dynamo_cache_miss"] == 0, warm["counters"]  # the worker's own imports look nothing up
    assert warm["graphs_compiled"] == 0 and warm["precompile_loaded"] == 1, warm["counters"]
    assert warm["counters"]["cgtrees"]["kernels_generated"] == 0
    assert "bytecode_tracing" not in warm["compile_phases"] and warm["counters"]["unique_graphs"] == 0


def test_warm_real_sizes_table_puts_each_warm_start_against_the_best_inductor_warm_one(monkeypatch):
    """benchmarks/warm_real.py (issue 53, item 2): each backend's caches are its own and nothing of
    the caller's cgtrees or cache settings leaks in; its table divides each warm start by the best
    warm start of Inductor's backends in the same call, cold processes aside."""
    real = bench("warm_real")
    monkeypatch.setenv("CGTREES_PRECOMPILE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    plain, pc = real.environment("cgtrees", Path("/c1")), real.environment("cgtrees-pc", Path("/c2"))
    assert "CGTREES_PRECOMPILE_CACHE" not in plain and pc["CGTREES_PRECOMPILE_CACHE"] == "1"
    assert plain["CGTREES_CACHE_DIR"] == "/c1/cgtrees" and plain["TORCHINDUCTOR_CACHE_DIR"] == "/c1/inductor"
    assert real.environment("cgtrees", Path("/c1"), ("CGTREES_WARM_FIRST_CALLS=0",))["CGTREES_WARM_FIRST_CALLS"] == "0"
    rows = [{"model": "llama_1b", "backend": b, "label": label, "first_s": s, "phases": {"dynamo": 0.5}}
            for b, label, s in (("cgtrees", "cold", 25.0), ("cgtrees", "warm-1", 3.0), ("cgtrees", "warm-2", 2.8),
                                ("reduce-overhead", "cold", 30.0), ("reduce-overhead", "warm-1", 7.0),
                                ("inductor", "cold", 1.0), ("inductor", "warm-1", 5.6))]
    lines = {line.split()[1]: line.split() for line in real.table(rows).splitlines()[1:]}
    assert lines["cgtrees"][2:5] == ["25.00", "2.80", "0.50x"], lines  # the best warm sample, over 5.6
    assert lines["reduce-overhead"][4] == "1.25x" and lines["inductor"][4] == "1.00x", lines
    # a --warm-env process has its own line, out of the best-warm figures; the decode window's host parts
    rows += [{"model": "llama_1b", "backend": "cgtrees", "label": "warm-SERVE_CGTREES_MARK_0", "first_s": 1.4,
              "host": {"prefill": [0.1], "marks": [], "steps": [0.3, 0.1, 0.01, 0.01]}}]
    rows[2]["host"] = {"prefill": [0.1], "marks": [1.1, 0.0], "steps": [0.4, 0.1, 0.01]}
    text = real.table(rows)
    best = next(line for line in text.splitlines() if " cgtrees " in line and "[" not in line)
    assert "2.80" in best and "marks=1.10 step1=0.40 step2=0.10 later steps=0.01" in best, text
    extra = next(line for line in text.splitlines() if "[warm-SERVE_CGTREES_MARK_0]" in line)
    assert "1.40" in extra and "0.25x" in extra and "marks=0.00" in extra, text


def test_warm_real_counts_torchs_and_our_warning_lines():
    """A warning line as a user sees one: Python's, torch's logging (``W1128 ...``, which says no
    "warn") and ours; the phase shim's line and a JSON line are not."""
    stderr = ("W1128 21:48:42.290000 708 torch/_dynamo/guards.py:4418] [0/0] ID_MATCH guard on G['all'] is dropped\n"
              "PHASES {\"dynamo\": 1.0}\n"
              "/x.py:3: UserWarning: TensorFloat32 tensor cores\n"
              "cgtrees: CGTREES_PRECOMPILE_CACHE=1: Dynamo drops the guards it cannot save\n"
              "cgtrees codegen: k: its stored binaries could not be installed\n"
              "{\"first_s\": 1.0}\n")
    assert len(bench("warm_real").warning_lines(stderr)) == 4
