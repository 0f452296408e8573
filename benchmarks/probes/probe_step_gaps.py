"""Where the GPU waits in a real-size training step, and what the host does meanwhile (on the GPU machine).

    python benchmarks/probes/probe_step_gaps.py MODEL [--backend cgtrees] [--steps 3] [--out DIR]

``size_worker``'s step (autocast, backward, the eager optimizer, a synchronize at its end), eight
steps to compile and warm up, then ``--steps`` steps under ``torch.profiler`` with CPU and CUDA
activities and Python frames. From the trace: every interval of a step in which no kernel runs
(a *gap*: from the step's start to its first kernel, between kernels, and from its last kernel to
the synchronize's end), longest first, each with the kernels around it and the host's frames that
cover most of it. The step's idle time is the sum of its gaps; the profiler's own cost stretches
the host, so read the gaps by rank and by what fills them, not as the step's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host_profile import StepPhases  # noqa: E402

MIN_GAP_US = 5.0


def gaps(kernels: list[tuple[float, float, str]], start: float, end: float) -> list[tuple[float, float, str, str]]:
    """The intervals of [start, end] where no kernel runs: (begin, length, kernel before, kernel after)."""
    out, busy_until, before = [], start, "(step start)"
    for ts, dur, name in sorted(kernels):
        if ts > busy_until + MIN_GAP_US:
            out.append((busy_until, ts - busy_until, before, name))
        if ts + dur > busy_until:
            busy_until, before = ts + dur, name
    if end > busy_until + MIN_GAP_US:
        out.append((busy_until, end - busy_until, before, "(synchronize ends)"))
    return out


def covering(frames: list[tuple[float, float, str]], begin: float, length: float, top: int = 6) -> list[str]:
    """The host frames that overlap most of [begin, begin + length], innermost (shortest) first."""
    end = begin + length
    hits = []
    for ts, dur, name in frames:
        overlap = min(end, ts + dur) - max(begin, ts)
        if overlap > 0.5 * length:
            hits.append((dur, name, overlap))
    hits.sort()
    return [f"{name[:110]} ({dur:.0f} us)" for dur, name, _ in hits[:top]]


def analyse(trace: dict, steps: int) -> list[dict]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = [(e["ts"], e["dur"], e["name"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    frames = [(e["ts"], e["dur"], e["name"]) for e in events
              if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime", "user_annotation")]
    marks = sorted((e["ts"], e["dur"]) for e in events if e.get("name") == "probe_step")
    out = []
    for ts, dur in marks[:steps]:
        inside = [k for k in kernels if ts <= k[0] < ts + dur]
        found = gaps(inside, ts, ts + dur)
        found.sort(key=lambda g: -g[1])
        out.append({"step_us": dur, "kernels": len(inside), "idle_us": sum(g[1] for g in found),
                    "gaps": [{"at_us": round(b - ts, 1), "us": round(n, 1), "after": a[:90], "before": z[:90],
                              "host": covering(frames, b, n)} for b, n, a, z in found[:12]]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--backend", default="cgtrees")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=".")
    a = p.parse_args()
    step = StepPhases(a.model, a.backend)
    for _ in range(8):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(a.steps):
            with torch.profiler.record_function("probe_step"):
                step()
                torch.cuda.synchronize()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"trace-{a.model}-{a.backend}.json"
    prof.export_chrome_trace(str(path))
    result = {"model": a.model, "backend": a.backend, "device": torch.cuda.get_device_name(),
              "steps": analyse(json.loads(path.read_text()), a.steps)}
    path.unlink()  # large; the analysis is what is kept
    (out / f"step-gaps-{a.model}-{a.backend}.json").write_text(json.dumps(result, indent=1))
    for s in result["steps"]:
        print(f"step {s['step_us'] / 1e3:.2f} ms, {s['kernels']} kernels, idle {s['idle_us'] / 1e3:.2f} ms")
    for g in result["steps"][-1]["gaps"]:
        print(f"  {g['us']:8.1f} us at {g['at_us'] / 1e3:7.2f} ms  after {g['after'][:50]}  before {g['before'][:50]}")
        for h in g["host"]:
            print(f"      {h}")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
