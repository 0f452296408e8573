"""Host time of a steady training step, and where its Python goes (on the GPU machine).

    python benchmarks/host_profile.py MODEL BACKEND [--steps 20] [--rows 22]

Builds the workload as a benchmark worker does (own, real or real-size suite names: a real-size
model's step is ``size_worker``'s, autocast and its optimizer included), runs a few steps, then
times ``--steps`` steps five times each way (the least counts): without synchronizing (the host's
time to enqueue a step, as long as the GPU queue does not fill) and with a synchronize at the end
(the wall time per step), and the time the garbage collector took in those steps. A step whose
host time is above its device time is host-bound: the figure to cut is then ours in Python. Last, a
cProfile of the same steps, by own time. A real-size step also prints its host time by phase
(forward, backward, optimizer), each timed without synchronizing: where a phase's host time passes
the GPU's work queued before it, the GPU waits.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import real_sizes  # noqa: E402
import size_worker  # noqa: E402
from measure import python_speed  # noqa: E402
from worker import Kept, make_step  # noqa: E402


def per_step(step, steps: int, sync: bool) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


class GcTimer:
    """Collections and their time, by generation, while counting (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.counting = False
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.counting:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def report(self, steps: int) -> str:
        return ", ".join(f"gen{g} {n} ({s / steps * 1e6:.0f} us/step)"
                         for g, (n, s) in enumerate(zip(self.count, self.seconds)))


class StepPhases:
    """A real-size row's step (``size_worker.row_step``), each phase's host time summed (no synchronize)."""

    def __init__(self, name: str, backend: str) -> None:
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.steps = 0
        self._last = 0.0
        self._step = size_worker.row_step(name, backend, lap=self._lap)

    def _lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def __call__(self) -> None:
        self._last = time.perf_counter()
        self._step()
        self.steps += 1

    def report(self) -> str:
        return ", ".join(f"{k} {v / max(self.steps, 1) * 1e3:.3f} ms" for k, v in self.seconds.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("backend")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=22)
    args = p.parse_args()
    if args.model in real_sizes.BUILDERS:
        step = StepPhases(args.model, args.backend)
    else:
        spec = {"workload": args.model, "backend": args.backend, "mode": "train", "device": "cuda", "smoke": False}
        step = make_step(spec, torch.device("cuda"), Kept())
    for _ in range(8):  # compile, record, warm up
        step()
    # the least of five: a host-bound step moves with whatever else the machine's CPU does
    host = min(per_step(step, args.steps, sync=False) for _ in range(5))
    timer = GcTimer()
    timer.counting = True
    wall = min(per_step(step, args.steps, sync=True) for _ in range(5))
    timer.counting = False
    print(f"{args.model} {args.backend}: step wall {wall * 1e3:.2f} ms, host enqueue ~{host * 1e3:.2f} ms "
          f"(least of 5 x {args.steps} steps)")
    threads = sorted(t.name for t in threading.enumerate())
    print(f"python speed {python_speed():.0f} us per 100k-step loop; "
          f"{len(os.sched_getaffinity(0))} cores allowed; threads {threads}")
    print(f"garbage collections in the 5 x {args.steps} synchronized steps: {timer.report(5 * args.steps)}")
    if isinstance(step, StepPhases):
        step.seconds = dict.fromkeys(step.seconds, 0.0)
        step.steps = 0
        per_step(step, args.steps, sync=True)
        print(f"host time by phase, synchronized steps: {step.report()}")
    prof = cProfile.Profile()
    prof.runcall(per_step, step, args.steps, True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.rows)
    print(text.getvalue())


if __name__ == "__main__":
    main()
