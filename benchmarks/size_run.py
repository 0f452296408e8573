"""Run the real-size suite (``real_sizes.py``): each (model, backend) in a fresh process, one JSON per call.

On the GPU machine, one call per line, each within the device tool's 10 minutes (``--budget 540``:
no row starts after 540 s, none runs past it, rows left are written as not run), each writing one
JSON file into ``$OUT``; the times are estimates for an H100 with cold compiles, the first call
of a machine also priming byte code (below):

    python benchmarks/size_run.py --models gpt2_small --budget 540 --out-dir $OUT                    # ~5-6 min
    python benchmarks/size_run.py --models bert_base --budget 540 --out-dir $OUT                     # ~5 min
    python benchmarks/size_run.py --models vit_b16_infer,resnet50_infer --budget 540 --out-dir $OUT  # ~5 min
    python benchmarks/size_run.py --models vit_b16_train --budget 540 --out-dir $OUT                 # ~5 min
    python benchmarks/size_run.py --models resnet50_train --budget 540 --out-dir $OUT                # ~6 min
    # ~4 and ~6 min
    python benchmarks/size_run.py --models llama_1b --backends eager,inductor --budget 540 --out-dir $OUT
    python benchmarks/size_run.py --models llama_1b --backends reduce-overhead,cgtrees --budget 540 --out-dir $OUT
    # 2 GPUs (the nvidia-h100-x2 kind; skipped on one GPU), ~4 and ~6 min
    python benchmarks/size_run.py --models gpt2_small_ddp --backends eager,inductor --budget 540 --out-dir $OUT
    python benchmarks/size_run.py --models gpt2_small_ddp --backends reduce-overhead,cgtrees --budget 540 --out-dir $OUT

A row that the budget cut is rerun alone (``--models M --backends B``): the report merges files,
the newest measured row winning. Then, on any machine, the files copied to
``benchmarks/results/real-size/``:

    python benchmarks/size_report.py benchmarks/results/real-size --markdown docs/benchmarks.md

and on a CPU, in under a minute (tiny configs, eager and cgtrees, cgtrees's kernels through Triton's
interpreter; timm and torchvision rows are skipped where they do not import):

    python benchmarks/size_run.py --smoke --models gpt2_small,llama_1b --out-dir /tmp/size-smoke

Each row's process gets empty cache directories of its own (cgtrees, Inductor, Triton: a cold
start). Python byte code: the GPU machine ships none and sets ``PYTHONDONTWRITEBYTECODE``, so every
worker would compile the modules it imports lazily inside its timed first steps; workers share a
byte-code folder (``--pycache``, kept between calls on the same machine), primed once per backend
and mode by an untimed tiny row of that backend (``--no-prime`` skips it). Each row's JSON is saved
after it runs, so a call cut short keeps its rows; the end of a call prints a summary table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import real_sizes
import size_report
from backend_names import PRECOMPILE_VARS
from run import NOT_RUN, Budget, git_commit, launch_worker

HERE = Path(__file__).resolve().parent
BACKENDS = "eager,inductor,reduce-overhead,cgtrees"
SMOKE_BACKENDS = "eager,cgtrees"
CACHE_VARS = {"CGTREES_CACHE_DIR": "cgtrees", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(real_sizes.MODELS), help="comma-separated, of real_sizes.SUITE")
    p.add_argument("--backends", default=None, help=f"default: {BACKENDS} (--smoke: {SMOKE_BACKENDS})")
    p.add_argument("--smoke", action="store_true", help="tiny configs on the CPU, eager and cgtrees, a few steps")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu for --smoke)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: no row starts after this long, none runs past it")
    p.add_argument("--timeout", type=float, default=420.0,
                   help="seconds per row's process (a hung row leaves the others time; a real row takes ~1-3 min)")
    p.add_argument("--warmup", type=int, default=5, help="steps after the first 3, untimed")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=5, help="profiled steps (CUDA), 0: none")
    p.add_argument("--out-dir", help="write the call's JSON here, named after its models and backends")
    p.add_argument("--out", help="write the call's JSON to this file")
    p.add_argument("--pycache", default=str(Path(tempfile.gettempdir()) / "cgtrees-size-pycache"),
                   help="byte-code folder the workers share ('' : the environment's setting)")
    p.add_argument("--no-prime", action="store_true", help="no untimed tiny row per backend and mode first")
    p.add_argument("--commit", help="the commit measured, where git cannot tell")
    args = p.parse_args(argv)
    args.backends = args.backends or (SMOKE_BACKENDS if args.smoke else BACKENDS)
    unknown = [m for m in args.models.split(",") if m not in real_sizes.SUITE]
    if unknown:
        p.error(f"unknown models {unknown}; valid: {', '.join(real_sizes.MODELS)}")
    if args.out_dir and not args.out:  # letters, digits, '-', '_' and '.': the device tool returns no other name
        name = f"size-{args.models.replace(',', '_')}-{args.backends.replace(',', '_')}{'-smoke' if args.smoke else ''}"
        args.out = str(Path(args.out_dir) / f"{name}.json")
    return args


def plan(args: argparse.Namespace, device: str) -> list[dict]:
    return [{"model": m, "backend": b, "mode": real_sizes.SUITE[m].mode, "sizes": real_sizes.SUITE[m].sizes,
             "world": real_sizes.SUITE[m].world, "device": device, "smoke": args.smoke}
            for m in filter(None, args.models.split(",")) for b in filter(None, args.backends.split(","))]


def cannot_run(spec: dict, gpus: int) -> str | None:
    """Why a row is skipped without starting its process: a package not installed, too few GPUs."""
    missing = [p for p in real_sizes.SUITE[spec["model"]].needs if importlib.util.find_spec(p) is None]
    if missing:
        return f"{spec['model']} needs {'/'.join(real_sizes.SUITE[spec['model']].needs)}: " \
               f"{', '.join(missing)} not installed here"
    if spec["world"] > 1 and spec["device"] == "cuda" and gpus < spec["world"]:
        return f"needs {spec['world']} GPUs (torch.cuda.device_count() >= {spec['world']}), found {gpus}"
    return None


def worker_env(spec: dict, caches: Path, pycache: str) -> dict:
    """A worker's environment: ours without Dynamo-cache settings, empty cache directories, the
    shared byte code, and Triton's interpreter for cgtrees on a CPU (Triton decides at import)."""
    env = {k: v for k, v in os.environ.items() if k not in PRECOMPILE_VARS}
    env.update({var: str(caches / sub) for var, sub in CACHE_VARS.items()})
    if pycache:
        env.update(PYTHONPYCACHEPREFIX=pycache, PYTHONDONTWRITEBYTECODE="")
    if spec["device"] == "cpu" and spec["backend"] == "cgtrees":
        env["CGTREES_INTERPRET"] = "1"
    return env


