"""The serving suite (``benchmarks/serve_run.py``) never rots: ``--smoke`` decodes with a tiny float32
Llama on the CPU, both paths (a plain loop over a static cache, Hugging Face's ``generate`` with a
``CompileConfig``), eager and cgtrees, each row in a fresh process (cgtrees's kernels through
Triton's interpreter); every row comes back measured, cgtrees's tokens equal eager's, and the
report writes the table between its markers."""

import json
import os
import subprocess
import sys

import pytest
from subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_decodes_both_paths_as_eager_and_reports(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
    out = tmp_path / "out"
    env = clean_env(drop=("CGTREES_",))  # the runner sets what it needs
    done = subprocess.run([sys.executable, "benchmarks/serve_run.py", "--smoke", "--out-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "serve-loop_hf-b1-c24-smoke.json").read_text())["rows"]
    assert {(r["path"], r["backend"]) for r in rows} == {(p, b) for p in ("loop", "hf") for b in ("eager", "cgtrees")}
    for r in rows:
        name = f"{r['path']}/{r['backend']}"
        assert r["ok"], f"{name}: {r.get('error')}\n{r.get('traceback', '')}"
        assert r["tokens_equal"] == 8 and r["logits_rel_err"] < 1e-5, (name, r["tokens_equal"], r["logits_rel_err"])
        assert r["ms_token"] > 0 and r["tokens_s"] > 0 and r["ttft_ms"] > 0, name
        if r["backend"] == "cgtrees":
            c = r["counters"]["cgtrees"]
            assert c["graphs_compiled"] == 1 and c.get("graph_fallbacks", 0) == 0, (name, c)
    page = tmp_path / "page.md"
    page.write_text("# page\n")
    report = subprocess.run([sys.executable, "benchmarks/serve_run.py", "--report", str(out), "--markdown", str(page)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    table = page.read_text().split("<!-- serving:start -->")[1].split("<!-- serving:end -->")[0]
    assert table.count("| cpu |") == 4 and "| loop | cgtrees | 1 | 24 |" in table, table
