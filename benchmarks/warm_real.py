"""Warm starts at real sizes (issue 53, item 2): a fresh process's time to its first outputs, cold
and warm, by phase, cgtrees beside Inductor's backends in the same call.

    python benchmarks/warm_real.py --models llama_1b,gpt2_small --out-dir $OUT [--smoke]

Rows (the issue's table):
- ``llama_1b``: serving's plain decode loop (``serve_worker.Loop``: Llama 1.1B, bf16, a StaticCache
  of 160), an eager prefill and 8 tokens, each a compiled decode step; first outputs: the 8th token.
- ``gpt2_small``: the real-size GPT-2 small training step (8 x 1024, bf16 autocast, fused AdamW,
  ``size_worker.make_step``); first outputs: the end of the third step.

Per model and backend (``--backends``; default cgtrees, cgtrees-pc, reduce-overhead, inductor), a
cold process on empty cache directories, then ``--warm`` warm ones on the same directories. Each
process builds its model first (not timed: weights made on the device), then times from before the
first compiled call to its first outputs, synchronised (``first_s``). Our phases come from
``warm_phases``' shim (Dynamo's trace, level-1 load, module import, kernel binaries, warmup,
recording, first replay; the work a warm start should not do; ``--cprofile``: where the rest goes).
One JSON line per process in
OUT/warm_real.jsonl and a table at the end: each warm start against Inductor's backends' warm ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import size_worker  # noqa: E402
import warm_phases  # noqa: E402

MODELS = ("llama_1b", "gpt2_small")
BACKENDS = ("cgtrees", "cgtrees-pc", "reduce-overhead", "inductor")
TOKENS = 8  # the decode loop's first outputs
STEPS = 3  # the training step's


# --- one process ------------------------------------------------------------------------------------

def first_decode(smoke: bool, backend: str, device: torch.device, window=contextlib.nullcontext) -> float:
    import serve_worker

    loop = serve_worker.Loop(serve_worker.build(smoke, device), _compiled(backend), batch=1, cache=160, new=TOKENS)
    prompt = torch.randint(0, loop.model.config.vocab_size, (1, loop.prompt_len), device=device)
    loop.prefill, loop.step = _clocked(loop.prefill, "prefill"), _clocked(loop.step, "steps")
    mark = torch.compiler.cudagraph_mark_step_begin
    torch.compiler.cudagraph_mark_step_begin = _clocked(mark, "marks")
    size_worker.sync(device)
    start = time.perf_counter()
    try:
        with window(), torch.no_grad():
            loop.generate(prompt)
            loop.tokens.cpu()  # the 8th token on the host
    finally:
        torch.compiler.cudagraph_mark_step_begin = mark
    return time.perf_counter() - start


HOST: dict[str, list[float]] = {}  # host seconds of each call in the window, by part (not synchronised)


def _clocked(fn, part: str):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            HOST.setdefault(part, []).append(round(time.perf_counter() - start, 4))
    return call


def first_steps(smoke: bool, backend: str, device: torch.device, window=contextlib.nullcontext) -> float:
    import real_sizes

    case = real_sizes.build("gpt2_small", device, smoke=smoke)
    opt = case.optimizer(list(case.model.parameters())) if case.optimizer else None
    fn, _ = size_worker.compile_model(case.model, _compiled(backend))
    step = size_worker.make_step(case, fn, opt, backend != "inductor", size_worker.Values(), [])
    size_worker.sync(device)
    start = time.perf_counter()
    with window():
        for _ in range(STEPS):
            step()
        size_worker.sync(device)
    return time.perf_counter() - start


def _compiled(backend: str) -> str:
    return "cgtrees" if backend == "cgtrees-pc" else backend  # the environment says precompile


def one(model: str, backend: str, smoke: bool, profile: str | None, sample: str | None = None) -> None:
    from torch._dynamo.utils import counters

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_it = first_decode if model == "llama_1b" else first_steps
    if profile:  # the timed window only (not the model's build)
        import cProfile

        profiler = cProfile.Profile()
        first = run_it(smoke, backend, device, window=lambda: profiler)
        write_profile(profiler, profile)
    elif sample:
        sampler = Sampler()
        first = run_it(smoke, backend, device, window=lambda: sampler)
        sampler.write(sample)
    else:
        first = run_it(smoke, backend, device)
    print(json.dumps({"first_s": round(first, 3), "host": HOST, "counters": dict(counters["cgtrees"]),
                      "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "torch": torch.__version__}), flush=True)


class Sampler:
    """The main thread's Python stack every ``interval`` seconds, read by a thread of its own: where
    the window's wall time goes on the main thread alone (Python 3.12's cProfile sees every thread's
    calls, the warm load's first-calls thread among them). Each sample weighs the wall time since the
    one before: a C call that holds the GIL delays the next sample, and its time goes to the stack
    seen then, which still holds the Python frame that made the call unless it returned meanwhile."""

    def __init__(self, interval: float = 0.002) -> None:
        import threading

        self.interval, self.main = interval, threading.main_thread().ident
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.main)
            stack = []
            while frame is not None:
                stack.append(f"{frame.f_code.co_filename}:{frame.f_lineno}:{frame.f_code.co_name}")
                frame = frame.f_back
            now = time.perf_counter()
            self.samples.append((now - last, tuple(reversed(stack))))
            last = now

    def write(self, path: str) -> None:
        """Seconds by area of the innermost frame, by function (inclusive, then own), and the
        heaviest stacks, cut at 12 frames below the window's function."""
        inclusive: dict[str, float] = {}
        own: dict[str, float] = {}
        stacks: dict[tuple[str, ...], float] = {}
        total = sum(w for w, _ in self.samples)
        for weight, stack in self.samples:
            names = [_function(f) for f in stack]
            for name in dict.fromkeys(names):
                inclusive[name] = inclusive.get(name, 0.0) + weight
            if names:
                own[names[-1]] = own.get(names[-1], 0.0) + weight
            cut = tuple(_function(f) for f in stack[_window_depth(stack):][:12])
            stacks[cut] = stacks.get(cut, 0.0) + weight
        by_area: dict[str, float] = {}
        for name, seconds in own.items():
            area = next((a for a, marks in AREAS if any(m in name for m in marks)), "other")
            by_area[area] = by_area.get(area, 0.0) + seconds
        with open(path, "w") as f:
            f.write(f"main thread, {len(self.samples)} samples over {total:.2f} s\n")
            f.write("own time by area (s): " + ", ".join(f"{a} {t:.2f}" for a, t in
                                                         sorted(by_area.items(), key=lambda kv: -kv[1])) + "\n\n")
            for title, table, n in (("inclusive", inclusive, 80), ("own", own, 40)):
                f.write(f"by function, {title} (s):\n")
                f.writelines(f"{t:8.3f}  {name}\n" for name, t in sorted(table.items(), key=lambda kv: -kv[1])[:n])
                f.write("\n")
            f.write("heaviest stacks (s), from the window's function down:\n")
            for cut, t in sorted(stacks.items(), key=lambda kv: -kv[1])[:25]:
                f.write(f"{t:8.3f}  " + " > ".join(c.rsplit(":", 1)[-1] for c in cut) + f"\n          {cut[-1]}\n")


