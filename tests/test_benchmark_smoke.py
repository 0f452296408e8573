"""The benchmark suite never rots: `benchmarks/run.py --smoke` runs every workload, both modes,
eager and cgtrees, at tiny sizes on the CPU, and every row comes back measured and right. The
cgtrees rows run generated kernels through Triton's interpreter, so this is also codegen end to end
on every workload: no graph may fall back to aten as a whole."""

import json
import math
import os
import subprocess
import sys

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
    text = out.read_text()
    window = float(text.split()[1])
    assert row["ok"] and abs(window - row["first3_s"]) < 0.05  # the window is the timed first calls
    inclusive = text.split("## inclusive (s)\n")[1].split("\n\n")[0].splitlines()
    totals = {line.split()[1]: float(line.split()[0]) for line in inclusive}
    step = next(s for where, s in totals.items() if where.endswith("(first_outputs)"))
    assert step > 0.5 * window  # the samples cover the window
    ours = next(s for where, s in totals.items() if "backend/api.py:" in where and where.endswith("(__call__)"))
    assert 0 < ours < step  # our compiler, inside the first call
