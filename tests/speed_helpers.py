"""Timing a compiled step on the GPU for the kernel-speed tests in tests/gpu/: CUDA-event windows."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_us(step: Callable[[], object], windows: int = 15, calls: int = 20) -> float:
    """The median over ``windows`` of the mean time of ``calls`` calls, in microseconds."""
    for _ in range(5):  # warm up, record the graphs
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


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
    """``fn`` compiled afresh: ours (CUDA graphs by default), or Inductor's reduce-overhead."""
    torch._dynamo.reset()
    if backend == "inductor":
        return torch.compile(fn, backend="inductor", mode="reduce-overhead")
    return torch.compile(fn, backend="cgtrees")