def _function(frame: str) -> str:
    """``file:line:name`` -> ``file:name`` (a function, whatever line it was at)."""
    file, _line, name = frame.rsplit(":", 2)
    return f"{file}:{name}"


def _window_depth(stack: tuple[str, ...]) -> int:
    """Where the timed window begins in a stack: the frame of ``first_decode`` or ``first_steps``."""
    for i, frame in enumerate(stack):
        if frame.endswith((":first_decode", ":first_steps")):
            return i
    return 0


# Where a window's time goes, by whose code runs (own time, first match wins).
AREAS = (("cgtrees", ("/backend/", "/cgtrees/")), ("dynamo", ("torch/_dynamo/",)),
         ("inductor", ("torch/_inductor/",)), ("fake tensors", ("torch/_subclasses/",)),
         ("fx, sympy", ("torch/fx/", "sympy/", "torch/utils/_sympy/")),
         ("transformers", ("transformers/",)), ("triton", ("triton/",)),
         ("imports", ("<frozen importlib", "builtins.compile", "builtins.exec", "marshal")),
         ("other torch", ("torch/",)))


def areas(stats: dict) -> dict[str, float]:
    """Own time (s) by area, from ``pstats.Stats(...).stats``."""
    out: dict[str, float] = {}
    for (file, _line, name), (_cc, _nc, own, _cum, _callers) in stats.items():
        where = f"{file}:{name}"
        area = next((a for a, marks in AREAS if any(m in where for m in marks)), "other")
        out[area] = out.get(area, 0.0) + own
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def write_profile(profiler, path: str) -> None:
    import pstats

    with open(path, "w") as f:
        stats = pstats.Stats(profiler, stream=f)
        f.write("own time by area (s): " + ", ".join(f"{a} {t:.2f}" for a, t in areas(stats.stats).items()) + "\n\n")
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(30)


