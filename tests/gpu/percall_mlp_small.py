"""Per-call time of mlp_small inference: raw torch.cuda.CUDAGraph vs cgtrees vs backend="cudagraphs".

Not a test (no test_ prefix): ``python tests/gpu/percall_mlp_small.py [--codegen]``. Medians of CUDA-event
windows. By default the kernel modules are the aten graphs (what the raw graph replays too), so the
figure is the runtime's own cost; ``--codegen`` uses our generated kernels.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn as nn


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)]
    layers.append(nn.Linear(256, 16))
    return nn.Sequential(*layers).cuda(), torch.randn(16, 256, device="cuda")


def raw_graph(model: nn.Module, x: torch.Tensor):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = model(x)

    def call(_x):
        graph.replay()
        return out
    return call


def per_call_us(fn, x: torch.Tensor, calls: int = 2000, windows: int = 7) -> float:
    def step():
        with torch.no_grad():
            fn(x)
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def profile(model: nn.Module, x: torch.Tensor) -> None:
    """Where the host time of one cgtrees call goes (cProfile over many calls, by own time)."""
    import cProfile
    import pstats

    ours = torch.compile(model, backend="cgtrees")
    with torch.no_grad():
        for _ in range(20):
            ours(x)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(1000):
            ours(x)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    torch._dynamo.reset()


def main() -> None:
    os.environ.setdefault("CGTREES_CACHE", "0")
    if "--codegen" not in sys.argv:  # measure the runtime on aten kernel modules (as raw_graph does)
        from backend import codegen

        codegen.compile_graph = lambda gm, example_inputs, ctx: codegen.AtenModule(gm)
    model, x = build()
    with torch.no_grad():
        want = model(x)
    results = {}
    results["raw_graph"] = per_call_us(raw_graph(model, x), x)
    ours = torch.compile(model, backend="cgtrees")
    with torch.no_grad():
        torch.testing.assert_close(ours(x), want)
    results["cgtrees"] = per_call_us(ours, x)
    torch._dynamo.reset()
    theirs = torch.compile(model, backend="cudagraphs")
    results["cudagraphs"] = per_call_us(theirs, x)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = per_call_us(model, x, calls=500)
    results["eager"] = eager
    if "--profile" in sys.argv:
        profile(model, x)
    for name, us in results.items():
        print(f"percall mlp_small {name:11s} {us:8.1f} us")
    print(f"percall ratio cgtrees/raw_graph = {results['cgtrees'] / results['raw_graph']:.2f} (target <= 1.25)")


if __name__ == "__main__":
    main()
