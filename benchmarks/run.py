"""The benchmark suite of issue 6: cgtrees beside eager, Inductor, reduce-overhead and cudagraphs.

    python benchmarks/run.py --models mlp_small,norm_act --modes infer,train \\
        --backends eager,inductor,reduce-overhead,cudagraphs,cgtrees --cold-warm \\
        [--kernels] [--out results.json] [--markdown docs/benchmarks.md]
    python benchmarks/run.py --smoke                  # CPU, tiny sizes, one process (CI)
    python benchmarks/run.py --from-json a.json,b.json --markdown docs/benchmarks.md
    python benchmarks/run.py --suite real --models gpt2 --modes train --cold-warm --budget 480 --out-dir OUT
    python benchmarks/run.py --suite real --from-json benchmarks/results/real --markdown docs/benchmarks.md

``--suite real`` measures the library models of ``real_models.py`` (eager, inductor, reduce-overhead
and cgtrees by default, no floor rows) with the same workers; its report is the "Real models"
section of the markdown file (``real_report.py``), which the own suite's report keeps.

Each (workload, backend, mode) runs in a fresh process (``worker.py``) with fresh cache
directories (cold); with ``--cold-warm``, backends that keep a compile cache run again in fresh
processes reusing them (warm: ``--warm-runs`` processes, the row of the median first outputs kept).
On CUDA, inference also gets the ``raw_graph`` floor row.

Compiled autograd (issue 20): the backends ``cgtrees-ca``, ``inductor-ca`` and ``reduce-overhead-ca``
(named in ``--backends``; training rows only) run the same step with the backward captured by
compiled autograd and compiled by the same backend (``worker.py`` says how), cold and warm:

    python benchmarks/run.py --models gpt_block --modes train --no-floor --cold-warm --warm-runs 1 --budget 540 \\
        --backends eager,cgtrees,cgtrees-ca,inductor,inductor-ca,reduce-overhead,reduce-overhead-ca,cudagraphs \\
        --out ca.json

Warm starts without Dynamo's trace (issue 19): the backends ``cgtrees-pc`` and ``inductor-pc`` (named in
``--backends``) run with Dynamo's caching precompile (``backend_names.py``: ``CGTREES_PRECOMPILE_CACHE=1``
in a cgtrees-pc worker's environment, ``worker_environ``; ``worker.py`` turns it on for inductor-pc),
each with cache directories of its own; the report checks issue 19's warm-start targets for cgtrees and
cgtrees-pc against the best Inductor warm start and our best cold start. One workload (or real model
and mode) per 10-minute call, cold and three warm processes each:

    python benchmarks/run.py --models gpt_block --modes infer,train --no-floor --cold-warm --budget 540 \\
        --backends inductor,inductor-pc,cgtrees,cgtrees-pc --out gpt_block-pc.json
    python benchmarks/run.py --suite real --models gpt2 --modes train --cold-warm --budget 540 \\
        --backends inductor,inductor-pc,cgtrees,cgtrees-pc --out-dir OUT

``--markdown`` rewrites the whole page but keeps, verbatim and in their order, every block between
``<!-- name:begin -->`` and ``<!-- name:end -->`` that it had (the real-model section, hand-written
ones such as the precompile section of docs/warm_start.md), right after the own suite's table and the
reading of its misses (``--analysis``); the real-size and serving sections (``report.FIRST``) open the
page. ``--details`` writes what the page leaves out (each run's command, every target, start-up phases,
profiles; for the real suite its full tables) to a file beside the results. Each table names the GPU,
torch and commit of its rows: a result file's commit is
its ``meta["commit"]`` (``--commit``, else ``git_commit``: ``+dirty`` when ``backend/`` had changes), or
for older files the ``-at-<commit>`` in its name.

Python byte code: an installed package has its modules compiled, but an image may ship none and set
``PYTHONDONTWRITEBYTECODE`` (the GPU machine does), so that every worker would compile from source
every module it imports, lazily imported ones inside the timed first calls included. Workers
therefore share a byte-code cache under the run's directory, primed by one untimed tiny run of
each backend and mode before any row (``--no-bytecode-cache`` turns both off).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import backend_names
import overview
import real_models
import real_report
import report
import workloads

HERE = Path(__file__).resolve().parent
ALL_BACKENDS = "eager,inductor,reduce-overhead,cudagraphs,cgtrees"
CACHE_VARS = {"CGTREES_CACHE_DIR": "cgtrees", "TORCHINDUCTOR_CACHE_DIR": "inductor",
              "TRITON_CACHE_DIR": "triton"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=("own", "real"), default="own",
                   help="own: the workloads of workloads.py; real: the library models of real_models.py")
    p.add_argument("--models", default=None, help="default: the whole suite ('' with --kernels: kernels only)")
    p.add_argument("--modes", default="infer,train")
    p.add_argument("--backends", default=None, help=f"default: {ALL_BACKENDS} (real: {real_report.BACKENDS}); "
                   "with --from-json, the backends to report (default: every one in the files); "
                   f"also {', '.join(backend_names.CA_BACKENDS)} (compiled autograd, train rows only) and "
                   f"{', '.join(backend_names.PC_BACKENDS)} (Dynamo's caching precompile)")
    p.add_argument("--cold-warm", action="store_true", help="also warm runs for cached backends")
    p.add_argument("--warm-runs", type=int, default=3,
                   help="warm processes per row; the row of the median first 3 outputs is kept")
    p.add_argument("--no-bytecode-cache", action="store_true",
                   help="workers compile Python modules as the environment says (no shared, primed cache)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU, eager and cgtrees, one process")
    p.add_argument("--kernels", action="store_true", help="also the kernel bandwidth report")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu for --smoke)")
    p.add_argument("--no-floor", action="store_true", help="skip the raw_graph rows")
    p.add_argument("--profile", default="", help="backends whose cold rows also get a profile, e.g. cgtrees")
    p.add_argument("--profile-start", default="",
                   help="backends whose cold rows run their first calls under cProfile (slows them)")
    p.add_argument("--profile-warm-start", default="",
                   help="backends whose warm rows run their first calls under cProfile (slows them: "
                        "their warm figures are then not comparable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per worker process")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: no row starts after this long (those are listed as not run), "
                   "and no worker runs past it")
    p.add_argument("--out", help="write rows (and kernel report) as JSON here")
    p.add_argument("--out-dir", help="write the JSON to a file named after the suite, models and modes in this folder")
    p.add_argument("--markdown", help="write the report here (e.g. docs/benchmarks.md)")
    p.add_argument("--details", help="write what the page leaves out here, beside the result files (the runs' "
                   "commands, every target, start-up phases, profiles; the real suite's full tables)")
    p.add_argument("--note", default="", help="a line for the markdown report (e.g. what is partial)")
    p.add_argument("--commit", help="the commit being measured, where git cannot tell (a copy of the tree "
                   "without .git); default: git rev-parse, +dirty when backend/ has changes")
    p.add_argument("--title", default="", help="the markdown report's title (default: Benchmarks)")
    p.add_argument("--analysis", help="a markdown file: the report's reading of its misses, after the summary")
    p.add_argument("--from-json", help="comma-separated result files or folders (their *.json) to report on, "
                   "running nothing")
    args = p.parse_args(argv)
    if args.models is None:
        real = real_models.HF_MODELS if args.smoke else real_models.MODELS
        args.models = ",".join(real if args.suite == "real" else workloads.WORKLOADS)
    args.only_backends = args.backends.split(",") if args.backends else None  # --from-json: report only these
    if args.backends is None:
        args.backends = real_report.BACKENDS if args.suite == "real" else ALL_BACKENDS
    if args.out_dir and not args.out:
        # letters, digits, '-', '_' and '.' only: the device tool returns no file named otherwise
        name = f"{args.suite}-{args.models.replace(',', '_') or 'kernels'}-{args.modes.replace(',', '_')}"
        args.out = str(Path(args.out_dir) / f"{name}{'-smoke' if args.smoke else ''}.json")
    return args


def plan(args: argparse.Namespace, device: str) -> list[dict]:
    """Every row to run, in order: per workload, per mode, per backend, cold then warm."""
    backends = ["eager", "cgtrees"] if args.smoke else args.backends.split(",")
    specs = []
    for workload in filter(None, args.models.split(",")):
        for mode in filter(None, args.modes.split(",")):
            if mode == "train" and workload in workloads.INFER_ONLY:
                continue
            floor = mode == "infer" and device == "cuda" and not args.no_floor and args.suite == "own"
            extra = ["raw_graph"] if floor else []
            for backend in backends + extra:
                if mode == "infer" and backend_names.is_ca(backend):
                    continue  # compiled autograd compiles a backward: training rows only
                base = {"workload": workload, "backend": backend, "mode": mode, "device": device,
                        "smoke": args.smoke}
                specs.append({**base, "phase": "cold", "profile": backend in args.profile.split(","),
                              "profile_start": backend in args.profile_start.split(",")})
                if args.cold_warm and backend_names.cached(backend) and not args.smoke:
                    specs.append({**base, "phase": "warm",
                                  "profile_start": backend in args.profile_warm_start.split(",")})
    return specs


def cache_env(root: Path, spec: dict) -> dict:
    """Cache directories of one row: the cold run creates them, the warm run reuses them."""
    base = root / f"{spec['workload']}-{spec['mode']}-{spec['backend']}"
    return {var: str(base / sub) for var, sub in CACHE_VARS.items()}


def bytecode_env(root: Path) -> dict:
    """Workers write and share compiled modules under ``root`` (see the module's docstring)."""
    return {"PYTHONPYCACHEPREFIX": str(root / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}


def prime_specs(specs: list[dict]) -> list[dict]:
    """One tiny untimed row per (backend, mode) of the plan, so its imports are compiled once."""
    seen: dict[tuple[str, str], dict] = {}
    for spec in specs:
        if spec["backend"] != "raw_graph":
            seen.setdefault((spec["backend"], spec["mode"]), {**spec, "phase": "prime", "smoke": True,
                                                              "profile": False, "profile_start": False})
    return list(seen.values())


def run_warm(spec: dict, env: dict, budget: Budget, timeout: float, runs: int) -> dict:
    """``runs`` warm processes (fewer if the budget is spent after the first); the row of the median
    first 3 outputs, with every run's figure."""
    rows = [run_worker(spec, env, *budget.limit(timeout))]
    while len(rows) < runs and not budget.spent():
        rows.append(run_worker(spec, env, *budget.limit(timeout)))
    return median_row(rows)


def median_row(rows: list[dict]) -> dict:
    """The middle good run (of two, the slower: never the flattering one); the first if none is good.
    Each good run's ``graphs_compiled`` too, where rows count it: a warm process that compiled is
    not hidden behind a median one that did not."""
    ok = sorted((r for r in rows if r.get("ok") and r.get("first3_s") is not None), key=lambda r: r["first3_s"])
    if not ok:
        return rows[0]
    kept = {**ok[len(ok) // 2], "first3_runs": [r["first3_s"] for r in ok], "runs": len(rows)}
    if any("graphs_compiled" in r for r in ok):
        kept["graphs_compiled_runs"] = [r.get("graphs_compiled") for r in ok]
    return kept


def run_worker(spec: dict, env: dict, timeout: float, budget_cut: bool = False) -> dict:
    """One row in a fresh process; a crash, a timeout or a missing result becomes the row's error.
    ``budget_cut``: ``timeout`` is what was left of ``--budget``; timing out then is a row not run
    (a merge keeps an earlier file's row for it), not a failure."""
    with tempfile.TemporaryDirectory(prefix="cgtrees-row-") as tmp:
        result, log = Path(tmp) / "row.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, str(HERE / "worker.py"), "--workload", spec["workload"], "--backend",
               spec["backend"], "--mode", spec["mode"], "--device", spec["device"], "--phase", spec["phase"],
               "--result", str(result), "--launched", str(time.time())]
        cmd += [f"--{flag.replace('_', '-')}" for flag in ("profile", "profile_start", "smoke") if spec.get(flag)]
        rc, wall = launch_worker(cmd, worker_environ(env, spec["backend"]), log, result, timeout)
        if result.exists():
            return {**json.loads(result.read_text()), "wall_s": wall}
        why = f"timed out after {timeout:.0f}s" if rc is None else f"exited {rc} without a result"
        if rc is None and budget_cut:
            return {**spec, "ok": False, "error": f"{NOT_RUN} the --budget ran out during it ({why})", "wall_s": wall}
        return {**spec, "ok": False, "error": f"worker {why}: {log.read_text()[-1500:]}", "wall_s": wall}


def worker_environ(env: dict, backend: str) -> dict:
    """A worker's environment: this process's without its own Dynamo-cache settings (a plain row
    stays plain), the row's ``env`` (cache directories, byte code), and what the backend needs
    (``backend_names.worker_env``: ``CGTREES_PRECOMPILE_CACHE=1`` for cgtrees-pc)."""
    inherited = {k: v for k, v in os.environ.items() if k not in backend_names.PRECOMPILE_VARS}
    return {**inherited, **env, **backend_names.worker_env(backend)}


def launch_worker(cmd: list[str], env: dict, log: Path, result: Path, timeout: float) -> tuple[int | None, float]:
    """Run a worker process (its own session, output to ``log``) until it writes ``result``, dies or
    times out, then kill what is left of it: ``wait_for_result``'s status and the wall seconds."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        rc = wait_for_result(proc, result, timeout)
        stop_group(proc)
    return rc, time.perf_counter() - start


def wait_for_result(proc: subprocess.Popen, result: Path, timeout: float) -> int | None:
    """0 once the result file exists, the exit status if the worker died first, None on timeout."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if result.exists():
            return 0
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.05)
    return None


def stop_group(proc: subprocess.Popen) -> None:
    """Kill the worker and what it started (Inductor's compile pool takes seconds to shut down).

    Its results and caches are already on disk: the worker writes its result file last.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_smoke(specs: list[dict], on_row: Callable[[list[dict]], None]) -> list[dict]:
    """All rows in this process (CI has no time for fresh processes); each row's counters are its own."""
    os.environ.setdefault("CGTREES_CACHE_DIR", tempfile.mkdtemp(prefix="cgtrees-smoke-"))
    import torch
    from torch._dynamo.utils import counters

    import worker

    rows = []
    for spec in specs:
        torch._dynamo.reset()
        counters.clear()
        start = time.perf_counter()
        row = worker.run_row(spec)
        rows.append({**row, **worker.environment(torch.device(spec["device"])),
                     "wall_s": time.perf_counter() - start})
        on_row(rows)
    return rows


def run_kernels(root: Path, timeout: float) -> dict:
    env = {var: str(root / "kernels" / sub) for var, sub in CACHE_VARS.items()}
    cmd = [sys.executable, str(HERE / "kernels.py"), "--json"]
    try:
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"kernel report timed out after {timeout:.0f}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (proc.stderr or proc.stdout)[-1500:]}


def progress(row: dict) -> None:
    def f(key: str, scale: float, fmt: str) -> str:
        v = row.get(key)
        return "-" if v is None else fmt.format(v * scale)

    status = "ok" if row.get("ok") else f"FAILED {str(row.get('error'))[:200]}"
    speed = row.get("python_speed_us")  # the process's pure-Python speed around the per-call windows
    py = "" if not speed else f"  py {max(speed) / 1e3:.1f}ms"
    print(f"{row['workload']:10} {row['mode']:5} {row['backend']:15} {row.get('phase', 'cold'):4} "
          f"first3 {f('first3_s', 1, '{:.2f}')}s  per call {f('step_s', 1e6, '{:.1f}')}us{py}  "
          f"peak {f('peak_alloc_mb', 1, '{:.0f}')}MB  err {f('max_err', 1, '{:.1e}')} "
          f"(rel {f('rel_err_out', 1, '{:.0e}')}/{f('rel_err_grad', 1, '{:.0e}')})  "
          f"[process {f('wall_s', 1, '{:.1f}')}s] {status}{report.runs_note(row)}", flush=True)


def result_files(paths: str) -> list[Path]:
    """The files named, a folder standing for its ``*.json`` files in name order, numbers compared
    as numbers (``9-...`` before ``10-...``)."""
    found: list[Path] = []
    for path in map(Path, filter(None, paths.split(","))):
        found += sorted(path.glob("*.json"), key=_natural) if path.is_dir() else [path]
    return found


def _natural(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def load(paths: str) -> tuple[list[dict], dict | None, dict]:
    """Rows, kernel report and meta (dates, commands, files; ``origin``: the file and commit of each
    row) of earlier runs, merged in order: a later file's row replaces an earlier one for the same
    (workload, mode, backend, phase), unless it was never run (a spent ``--budget``: it measured
    nothing). A replacing row without a profile keeps the earlier row's, with ``profile_from``
    naming the file it was measured in."""
    by_key: dict[tuple, dict] = {}
    from_file: dict[tuple, str] = {}
    kernels, metas, files = None, [], []
    for path in result_files(paths):
        data = json.loads(path.read_text())
        commit = data.get("meta", {}).get("commit") or overview.commit_of_file(path.name)
        files.append({**{k: data.get("meta", {}).get(k) for k in ("date", "command")}, "name": path.name,
                      "commit": commit})
        for row in data["rows"]:
            key = (row["workload"], row["mode"], row["backend"], row["phase"])
            if key not in by_key or not str(row.get("error") or "").startswith(NOT_RUN):
                earlier = by_key.get(key) or {}
                if earlier.get("profile") and not row.get("profile"):  # kept, saying which run it is of
                    row = {**row, "profile": earlier["profile"],
                           "profile_from": earlier.get("profile_from") or from_file[key]}
                by_key[key], from_file[key] = row, path.name
        kernels = data.get("kernels") or kernels
        metas.append(data.get("meta", {}))
    order = {name: i for i, name in enumerate(workloads.NAMES)}
    rows = sorted(by_key.values(), key=lambda r: (order.get(r["workload"], len(order)), r["mode"] != "infer"))
    commits = {f["name"]: f["commit"] for f in files}
    meta = {"date": ", ".join(sorted({m.get("date", "?") for m in metas})),
            "command": "`; `".join(m.get("command", "?") for m in metas), "files": files,
            "origin": {"/".join(key): {"file": name, "commit": commits[name]} for key, name in from_file.items()}}
    return rows, kernels, meta


def stamp(rows: list[dict], meta: dict) -> list[dict]:
    """The rows with the file and commit each came from (``load``'s ``origin``; a row measured in this
    call: this call's commit), for the tables' GPU, torch and commit columns."""
    origin = meta.get("origin") or {}
    out = []
    for row in rows:
        found = origin.get("/".join((row["workload"], row["mode"], row["backend"], row.get("phase", "cold")))) or {}
        out.append({**row, **found, "commit": row.get("commit") or found.get("commit") or meta.get("commit")})
    return out


class Budget:
    """Seconds left of ``--budget`` (unbounded without it): no row starts once it is spent, and a
    worker's timeout never runs past it."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.perf_counter() + seconds

    def spent(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def timeout(self, timeout: float) -> float:
        if self.deadline is None:
            return timeout
        return max(1.0, min(timeout, self.deadline - time.perf_counter()))

    def limit(self, timeout: float) -> tuple[float, bool]:
        """A worker's timeout, and whether the budget cut it short."""
        left = self.timeout(timeout)
        return left, left < timeout


NOT_RUN = "not run:"


def not_run(spec: dict, budget: float | None) -> dict:
    return {**spec, "ok": False, "error": f"{NOT_RUN} the --budget of {budget:.0f}s was spent"}


def measure_all(args: argparse.Namespace, on_row: Callable[[list[dict]], None]) -> tuple[list[dict], dict | None]:
    """Run every planned row (and the kernel report); ``on_row`` sees the rows so far after each."""
    device = "cpu" if args.smoke else (args.device or _default_device())
    specs = plan(args, device)
    if args.smoke:
        return run_smoke(specs, on_row), None
    root = Path(tempfile.mkdtemp(prefix="cgtrees-bench-"))
    base = {} if args.no_bytecode_cache else bytecode_env(root)
    budget = Budget(args.budget)
    try:
        for spec in [] if args.no_bytecode_cache else prime_specs(specs):
            if budget.spent():
                break
            row = run_worker(spec, {**base, **cache_env(root / "prime", spec)}, budget.timeout(args.timeout))
            print(f"primed {spec['backend']} {spec['mode']}: {'ok' if row.get('ok') else row.get('error')}",
                  flush=True)
        rows: list[dict] = []
        for spec in specs:
            env = {**base, **cache_env(root, spec)}
            if budget.spent():
                row = not_run(spec, args.budget)
            elif spec["phase"] == "warm":
                row = run_warm(spec, env, budget, args.timeout, args.warm_runs)
            else:
                row = run_worker(spec, env, *budget.limit(args.timeout))
            rows.append({**row, "bytecode_primed": not args.no_bytecode_cache})
            on_row(rows)
        kernels = run_kernels(root, args.timeout) if args.kernels else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows, kernels


def write_markdown(path: Path, rows: list[dict], kernels: dict | None, meta: dict) -> None:
    """The own suite's report at ``path``, with the marked blocks the old file had (the real-model
    section and hand-written ones, ``report.marked_blocks``) kept verbatim, in their order: the real-size
    and serving sections before the own suite's table, the others after its misses."""
    old = path.read_text() if path.exists() else ""
    kept, opening = report.marked_blocks(old, first=False), report.marked_blocks(old, first=True)
    path.write_text(report.markdown(rows, kernels, meta, kept, opening))


def git_commit() -> str | None:
    """The commit of the code being measured (``+dirty`` if ``backend/`` has changes), None without git."""
    root = HERE.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "backend"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or not head.stdout.strip():
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _default_device() -> str:
    import torch  # only to ask; the workers do the work

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    command = "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command, "commit": None if args.from_json else args.commit or git_commit()}

    def save(rows: list[dict], kernels: dict | None = None) -> None:
        if args.out:  # after every row, so a run cut short still leaves its results
            data = {"meta": meta, "rows": rows, "kernels": kernels}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(data, indent=1, default=str))

    def on_row(rows: list[dict]) -> None:
        progress(rows[-1])
        save(rows)

    if args.from_json:
        rows, kernels, meta = load(args.from_json)
        meta["rebuild"] = command
        suite = real_models.MODELS if args.suite == "real" else workloads.WORKLOADS
        rows = [r for r in rows if r["workload"] in suite
                and (args.only_backends is None or r["backend"] in args.only_backends)]
    else:
        rows, kernels = measure_all(args, on_row)
    rows = stamp(rows, meta)
    meta["total_s"] = time.perf_counter() - start
    meta["note"] = args.note or meta.get("note", "")
    meta["title"] = args.title
    meta["details"] = args.details
    if args.analysis:
        meta["analysis"] = Path(args.analysis).read_text()
    save(rows, kernels)
    if args.suite == "real":
        if args.markdown:
            real_report.write(args.markdown, rows, meta)
        if args.details:
            Path(args.details).write_text(real_report.details(rows, meta))
        print(f"\nsummary ({meta['total_s']:.0f}s):\n" + real_report.screen(rows), flush=True)
        return 0
    print("\n" + report.tables(rows))
    if kernels:
        print(report.kernel_table(kernels))
    if args.markdown:
        write_markdown(Path(args.markdown), rows, kernels, meta)
    if args.details:
        Path(args.details).write_text(report.details(rows, kernels, meta))
    print(f"summary ({meta['total_s']:.0f}s):\n" + report.summary(rows, kernels), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