# --- the call ---------------------------------------------------------------------------------------

def environment(backend: str, caches: Path, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """A process's environment: its backend's cache directories under ``caches``, nothing inherited,
    and ``extra`` (``NAME=VALUE``: ``--env``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CGTREES_", "TRITON_CACHE", "TORCHINDUCTOR"))}
    env.update(item.split("=", 1) for item in extra)
    env.update(TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               CGTREES_CACHE_DIR=str(caches / "cgtrees"), PYTHONUNBUFFERED="1")
    if backend == "cgtrees-pc":
        env["CGTREES_PRECOMPILE_CACHE"] = "1"
    return env


def run(model: str, backend: str, label: str, env: dict[str, str], args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-c", warm_phases.shimmed("warm_real.py"), "--one", model, backend]
    cmd += ["--smoke"] if args.smoke else []
    if args.cprofile and label != "cold":
        cmd += ["--cprofile-file", str(Path(args.out_dir) / f"cprofile-{model}-{backend}-{label}.txt")]
    elif args.sample and label != "cold":
        cmd += ["--sample-file", str(Path(args.out_dir) / f"sampled-{model}-{backend}-{label}.txt")]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "backend": backend, "label": label, "rc": "timeout", "wall_s": args.timeout}
    row = {"model": model, "backend": backend, "label": label, "rc": proc.returncode,
           "wall_s": round(time.perf_counter() - start, 2)}
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    row.update(found[-1] if found else {})
    phases = warm_phases.phases_of(proc.stderr)
    if phases and backend.startswith("cgtrees"):
        row["phases"] = phases
    elif phases:
        row["phases"] = {k: phases[k] for k in ("dynamo", "backend") if k in phases}
    warned = warning_lines(proc.stderr)
    row["warning_lines"] = len(warned)
    if warned:
        row["warnings"] = warned[:3]
    if proc.returncode != 0:
        row["stderr_tail"] = proc.stderr[-1500:]
    return row


def warning_lines(stderr: str) -> list[str]:
    """Lines a user reads as warnings: Python's (``...Warning: ...``), torch's logging (``W1128 ...``,
    ``E1128 ...``) and ours (``cgtrees...: ...``, printed at warning level when logging is not set up)."""
    return [ln for ln in stderr.splitlines() if "warn" in ln.lower() or re.match(r"[WE]\d{4} |cgtrees[\w .]*: ", ln)]


def table(rows: list[dict]) -> str:
    """Per model: each backend's cold and warm first outputs, and each warm start over the best
    Inductor warm start of the same call."""
    lines = [f"{'model':12} {'backend':16} {'cold s':>8} {'warm s':>8} {'x best ind. warm':>17}  warm phases (s)"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        plain = [r for r in mine if r["label"] == "cold" or r["label"][5:].isdigit()]
        warm = {b: min((r["first_s"] for r in plain if r["backend"] == b and r["label"] != "cold" and "first_s" in r),
                       default=None) for b in dict.fromkeys(r["backend"] for r in mine)}
        best = min((s for b, s in warm.items() if not b.startswith("cgtrees") and s is not None), default=None)
        for backend, w in warm.items():
            cold = next((r.get("first_s") for r in mine if r["backend"] == backend and r["label"] == "cold"), None)
            ratio = f"{w / best:.2f}x" if w is not None and best else "-"
            faster = next((r for r in plain if r["backend"] == backend and r["label"] != "cold"
                           and r.get("first_s") == w), {})
            lines.append(f"{model:12} {backend:16} {_s(cold):>8} {_s(w):>8} {ratio:>17}  "
                         f"{_shown(faster.get('phases', {}))}{_host(faster.get('host'))}")
        for r in (r for r in mine if r not in plain):
            ratio = f"{r['first_s'] / best:.2f}x" if best and "first_s" in r else "-"
            lines.append(f"{model:12} {r['backend']:16} {'':>8} {_s(r.get('first_s')):>8} {ratio:>17}  "
                         f"{_shown(r.get('phases', {}))}{_host(r.get('host'))}  [{r['label']}]")
    return "\n".join(lines)


def _shown(phases: dict) -> str:
    return " ".join(f"{k}={v:.2f}" for k, v in phases.items() if isinstance(v, float) and v >= 0.05)


def _host(host: dict | None) -> str:
    """The decode window's host time: prefill, the marks, the first two steps, the rest."""
    if not host:
        return ""
    steps = host.get("steps", [])
    parts = [f"prefill={sum(host.get('prefill', [])):.2f}", f"marks={sum(host.get('marks', [])):.2f}",
             *(f"step{i + 1}={t:.2f}" for i, t in enumerate(steps[:2])), f"later steps={sum(steps[2:]):.2f}"]
    return "  host: " + " ".join(parts)


def _slug(setting: str) -> str:
    """``CGTREES_X=0`` -> ``CGTREES_X_0``: a label that is also a file name."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in setting)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--warm", type=int, default=1, help="warm processes after each cold one")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds a process may take")
    p.add_argument("--smoke", action="store_true", help="tiny configs, CPU where there is no GPU")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--cprofile", action="store_true", help="each warm process's first outputs under cProfile: "
                   "OUT/cprofile-MODEL-BACKEND-LABEL.txt: own time by area, 60 functions by cumulative time, "
                   "30 by own time (the timed window only)")
    p.add_argument("--sample", action="store_true", help="each warm process's first outputs, the main thread's "
                   "stack sampled every 2 ms: OUT/sampled-MODEL-BACKEND-LABEL.txt (the timed window only)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every process (repeatable), e.g. CGTREES_WARM_FIRST_CALLS=0")
    p.add_argument("--warm-env", action="append", default=[], metavar="NAME=VALUE",
                   help="one more warm process per backend with this set (repeatable: one process each)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    p.add_argument("--cprofile-file", help=argparse.SUPPRESS)
    p.add_argument("--sample-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        one(*args.one, args.smoke, args.cprofile_file, args.sample_file)
        return 0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models.split(","):
        for backend in args.backends.split(","):
            caches = Path(tempfile.mkdtemp(prefix=f"warm-real-{model}-{backend}-"))
            try:
                runs = [("cold", ()), *((f"warm-{i + 1}", ()) for i in range(args.warm)),
                        *((f"warm-{_slug(extra)}", (extra,)) for extra in args.warm_env)]
                for label, extra in runs:
                    row = run(model, backend, label, environment(backend, caches, (*args.env, *extra)), args)
                    rows.append(row)
                    with open(out / "warm_real.jsonl", "a") as f:
                        f.write(json.dumps(row, default=str) + "\n")
                    print(f"{model:12} {backend:16} {label:8} first={row.get('first_s')} rc={row['rc']} "
                          f"warnings={row['warning_lines']}", flush=True)
            finally:
                shutil.rmtree(caches, ignore_errors=True)
    print(table(rows))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
