"""Per call on the CPU: eager, ``aot_eager`` (Dynamo and AOTAutograd with no compiler: the floor of
any backend) and cgtrees, on the demo's block and the own suite's workloads at their full sizes.

On a CPU cgtrees runs each graph's aten ops as eager would (no decompositions that only serve
codegen), so a user who compiles on a laptop before a GPU run loses nothing: the target is at most
1.1x eager per call. One intra-op thread, so that other processes on the machine skew every backend
alike; the backends' windows are interleaved, and the figure of each is its median window.

    python benchmarks/cpu_percall.py [--workloads demo,mlp_small,...] [--modes infer,train] [--out FILE]
                                     [--decomposed]  (as before: decomposed for codegen on the CPU too)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads  # noqa: E402

BACKENDS = ("eager", "aot_eager", "cgtrees")
_DYNAMO = {"dynamo": "eager"}  # Dynamo alone, by the name of the backend that is only Dynamo
TARGET = 1.1


def build(name: str) -> tuple[torch.nn.Module, tuple, Callable[[torch.Tensor], torch.Tensor]]:
    if name == "demo":
        from cgtrees.demo import DemoBlock

        torch.manual_seed(0)
        return DemoBlock(128, 4), (torch.randn(4, 64, 128),), workloads.mean_square  # python -m cgtrees's CPU sizes
    model, inputs, loss = workloads.build(name)
    return model, inputs(torch.device("cpu")), loss


def step_of(fn: Callable[..., Any], args: tuple, loss: Callable, mode: str) -> Callable[[], None]:
    if mode == "infer":
        def infer() -> None:
            with torch.no_grad():
                fn(*args)
        return infer
    train_args = tuple(a.clone().requires_grad_() if a.is_floating_point() else a for a in args)

    def train() -> None:
        loss(fn(*train_args)).backward()
    return train


def measure(name: str, mode: str, windows: int, budget_s: float,
            backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    """One row; ``backends`` may add ``dynamo`` (``backend="eager"``: Dynamo's graph under eager's
    autograd, what ``cgtrees.aot.as_captured`` runs)."""
    # Dynamo's frames of earlier rows share code objects with this one's (the wrapper torch.compile puts
    # around a module's forward): past its recompile limit (8) Dynamo would run this row eagerly
    torch._dynamo.reset()
    model, args, loss = build(name)
    if mode == "infer":
        model.eval()
    steps = {b: step_of(model if b == "eager" else torch.compile(model, backend=_DYNAMO.get(b, b)), args, loss, mode)
             for b in backends}
    for step in steps.values():  # compile, warm up
        for _ in range(3):
            step()
    start = time.perf_counter()
    steps["eager"]()
    calls = max(1, int(budget_s / windows / len(backends) / max(time.perf_counter() - start, 1e-6)))
    samples: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(windows):
        for backend, step in steps.items():
            start = time.perf_counter()
            for _ in range(calls):
                step()
            samples[backend].append((time.perf_counter() - start) / calls * 1e6)
    us = {b: sorted(v)[len(v) // 2] for b, v in samples.items()}
    return {"workload": name, "mode": mode, "calls_per_window": calls, "windows": windows,
            **{f"{b}_us": round(us[b], 1) for b in backends},
            "cgtrees_over_eager": round(us["cgtrees"] / us["eager"], 3),
            "aot_eager_over_eager": round(us["aot_eager"] / us["eager"], 3)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload / mode | eager us | aot_eager us | cgtrees us | cgtrees / eager | target |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ok = "ok" if r["cgtrees_over_eager"] <= TARGET else "MISS"
        lines.append(f"| {r['workload']} / {r['mode']} | {r['eager_us']:.0f} | {r['aot_eager_us']:.0f} | "
                     f"{r['cgtrees_us']:.0f} | {r['cgtrees_over_eager']:.2f}x | <= {TARGET}x {ok} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="demo," + ",".join(workloads.WORKLOADS))
    p.add_argument("--modes", default="infer,train")
    p.add_argument("--windows", type=int, default=7)
    p.add_argument("--budget", type=float, default=6.0, help="seconds of timed calls per workload and mode")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--decomposed", action="store_true",
                   help="decompose as for codegen on the CPU too (how cgtrees ran before: the comparison)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.decomposed:
        from cgtrees.aot import decompositions

        decompositions.for_inputs = lambda example_inputs, interpret: decompositions.decomposition_table()
    rows = []
    for name in args.workloads.split(","):
        for mode in args.modes.split(","):
            if mode == "train" and name in workloads.INFER_ONLY:
                continue
            rows.append(measure(name, mode, args.windows, args.budget))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
                "cpu": platform.processor() or platform.machine(), "threads": 1, "decomposed": args.decomposed,
                "command": " ".join(sys.argv)}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
