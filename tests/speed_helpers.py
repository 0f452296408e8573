"""Timing a compiled step on the GPU for the kernel-speed tests in tests/gpu/: CUDA-event windows."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def medians_us(steps: dict[str, Callable[[], object]], windows: int = 15, calls: int = 20) -> dict[str, float]:
    """For each named step, the median over ``windows`` of the mean time of ``calls`` calls, in
    microseconds. The steps' windows take turns, so that load from other processes on the GPU (a
    test run with many workers) falls on every step alike instead of on whichever ran first."""
    for step in steps.values():
        for _ in range(5):  # warm up, record the graphs
            step()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(windows):
        for name, step in steps.items():
            times[name].append(_window_us(step, calls))
    return {name: statistics.median(t) for name, t in times.items()}


def _window_us(step: Callable[[], object], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def kernel_times(step: Callable[[], object], calls: int = 10) -> dict[str, float]:
    """Each GPU kernel's device time per call of ``step`` (us, summed over its launches), from the
    profiler, longest first; one call of ``step`` runs first, outside the profile."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us() / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def forward_step(fn: Callable, args: list | tuple) -> Callable[[], None]:
    """One inference call of ``fn`` as a step of its own (a new CUDA-graph step each time)."""
    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            fn(*args)
    return step


def training_step(fn: Callable, args: list | tuple, wrt: list | tuple, grads: list | tuple) -> Callable[[], None]:
    """One call of ``fn`` and the gradients of ``wrt`` from the output's gradient(s) ``grads``."""
    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        torch.autograd.grad(fn(*args), wrt, grads)
    return step


def compiled(fn: Callable, backend: str) -> Callable:
    """``fn`` compiled: ours (CUDA graphs by default), or Inductor's reduce-overhead. Both can live
    side by side: Dynamo keeps one entry per backend for the same code."""
    if backend == "inductor":
        return torch.compile(fn, backend="inductor", mode="reduce-overhead")
    return torch.compile(fn, backend="cgtrees")
