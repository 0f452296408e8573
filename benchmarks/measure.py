"""Timing, memory and error figures, as the benchmark pages define them ("How to read the tables"):

- time to first output(s): wall clock from the first call, synchronising the device after each;
- per-call time: median over windows of many calls, timed with CUDA events on a GPU
  (``perf_counter`` on the CPU);
- peak memory: ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``, which also counts
  CUDA-graph pools) over the steady-state calls, after ``reset_peak_memory_stats``;
- error: the largest absolute difference from eager over all compared tensors; relative error:
  per tensor, the largest absolute difference over the largest magnitude of eager's tensor (at
  least ``FLOOR`` of the largest in its group: a gradient ~0 in eager is noise, see ``relative_errors``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

Step = Callable[[], object]


@dataclass(frozen=True)
class Plan:
    """How long to measure: small on the CPU smoke run, enough for stable medians on a GPU."""

    warmup_calls: int = 5
    windows: int = 7
    window_s: float = 0.05  # aim for windows of about this long...
    min_calls: int = 10  # ...but never fewer calls than this per window
    max_calls: int = 2000


# Smoke runs check the plumbing (a median of windows, memory, errors), not speed: as few calls as that
# takes, since CI runs generated kernels through Triton's interpreter (seconds per call).
SMOKE_PLAN = Plan(warmup_calls=0, windows=1, window_s=0.0, min_calls=1, max_calls=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_outputs(step: Step, device: torch.device, n: int = 3) -> list[float]:
    """Seconds from the first call until each of the first ``n`` outputs is ready."""
    start = time.perf_counter()
    marks = []
    for _ in range(n):
        step()
        sync(device)
        marks.append(time.perf_counter() - start)
    return marks


def window(step: Step, calls: int, device: torch.device) -> float:
    """Seconds per call over one window of ``calls`` back-to-back calls."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            step()
        return (time.perf_counter() - start) / calls
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / calls


def python_speed() -> float:
    """Microseconds for a fixed pure-Python loop (least of 5). On the GPU machine it moves by up to
    2x between processes (3.5-7.1 ms measured), and a host-bound row's per-call time with it: kept
    beside each row's per-call figure, it tells a slow process from a slow backend."""
    def loop() -> float:
        start = time.perf_counter()
        total = 0
        for i in range(100_000):
            total += i & 7
        return time.perf_counter() - start
    return min(loop() for _ in range(5)) * 1e6


def steady_state(step: Step, device: torch.device, plan: Plan) -> dict:
    """Per-call seconds (median of windows) and the peak memory over those calls."""
    for _ in range(plan.warmup_calls):
        step()
    sync(device)
    probe = window(step, plan.min_calls, device)
    calls = int(min(plan.max_calls, max(plan.min_calls, plan.window_s / max(probe, 1e-9))))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # cached blocks from compilation are not the workload's memory
        torch.cuda.reset_peak_memory_stats(device)
    before = python_speed()
    per_window = [window(step, calls, device) for _ in range(plan.windows)]
    figures = {"step_s": statistics.median(per_window), "step_windows_s": per_window,
               "calls_per_window": calls, "python_speed_us": [before, python_speed()]}
    if device.type == "cuda":
        figures["peak_alloc_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        figures["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    return figures


def max_error(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None]) -> float:
    """Largest absolute difference; ``inf`` where a tensor is missing, mis-shaped or not finite."""
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g is None or w is None:
            if g is not w:
                return math.inf
            continue
        if g.shape != w.shape:
            return math.inf
        diff = (g.detach().double().cpu() - w.detach().double().cpu()).abs()
        if diff.numel():
            worst = max(worst, diff.nan_to_num(nan=math.inf).max().item())
    return worst


FLOOR = 1e-3  # of the group's largest magnitude: below it, a tensor of eager's is ~0 (noise)


def relative_errors(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None]) -> list[float]:
    """Per tensor, ``max|got - want| / max(max|want|, FLOOR * largest max|want| of the group)``.

    The floor judges a tensor that is ~0 in eager against the group's scale, not against its own
    rounding noise: attention's key bias, for one, has an analytically zero gradient (softmax ignores
    a constant added to every score), so eager's is noise and any other order of sums differs from it
    by 100%. 0 where both are missing; ``inf`` where one is missing, shapes differ, or a value is not finite.
    """
    if len(got) != len(want):
        return [math.inf]
    pairs = [(g, w) if g is None or w is None or g.shape != w.shape else
             (g.detach().double().cpu(), w.detach().double().cpu()) for g, w in zip(got, want, strict=True)]
    scales = [w.abs().max().item() for g, w in pairs if g is not None and w is not None and w.numel()
              and g.shape == w.shape]
    floor = FLOOR * max((v for v in scales if math.isfinite(v)), default=0.0)
    errors = []
    for g, w in pairs:
        if g is None or w is None or g.shape != w.shape:
            errors.append(0.0 if g is None and w is None else math.inf)
            continue
        if not g.numel():
            errors.append(0.0)
            continue
        diff = (g - w).abs().nan_to_num(nan=math.inf).max().item()
        scale = max(w.abs().nan_to_num(nan=math.inf).max().item(), floor)
        errors.append(0.0 if diff == 0 else diff / scale if 0 < scale < math.inf else math.inf)
    return errors


def profile_table(step: Step, device: torch.device, calls: int = 10, rows: int = 40) -> str:
    """Where the steady-state time goes: the top ops and kernels over ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        sync(device)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort_by, row_limit=rows, max_name_column_width=60)
    kinds = device_time_by_kind(averages, calls) if cuda else ""
    return f"{calls} calls, sorted by {sort_by}\n{table}{kinds}"


# Generated kernels by name: ours (``cgtrees.codegen``: pw_/red_/... prefixes) and Inductor's.
GENERATED_PREFIXES = ("pw_", "red_", "scan_", "sc_", "triton_")


def device_time_by_kind(averages: Any, calls: int) -> str:
    """Every kernel of the profile (not only the table's top rows), per call: generated kernels,
    copies and fills, and library kernels (cuDNN, cuBLAS, CUTLASS, aten's own), time and launches."""
    totals: dict[str, list[float]] = {"generated": [0.0, 0], "copies": [0.0, 0], "library": [0.0, 0]}
    for evt in averages:
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.key
        copies = name.startswith(("Memcpy", "Memset")) or "copy" in name.lower() or "fill" in name.lower()
        kind = "generated" if name.startswith(GENERATED_PREFIXES) else "copies" if copies else "library"
        totals[kind][0] += evt.self_device_time_total
        totals[kind][1] += evt.count
    parts = [f"{kind} {us / calls:.1f} us ({int(n) // calls} launches)" for kind, (us, n) in totals.items()]
    return "\ndevice time per call by kind: " + ", ".join(parts) + "\n"


def profiled(fn: Callable, *args: object, rows: int = 40) -> tuple[object, str]:
    """``fn(*args)`` under cProfile: its result and the top functions by cumulative time, then by
    their own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    result = prof.runcall(fn, *args)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(rows)
    stats.sort_stats("tottime").print_stats(rows // 2)
    return result, text.getvalue()


def compile_phases() -> dict[str, float]:
    """Dynamo's own breakdown of compile time in this process (seconds per phase)."""
    from torch._dynamo.utils import compile_times

    names, seconds = compile_times(repr="csv", aggregate=True)
    return {name: float(s) for name, s in zip(names, seconds, strict=True)}