def run_worker(spec: dict, args: argparse.Namespace, timeout: float, budget_cut: bool = False,
               smoke: bool | None = None) -> dict:
    """One row in a fresh process with fresh caches; a crash or timeout becomes the row's error."""
    smoke = spec["smoke"] if smoke is None else smoke
    with tempfile.TemporaryDirectory(prefix="cgtrees-size-") as tmp:
        result, log = Path(tmp) / "row.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, str(HERE / "size_worker.py"), "--model", spec["model"], "--backend", spec["backend"],
               "--device", spec["device"], "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--profile-steps", str(args.profile_steps), "--result", str(result)] + (["--smoke"] if smoke else [])
        env = worker_env({**spec, "smoke": smoke}, Path(tmp), args.pycache)
        rc, wall = launch_worker(cmd, env, log, result, timeout)
        if result.exists():
            return {**json.loads(result.read_text()), "process_s": wall}
        why = f"timed out after {timeout:.0f}s" if rc is None else f"exited {rc} without a result"
        if rc is None and budget_cut:
            return {**spec, "status": "not run", "ok": False, "process_s": wall,
                    "error": f"{NOT_RUN} the --budget ran out during it ({why})"}
        return {**spec, "status": "error", "ok": False, "process_s": wall,
                "error": f"worker {why}: {log.read_text()[-1500:]}"}


def prime(spec: dict, args: argparse.Namespace, specs: list[dict], budget: Budget) -> None:
    """Once per backend and mode (a marker in ``--pycache``): an untimed tiny row, so that the
    modules a first step imports are compiled to byte code before any timed row."""
    if args.smoke or args.no_prime or not args.pycache or spec["backend"] == "eager":
        return
    marker = Path(args.pycache) / f"primed-{spec['backend']}-{spec['mode']}"
    if marker.exists():
        return
    single = next((s for s in specs if s["mode"] == spec["mode"] and s["world"] == 1), None)
    tiny = {**(single or {**spec, "model": "gpt2_small", "world": 1}), "backend": spec["backend"]}
    start = time.perf_counter()
    row = run_worker(tiny, args, budget.timeout(300.0), smoke=True)
    print(f"primed {spec['backend']} {spec['mode']} with a tiny {tiny['model']} in {time.perf_counter() - start:.0f}s: "
          f"{row['status']} {row.get('error') or ''}"[:300], flush=True)
    if row["status"] in ("ok", "skipped"):
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def measure_all(args: argparse.Namespace, save: Callable[[list[dict]], None]) -> list[dict]:
    device = "cpu" if args.smoke else (args.device or _default_device())
    gpus = _gpus() if device == "cuda" else 0
    specs, rows, budget = plan(args, device), [], Budget(args.budget)
    for spec in specs:
        why = cannot_run(spec, gpus)
        if budget.spent():
            row = {**spec, "status": "not run", "ok": False,
                   "error": f"{NOT_RUN} the --budget of {args.budget:.0f}s was spent"}
        elif why:
            row = {**spec, "status": "skipped", "ok": False, "error": why}
        else:
            prime(spec, args, specs, budget)
            row = run_worker(spec, args, *budget.limit(args.timeout))
        rows.append(row)
        print(size_report.progress(row), flush=True)
        save(rows)
    return rows


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": "python benchmarks/size_run.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": args.commit or git_commit(), "smoke": args.smoke}

    def save(rows: list[dict]) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))

    rows = measure_all(args, save)
    meta["total_s"] = time.perf_counter() - start
    save(rows)
    print(f"\nsummary ({meta['total_s']:.0f}s{', ' + args.out if args.out else ''}):\n"
          + size_report.screen(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
