"""Run the serving benchmark (``serve_worker.py``): each row in a fresh process with empty caches.

On the GPU machine (a row of the 1.1B model takes ~0.5-1.5 min, most of it compiling):

    python benchmarks/serve_run.py --paths loop,hf --batches 1 --caches 160 --budget 540 --out-dir $OUT
    python benchmarks/serve_run.py --paths loop --batches 8,32 --caches 160 --budget 540 --out-dir $OUT
    python benchmarks/serve_run.py --paths loop --batches 1 --caches 4096 --budget 540 --out-dir $OUT
    # Llama-3-8B's shape (16 GB of bf16 weights, made on the GPU): a row takes ~1-3 min
    python benchmarks/serve_run.py --models llama_8b --paths loop --batches 1 --caches 160 --budget 540 --out-dir $OUT

then, on any machine, with the files copied to ``benchmarks/results/serving/``:

    python benchmarks/serve_run.py --report benchmarks/results/serving --markdown docs/benchmarks.md

and on a CPU, in a minute (a tiny fp32 Llama, cgtrees's kernels through Triton's interpreter):

    python benchmarks/serve_run.py --smoke --out-dir /tmp/serve-smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

from run import Budget, git_commit, launch_worker
from size_run import worker_env

HERE = Path(__file__).resolve().parent
COLUMNS = ("model", "path", "backend", "batch", "cache", "ms_token", "tokens_s", "hbm_fraction", "busy_ms", "ttft_ms",
           "compile_s", "tokens_equal", "logits_rel_err")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama_1b", help="comma-separated: llama_1b, llama_8b")
    p.add_argument("--paths", default="loop,hf")
    p.add_argument("--backends", default="eager,reduce-overhead,cgtrees")
    p.add_argument("--batches", default="1")
    p.add_argument("--caches", default="160")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out-dir")
    p.add_argument("--commit")
    p.add_argument("--report", help="a folder of JSON files: print (and --markdown) their table, run nothing")
    p.add_argument("--markdown", help="write the table between the serving markers of this file")
    a = p.parse_args(argv)
    if a.smoke:
        a.backends = "eager,cgtrees" if a.backends == p.get_default("backends") else a.backends
        a.caches, a.new = "24", 8
    return a


def plan(a: argparse.Namespace) -> list[dict]:
    return [{"model": model, "path": path, "backend": b, "batch": int(batch), "cache": int(cache)}
            for model in a.models.split(",") for path in a.paths.split(",")
            for batch in a.batches.split(",") for cache in a.caches.split(",") for b in a.backends.split(",")]


def run_row(spec: dict, a: argparse.Namespace, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="cgtrees-serve-") as tmp:
        result, log = Path(tmp) / "row.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, str(HERE / "serve_worker.py"), "--model", spec["model"], "--path", spec["path"],
               "--backend", spec["backend"], "--batch", str(spec["batch"]), "--cache", str(spec["cache"]),
               "--new", str(a.new), "--result", str(result)] + (["--smoke", "--repeats", "1"] if a.smoke else [])
        device = "cpu" if a.smoke else "cuda"
        rc, wall = launch_worker(cmd, worker_env({**spec, "device": device}, Path(tmp), ""), log, result, timeout)
        if result.exists():
            return {**json.loads(result.read_text()), "process_s": wall}
        why = "timed out" if rc is None else f"exited {rc}"
        return {**spec, "status": "error", "ok": False, "error": f"worker {why}: {log.read_text()[-1500:]}"}


def cell(row: dict, key: str) -> str:
    if key == "busy_ms":  # reduce-overhead's profile is not its replay (the profiler saw ~300 fills a token)
        value = None if row.get("backend") == "reduce-overhead" else (row.get("profile") or {}).get("busy_ms")
    else:
        value = row.get(key)
    if value is None:
        return "-"
    if key == "hbm_fraction":
        return f"{value:.0%}"
    if key == "logits_rel_err":
        return f"{value:.0e}"
    if isinstance(value, float):
        return f"{value:.2f}" if value < 100 else f"{value:.0f}"
    return str(value)


def table(rows: list[dict], markdown: bool = False) -> str:
    head = list(COLUMNS) + ["commit", "status"]
    lines = []
    for r in rows:
        gpu = (r.get("environment") or {}).get("device_name") or ""
        status = r["status"] if r["ok"] else f"{r['status']}: {' '.join(str(r.get('error')).split())[:80]}"
        lines.append([cell(r, k) for k in COLUMNS] + [r.get("commit", ""), status, gpu])
    head.append("GPU")
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(line) + " |" for line in lines])
    return "\n".join(["  ".join(f"{h:>9}" for h in head)] + ["  ".join(f"{c:>9}" for c in line) for line in lines])


def load(folder: Path) -> list[dict]:
    """Every row of the folder's files, the newest file winning per (model, path, backend, batch, cache);
    rows from before ``--models`` existed are the 1.1B model's."""
    rows: dict[tuple, dict] = {}
    files = [(json.loads(path.read_text()), path.name) for path in folder.glob("serve-*.json")]
    # newest last by the date each file records (a fresh clone gives every file the same mtime)
    for data, _ in sorted(files, key=lambda f: (f[0]["meta"].get("date", ""), f[1])):
        for row in data["rows"]:
            row = {"model": "llama_1b", **row, "commit": data["meta"]["commit"]}
            rows[(row["model"], row["path"], row["batch"], row["cache"], row["backend"])] = row
    order = {b: i for i, b in enumerate(("eager", "reduce-overhead", "cgtrees"))}
    return sorted(rows.values(),
                  key=lambda r: (r["model"], r["path"], r["batch"], r["cache"], order.get(r["backend"], 9)))


def write_markdown(path: Path, text: str) -> None:
    start, end = "<!-- serving:start -->", "<!-- serving:end -->"
    doc = path.read_text()
    if start not in doc:
        doc += f"\n{start}\n{end}\n"
    head, rest = doc.split(start, 1)
    path.write_text(head + start + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.report:
        rows = load(Path(a.report))
        print(table(rows))
        if a.markdown:
            write_markdown(Path(a.markdown), table(rows, markdown=True))
        return 0
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": "python benchmarks/serve_run.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": a.commit or git_commit(), "smoke": a.smoke}
    models = "" if a.models == "llama_1b" else a.models.replace(",", "_") + "-"
    name = f"serve-{models}{a.paths.replace(',', '_')}-b{a.batches.replace(',', '_')}-c{a.caches.replace(',', '_')}"
    out = Path(a.out_dir) / f"{name}{'-smoke' if a.smoke else ''}.json" if a.out_dir else None
    budget, rows = Budget(a.budget), []
    for spec in plan(a):
        if budget.spent():
            rows.append({**spec, "status": "not run", "ok": False, "error": "the --budget was spent"})
            continue
        start = time.perf_counter()
        rows.append(run_row(spec, a, budget.timeout(a.timeout)))
        print(f"{spec} {rows[-1]['status']} in {time.perf_counter() - start:.0f}s: "
              f"{cell(rows[-1], 'ms_token')} ms/token {rows[-1].get('error') or ''}"[:400], flush=True)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print("\n" + table([{**r, "commit": meta["commit"]} for r in rows]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
