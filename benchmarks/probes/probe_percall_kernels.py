"""GPU time per kernel of one mlp_small inference call (issue 44's per-call figure), for the raw CUDA
graph of the eager model and for cgtrees on its default path, from torch.profiler.

    python benchmarks/probes/probe_percall_kernels.py [--calls 200]

Prints each side's kernels (name, launches per call, microseconds per call), its GPU time per
call and the wall time per call, so that a per-call miss reads as kernels or as host time.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))
from percall_mlp_small import build, per_call_us, raw_graph  # noqa: E402


def kernels(fn, x: torch.Tensor, calls: int) -> dict[str, list[float]]:
    for _ in range(20):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            out[event.name].append(event.device_time)
    return out


def report(name: str, table: dict[str, list[float]], calls: int, wall_us: float) -> None:
    total = sum(sum(v) for v in table.values()) / calls
    print(f"== {name}: GPU {total:.1f} us/call, wall {wall_us:.1f} us/call")
    for kernel, times in sorted(table.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {len(times) / calls:5.1f}x {sum(times) / calls:8.2f} us  {kernel[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("CGTREES_CACHE", "0")
    model, x = build()
    with torch.no_grad():
        raw = raw_graph(model, x)
        report("raw graph", kernels(raw, x, args.calls), args.calls, per_call_us(raw, x))
        ours = torch.compile(model, backend="cgtrees")
        ours(x)
        report("cgtrees", kernels(ours, x, args.calls), args.calls, per_call_us(ours, x))


if __name__ == "__main__":
    main()
