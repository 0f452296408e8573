"""Column reductions on the GPU: channels-last batch-norm statistics, ours against Inductor's and
eager's, and a sweep of the column knobs in ``backend/codegen/heuristics.py``.

    python benchmarks/probes/tune_columns.py [--budget 270] [--iters 20] [--shapes 32x64x112x112 ...]

For each shape (float32, channels-last; resnet18's and mobilenet_v3_small's batch-norm inputs at
batch 32) it compiles ``F.batch_norm(x, None, None, w, b, training=True)`` and its backward with
each backend (cgtrees without CUDA graphs or cache, Inductor's default mode, eager), checks the
outputs and gradients against eager, and sums the device time of every kernel per call with the
profiler: launch gaps are left out, so the figures compare kernels. ``fw`` is the training
forward, ``bw`` the backward (one forward plus backward, less the forward). Then, on a few shapes,
it recompiles ours with the knobs patched (``VARIANTS``) until ``--budget`` seconds have passed.
Each row names the launches of our reduction kernels: ``grid x [XBLOCK, RBLOCK] warps``.

Without CUDA (``--smoke``, run under CGTREES_INTERPRET=1) it checks the plumbing on a tiny shape.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

SHAPES = ("32x64x112x112", "32x64x56x56", "32x128x28x28", "32x256x14x14", "32x512x7x7",  # resnet18
          "32x16x112x112", "32x576x7x7")  # mobilenet_v3_small
SWEEP_SHAPES = ("32x64x112x112", "32x16x112x112", "32x512x7x7")
VARIANTS: tuple[tuple[str, dict], ...] = (  # most telling first: the budget may stop the sweep early
    ("programs 512", {"COLUMN_SPLIT_PROGRAMS": 512}),
    ("programs 2048", {"COLUMN_SPLIT_PROGRAMS": 2048}),
    ("rblock 128", {"COLUMN_RBLOCK": 128}),
    ("xblock 64 rblock 32", {"COLUMN_XBLOCK": 64, "COLUMN_RBLOCK": 32}),
    ("xblock 16 rblock 128", {"COLUMN_XBLOCK": 16, "COLUMN_RBLOCK": 128}),
    ("warps 4", {"COLUMN_WARPS": 4}),
    ("warps 16", {"COLUMN_WARPS": 16}),
    ("always narrow", {"COLUMN_NARROW_PROGRAMS": 1 << 30}),
    ("never narrow", {"COLUMN_NARROW_PROGRAMS": 0}),
    ("min chunk 256", {"COLUMN_MIN_CHUNK": 256}),
    ("rblock 32", {"COLUMN_RBLOCK": 32}),
)
LAUNCH = re.compile(r"^\s*(red_\w+)\[\((\d+),?\)\]\(.*XBLOCK=(\d+), RBLOCK=(\d+), num_warps=(\d+)\)")


def bn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, None, None, w, b, training=True)


def inputs(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(device).to(memory_format=torch.channels_last)
    w, b = (torch.randn(shape[1], generator=gen).to(device) for _ in range(2))
    grad = torch.randn(*shape, generator=gen).to(device).to(memory_format=torch.channels_last)
    return x, w, b, grad


@contextlib.contextmanager
def patched(knobs: dict) -> Iterator[None]:
    from cgtrees.codegen import heuristics

    old = {k: getattr(heuristics, k) for k in knobs}
    for k, v in knobs.items():
        setattr(heuristics, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(heuristics, k, v)


@contextlib.contextmanager
def kept_sources(out: list[str]) -> Iterator[None]:
    """Keep the source of every kernel module compiled inside."""
    from cgtrees import codegen

    real = codegen.compile_graph

    def keep(gm, example_inputs, ctx):
        module = real(gm, example_inputs, ctx)
        out.append(getattr(module, "source", ""))
        return module

    codegen.compile_graph = keep
    try:
        yield
    finally:
        codegen.compile_graph = real


def launches(sources: list[str]) -> str:
    """Our reduction launches, as ``grid x [XBLOCK, RBLOCK] warps``, forward | backward."""
    parts = []
    for source in sources:
        rows = [f"{m[2]}x[{m[3]},{m[4]}]w{m[5]}" for m in (LAUNCH.match(line) for line in source.splitlines()) if m]
        parts.append(" ".join(rows))
    return " | ".join(parts)


def compiled(backend: str) -> Callable:
    torch._dynamo.reset()
    if backend == "eager":
        return bn
    if backend == "inductor":
        return torch.compile(bn)
    return torch.compile(bn, backend="cgtrees", options={"cudagraphs": False, "cache": False})


def run_step(fn: Callable, data: tuple, backward: bool) -> tuple[torch.Tensor, ...]:
    x, w, b, grad = data
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    y = fn(*leaves)
    if not backward:
        return (y,)
    y.backward(grad)
    return (y, *(t.grad for t in leaves))


def device_us(step: Callable[[], object], iters: int) -> float:
    """Microseconds of kernel time per call (the profiler's device events, summed)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(iters):
            step()
        return 1e6 * (time.perf_counter() - start) / iters
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    total = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / iters


def errors(got: tuple, want: tuple) -> str:
    """The largest difference over each tensor's largest magnitude (y, dx, dw, db)."""
    worst = max((g.double() - w.double()).abs().max().item() / max(w.abs().max().item(), 1e-30)
                for g, w in zip(got, want))
    return f"{worst:.1e}"


def measure(backend: str, shape: tuple[int, ...], device: torch.device, iters: int, want: tuple) -> str:
    sources: list[str] = []
    data = inputs(shape, device)
    start = time.perf_counter()
    with kept_sources(sources):
        fn = compiled(backend)
        got = run_step(fn, data, backward=True)
    compile_s = time.perf_counter() - start
    fw = device_us(lambda: run_step(fn, data, backward=False), iters)
    both = device_us(lambda: run_step(fn, data, backward=True), iters)
    text = f"fw {fw:8.1f} us  bw {both - fw:8.1f} us  err {errors(got, want)}  compile {compile_s:5.1f}s"
    return text + (f"  {launches(sources)}" if sources else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=None)
    p.add_argument("--budget", type=float, default=270.0, help="stop sweeping after this many seconds")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="a tiny shape, on the CPU (CGTREES_INTERPRET=1)")
    args = p.parse_args()
    begin = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = args.shapes or (["4x8x32x64"] if args.smoke else list(SHAPES))
    backends = ("cgtrees",) if device.type == "cpu" else ("eager", "inductor", "cgtrees")
    wants = {}
    for text in shapes:
        shape = tuple(int(n) for n in text.split("x"))
        wants[text] = run_step(bn, inputs(shape, device), backward=True)
        for backend in backends:
            print(f"{text:>14} {backend:<22} {measure(backend, shape, device, args.iters, wants[text])}", flush=True)
    sweep = [s for s in (args.shapes or (shapes if args.smoke else SWEEP_SHAPES)) if s in wants]
    for label, knobs in VARIANTS[:2] if args.smoke else VARIANTS:
        for text in sweep:
            if time.perf_counter() - begin > args.budget:
                print(f"budget of {args.budget:.0f}s spent: sweep stopped before '{label}'")
                return
            shape = tuple(int(n) for n in text.split("x"))
            with patched(knobs):
                row = measure("cgtrees", shape, device, args.iters, wants[text])
            print(f"{text:>14} {label:<22} {row}", flush=True)


if __name__ == "__main__":
    main()
