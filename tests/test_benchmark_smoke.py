"""The benchmark suite never rots: `benchmarks/run.py --smoke` runs every workload, both modes,
eager and cgtrees, at tiny sizes on the CPU, and every row comes back measured and right. The
cgtrees rows run generated kernels through Triton's interpreter, so this is also codegen end to end
on every workload: no graph may fall back to aten as a whole."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from bench_helpers import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ("mlp_small", "norm_act", "gpt_block", "convnet", "decode")


def test_smoke_run_measures_every_row(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "CGTREES_CACHE_DIR": str(tmp_path / "cache"), "CGTREES_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "benchmarks/run.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "summary" in done.stdout
    rows = json.loads(out.read_text())["rows"]

    expected = {(w, m, b) for w in WORKLOADS for m in ("infer", "train") for b in ("eager", "cgtrees")
                if not (w == "decode" and m == "train")}
    assert {(r["workload"], r["mode"], r["backend"]) for r in rows} == expected
    for r in rows:
        name = f"{r['workload']}/{r['mode']}/{r['backend']}"
        assert r["ok"], f"{name}: {r['error']}\n{r.get('traceback', '')}"
        for key in ("first_s", "first3_s", "step_s"):
            assert math.isfinite(r[key]) and r[key] > 0, f"{name}: {key}={r[key]}"
        # the clock starts at the torch.compile call
        assert 0 < r["compile_call_s"] <= r["first_s"] <= r["first3_s"], name
        assert r["max_err"] < 1e-4, f"{name}: error vs eager {r['max_err']}"

    # The runner clears the counters before each row: these are the row's own.
    for r in rows:
        if r["backend"] == "cgtrees":
            ours = r["counters"]["cgtrees"]
            name = f"{r['workload']}/{r['mode']}"
            assert ours.get("graph_fallbacks", 0) == 0, f"{name}: a graph ran through aten: {ours}"
            assert ours.get("kernels_generated", 0) > 0, f"{name}: no kernel was generated: {ours}"


def _runner():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import run
    finally:
        sys.path.pop(0)
    return run


def test_warm_row_is_the_median_run_and_lists_every_run():
    run = _runner()
    rows = [{"ok": True, "first3_s": 3.0, "tag": "slow"}, {"ok": False, "first3_s": None, "tag": "failed"},
            {"ok": True, "first3_s": 1.0, "tag": "fast"}, {"ok": True, "first3_s": 2.0, "tag": "middle"}]
    kept = run.median_row(rows)
    assert kept["tag"] == "middle" and kept["first3_runs"] == [1.0, 2.0, 3.0] and kept["runs"] == 4
    assert run.median_row([rows[2], rows[0]])["tag"] == "slow"  # of two, the slower: never flattering
    assert run.median_row([rows[1]])["tag"] == "failed"  # no good run: the failure is the row


def test_result_folder_merges_in_numeric_order(tmp_path):
    """A later run's rows win a merge: ``10-...`` comes after ``9-...``, not before ``2-...``."""
    run = _runner()
    for name in ("10-b.json", "2-a.json", "9-c.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in run.result_files(str(tmp_path))] == ["2-a.json", "9-c.json", "10-b.json"]


def test_a_row_the_budget_cut_short_is_not_run_and_loses_no_earlier_row(tmp_path):
    """A worker whose timeout was what was left of ``--budget`` measured nothing: the row says
    "not run", and a merge keeps an earlier file's row for it (a timeout of its own is a failure)."""
    run = _runner()
    spec = {"workload": "mlp_small", "backend": "eager", "mode": "infer", "device": "cpu", "phase": "cold",
            "smoke": True}
    cut = run.run_worker(spec, {}, 0.5, budget_cut=True)  # a worker cannot import torch in 0.5 s
    own = run.run_worker(spec, {}, 0.5)
    assert cut["error"].startswith(run.NOT_RUN) and "timed out" in cut["error"]
    assert own["error"].startswith("worker timed out")
    earlier = {**spec, "ok": True, "error": None, "step_s": 1.0}
    for name, row in (("1-a.json", earlier), ("2-b.json", cut)):
        (tmp_path / name).write_text(json.dumps({"rows": [row]}))
    assert run.load(str(tmp_path))[0] == [earlier]
    (tmp_path / "3-c.json").write_text(json.dumps({"rows": [own]}))
    assert run.load(str(tmp_path))[0][0]["error"] == own["error"]


def test_a_replacing_row_without_a_profile_keeps_the_earlier_one_and_says_whose(tmp_path):
    run, report = _runner(), bench("report")
    key = {"workload": "decode", "mode": "infer", "backend": "cgtrees", "phase": "cold", "ok": True, "error": None}
    files = [("1-a.json", {**key, "step_s": 2.0, "profile": "kernels of run 1"}), ("2-b.json", {**key, "step_s": 1.5}),
             ("3-c.json", {**key, "step_s": 1.0})]
    for name, row in files:
        (tmp_path / name).write_text(json.dumps({"rows": [row]}))
    (row,) = run.load(str(tmp_path))[0]
    assert row["step_s"] == 1.0 and row["profile"] == "kernels of run 1" and row["profile_from"] == "1-a.json"
    text = report.details([row], None, {})  # profiles go beside the results, not on the page
    assert "Profile of steady state: decode / infer / cgtrees (an earlier run: 1-a.json)" in text
    assert "Profile of steady state" not in report.markdown([row], None, {})
    (tmp_path / "4-d.json").write_text(json.dumps({"rows": [{**key, "step_s": 0.9, "profile": "run 4"}]}))
    (row,) = run.load(str(tmp_path))[0]
    assert row["profile"] == "run 4" and "profile_from" not in row


def test_primed_byte_code_cache_covers_each_backend_and_mode(tmp_path):
    run = _runner()
    args = run.parse_args(["--models", "decode,mlp_small", "--backends", "inductor,cgtrees", "--cold-warm"])
    primes = run.prime_specs(run.plan(args, "cuda"))
    assert {(p["backend"], p["mode"], p["workload"]) for p in primes} == {
        ("inductor", "infer", "decode"), ("cgtrees", "infer", "decode"),
        ("inductor", "train", "mlp_small"), ("cgtrees", "train", "mlp_small")}  # decode is inference only
    assert all(p["smoke"] and p["phase"] == "prime" for p in primes)
    env = run.bytecode_env(tmp_path)
    assert env["PYTHONPYCACHEPREFIX"].startswith(str(tmp_path)) and env["PYTHONDONTWRITEBYTECODE"] == ""


def test_report_says_how_warm_rows_were_measured():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import report
    finally:
        sys.path.pop(0)
    old = [{"phase": "warm", "first3_s": 1.0}]
    new = [{"phase": "warm", "first3_s": 1.0, "first3_runs": [0.9, 1.0, 1.2], "bytecode_primed": True}]
    assert "median" not in report._warm_method(old) and "byte code" not in report._warm_method(old)
    assert "median" in report._warm_method(new) and "byte code" in report._warm_method(new)
    assert "byte code" not in report._warm_method(old + new)  # only when every row had it
    assert report.runs_note(new[0]) == " (median of 0.90, 1.00, 1.20)"


def test_sampled_first_calls_name_where_the_time_went(tmp_path):
    out = tmp_path / "start.txt"
    env = {**os.environ, "CGTREES_CACHE_DIR": str(tmp_path / "cache"), "CGTREES_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "benchmarks/sample_start.py", "--out", str(out), "--", "--workload",
                           "mlp_small", "--backend", "cgtrees", "--mode", "train", "--smoke", "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    compiling, text = out.read_text().split("# the first outputs\n")
    assert compiling.startswith("# the torch.compile call\n")
    compile_window, window = float(compiling.split()[5]), float(text.split()[1])
    assert row["ok"] and abs(compile_window - row["compile_call_s"]) < 0.05  # the torch.compile call
    # the windows are the timed first outputs, counted from the torch.compile call
    assert abs(compile_window + window - row["first3_s"]) < 0.05
    inclusive = text.split("## inclusive (s)\n")[1].split("\n\n")[0].splitlines()
    totals = {line.split()[1]: float(line.split()[0]) for line in inclusive}
    step = next(s for where, s in totals.items() if where.endswith("(first_outputs)"))
    assert step > 0.5 * window  # the samples cover the window
    ours = next(s for where, s in totals.items() if "backend/api.py:" in where and where.endswith("(__call__)"))
    assert 0 < ours < step  # our compiler, inside the first call


def test_compiled_autograd_row_compiles_the_backward_and_matches_eager():
    """A ``cgtrees-ca`` train row (issue 20): the backward captured by compiled autograd reaches cgtrees
    as a compiled-autograd graph, none falls back, and the first step's loss and gradients equal eager's."""
    run, _ = bench("run"), bench("worker")  # run_smoke imports the worker by its bare name
    spec = {"workload": "mlp_small", "backend": "cgtrees-ca", "mode": "train", "device": "cpu", "phase": "cold",
            "smoke": True}
    (row,) = run.run_smoke([spec], lambda rows: None)  # counters cleared first: these are the row's own
    assert row["ok"], f"{row['error']}\n{row.get('traceback', '')}"
    assert row["rel_err_out"] < 1e-4 and row["rel_err_grad"] < 1e-4, row  # fp32: ~1e-7 measured
    assert row["max_err"] < 1e-4
    ours = row["counters"]["cgtrees"]
    assert ours["graph_fallbacks"] == 0, ours
    assert row["ca_captures"] >= 1 and row["compiled_autograd_graphs"] >= 1, (row["ca_captures"], ours)
    assert row["backward_replays"] == 0  # no CUDA graphs on the CPU
    assert math.isfinite(row["step_s"]) and row["step_s"] > 0


def test_plan_gives_compiled_autograd_backends_train_rows_cold_and_warm():
    run = bench("run")
    args = run.parse_args(["--models", "mlp_small", "--backends", "eager,cgtrees,cgtrees-ca,inductor-ca",
                           "--cold-warm", "--no-floor"])
    specs = [(s["mode"], s["backend"], s["phase"]) for s in run.plan(args, "cuda")]
    assert specs == [("infer", "eager", "cold"), ("infer", "cgtrees", "cold"), ("infer", "cgtrees", "warm"),
                     ("train", "eager", "cold"), ("train", "cgtrees", "cold"), ("train", "cgtrees", "warm"),
                     ("train", "cgtrees-ca", "cold"), ("train", "cgtrees-ca", "warm"),
                     ("train", "inductor-ca", "cold"), ("train", "inductor-ca", "warm")]
    ca = next(s for s in run.plan(args, "cuda") if s["backend"] == "cgtrees-ca")
    assert run.cache_env(Path("/r"), ca) != run.cache_env(Path("/r"), {**ca, "backend": "cgtrees"})  # own caches


def _own_row(backend, step_s, phase="cold", **extra):
    return {"workload": "gpt_block", "mode": "train", "backend": backend, "phase": phase, "ok": True,
            "step_s": step_s, "first_s": 1.0, "first3_s": 2.0, "max_err": 1e-6, **extra}


def test_report_checks_issue_20_targets_and_shows_the_ca_rows():
    report = bench("report")
    rows = [_own_row("eager", 9e-3), _own_row("inductor", 5e-3), _own_row("cgtrees", 5.2e-3),
            _own_row("inductor-ca", 5.0e-3, ca_captures=1),
            _own_row("cgtrees-ca", 5.1e-3, ca_captures=1, compiled_autograd_graphs=1, backward_replays=40)]
    found = {c.text for c in report.checks(rows)}
    assert "<= 1x best other (inductor): 1.04x MISS by 1.04x" in found  # issue 6's: the -ca rows left out
    assert "cgtrees-ca <= 1x inductor-ca: 1.02x MISS by 1.02x" in found
    assert "cgtrees-ca <= 1x cgtrees: 0.98x ok" in found
    text = report.tables(rows)
    assert "| figure | eager | inductor | inductor-ca | cgtrees | cgtrees-ca | cgtrees / best other | target |" in text
    assert "| per call (us) | 9000.0 | 5000.0 | 5000.0 | 5200.0 | 5100.0 | 1.04x (inductor) |" in text
    assert "| replays of cgtrees's backward graphs | - | - | - | - | 40 | - |" in text
    summary = report.summary(rows)
    assert "MISS gpt_block/train per call (us): cgtrees-ca <= 1x inductor-ca: 1.02x" in summary

    # Result files from before compiled autograd have no -ca rows: no issue 20 check, nothing fails.
    old = [r for r in rows if not r["backend"].endswith("-ca")]
    assert not any("-ca" in c.text for c in report.checks(old)) and "-ca" not in report.tables(old)
    # A -ca row that failed: the target says so instead of passing.
    failed = [*old, _own_row("inductor-ca", 5e-3), {**_own_row("cgtrees-ca", None), "ok": False, "error": "x"}]
    assert "cgtrees-ca <= 1x inductor-ca: n/a (cgtrees-ca missing or failed)" in {c.text for c in report.checks(failed)}


def test_markdown_rewrite_keeps_hand_written_blocks_verbatim(tmp_path):
    """docs/warm_start.md holds a hand-written precompile section between markers: rewriting the file
    with ``--markdown`` (here from result files, old and new, merged) keeps it byte for byte."""
    run = bench("run")
    old_file = os.path.join(ROOT, "benchmarks", "results", "4-gpt_block-train.json")
    new_file = tmp_path / "ca.json"
    new_file.write_text(json.dumps({"meta": {"date": "today", "command": "ca"},
                                    "rows": [_own_row("cgtrees-ca", 5e-3), _own_row("inductor-ca", 6e-3)]}))
    block = ("<!-- precompile:begin -->\n## Precompile\n\nWritten by hand:  `x`  \n\n| a | b |\n"
             "<!-- precompile:end -->\n")
    real = "<!-- real-models:begin -->\n## Real models\nkept\n<!-- real-models:end -->\n"
    doc = tmp_path / "warm_start.md"
    doc.write_text("# Old report\n\nold tables\n\n" + block + "\nbetween\n\n" + real)
    run.main(["--from-json", f"{old_file},{new_file}", "--markdown", str(doc)])
    text = doc.read_text()
    assert "old tables" not in text and "### gpt_block / train" in text
    assert block in text and real in text and text.index(block) < text.index(real)
    assert "cgtrees-ca <= 1x inductor-ca: 0.83x ok" in text
    run.main(["--from-json", str(old_file), "--markdown", str(doc)])  # again: kept once, not twice
    assert doc.read_text().count("<!-- precompile:begin -->") == 1 and block in doc.read_text()


def test_the_repository_warm_start_doc_keeps_its_precompile_block(tmp_path):
    """The real docs/warm_start.md rebuilt from its own result files keeps its precompile section."""
    run = bench("run")
    doc = tmp_path / "warm_start.md"
    original = open(os.path.join(ROOT, "docs", "warm_start.md")).read()
    start, end = original.index("<!-- precompile:begin -->"), original.index("<!-- precompile:end -->")
    block = original[start:end + len("<!-- precompile:end -->")]
    doc.write_text(original)
    results = os.path.join(ROOT, "benchmarks", "results")
    run.main(["--from-json", f"{results}/check-warm-median-mlp_small-norm_act.json", "--markdown", str(doc)])
    assert block in doc.read_text()


def test_profile_sums_every_kernel_by_kind():
    """The profile's per-call device time by kind counts every kernel, not only the table's rows:
    generated kernels (ours and Inductor's), copies and fills, library kernels; CPU ops are left out."""
    from types import SimpleNamespace

    import torch

    measure = bench("measure")
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name: str, us: float, count: int, device=cuda) -> SimpleNamespace:
        return SimpleNamespace(key=name, self_device_time_total=us, count=count, device_type=device)

    events = [event("pw_fused_add_3", 40.0, 10), event("triton_poi_fused_copy__1", 20.0, 10),
              event("Memcpy DtoD (Device -> Device)", 30.0, 20), event("void at::native::fill_kernel", 10.0, 10),
              event("sm90_xmma_gemm_f32f32", 100.0, 30), event("CompiledFunctionBackward", 999.0, 10, cpu)]
    line = measure.device_time_by_kind(events, calls=10)
    assert "generated 6.0 us (2 launches)" in line
    assert "copies 4.0 us (3 launches)" in line
    assert "library 10.0 us (3 launches)" in line


def test_the_report_says_where_the_first_outputs_clock_starts():
    """Rows that kept ``compile_call_s`` were timed from the torch.compile call (where a -pc warm
    process loads Dynamo's saved entry); the report says so, and says when rows mix both."""
    report = bench("report")
    new, old = {"first3_s": 1.0, "compile_call_s": 0.2}, {"first3_s": 1.0}
    assert report._start_point([new]).startswith("the `torch.compile` call (")
    assert report._start_point([old]) == "the first call"
    assert "in rows that kept" in report._start_point([new, old])


def test_the_page_opens_with_one_table_of_the_newest_runs_and_where_they_ran(tmp_path):
    """A page rebuilt from two result files opens with the suite's table: every backend side by side,
    each cell the newest run of its row, the target beside it, and the GPU, torch and commit of those
    runs (a file's recorded commit, else the one its name gives). The runs' commands go to the details,
    their paths on the GPU machine shortened; ``--backends`` with ``--from-json`` reports those only."""
    run = bench("run")
    h100 = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"}
    old = tmp_path / "1-own-at-aaaaaaa.json"
    old.write_text(json.dumps({"meta": {"date": "day 1", "command": "python benchmarks/run.py --out /root/out/1.json"},
                               "rows": [{**_own_row("inductor", 6e-3), **h100},
                                        {**_own_row("cgtrees", 7e-3), **h100}]}))
    new = tmp_path / "2-own.json"
    new.write_text(json.dumps({"meta": {"date": "day 2", "command": "python benchmarks/run.py", "commit": "bbbbbbb"},
                               "rows": [{**_own_row("cgtrees", 5e-3), "device_name": "NVIDIA H200",
                                         "torch": "2.11.0+cu130"}]}))
    doc, details = tmp_path / "page.md", tmp_path / "details.md"
    run.main(["--from-json", f"{old},{new}", "--markdown", str(doc), "--details", str(details)])
    text, full = doc.read_text(), details.read_text()
    head = "| workload / mode | figure | inductor | cgtrees | against target | GPU | torch | commit |"
    line = ("| gpt_block / train | per call (us) | 6000.0 | 5000.0 | 0.83x inductor ok | H100; cgtrees: H200 | "
            "2.11.0+cu130 | aaaaaaa; cgtrees: bbbbbbb |")  # the newer cgtrees row, and where each ran
    assert head in text and line in text and text.index(line) < text.index("## How to read the tables")
    assert "7000.0" not in text and "/root/" not in text + full and "day 1" not in text
    assert "- `1-own-at-aaaaaaa.json` (day 1, commit aaaaaaa): `python benchmarks/run.py --out 1.json`" in full
    assert "- `2-own.json` (day 2, commit bbbbbbb)" in full and "targets met: 1 of 2" in full

    measured = run.stamp([_own_row("eager", 1e-3)], {"commit": "ccccccc"})  # a row of this call: its commit
    assert measured[0]["commit"] == "ccccccc"
    assert run.parse_args(["--commit", "ddddddd"]).commit == "ddddddd"  # where the tree has no .git

    run.main(["--from-json", f"{old},{new}", "--backends", "cgtrees", "--markdown", str(doc)])
    page = doc.read_text()
    assert "| workload / mode | figure | cgtrees | against target | GPU |" in page and "6000.0" not in page
