"""Per call on the CPU with Dynamo alone beside the backends of ``cpu_percall.py``: eager, ``dyn``
(``backend="eager"``: Dynamo's graph under eager's autograd, what ``cgtrees.aot.as_captured`` runs),
``aot_eager`` and cgtrees, one intra-op thread, windows interleaved, the median window.

    python benchmarks/probes/probe_cpu_floor.py demo,mlp_small,norm_act
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_percall  # noqa: E402

BACKENDS = ("eager", "dyn", "aot_eager", "cgtrees")


def measure(name: str, mode: str, windows: int = 7, budget_s: float = 4.0) -> dict[str, float]:
    model, args, loss = cpu_percall.build(name)
    if mode == "infer":
        model.eval()
    compiled = {b: model if b == "eager" else torch.compile(model, backend="eager" if b == "dyn" else b)
                for b in BACKENDS}
    steps = {b: cpu_percall.step_of(m, args, loss, mode) for b, m in compiled.items()}
    for step in steps.values():
        for _ in range(3):
            step()
    start = time.perf_counter()
    steps["eager"]()
    calls = max(1, int(budget_s / windows / len(BACKENDS) / (time.perf_counter() - start)))
    samples: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for _ in range(windows):
        for backend, step in steps.items():
            start = time.perf_counter()
            for _ in range(calls):
                step()
            samples[backend].append((time.perf_counter() - start) / calls * 1e6)
    return {b: sorted(v)[len(v) // 2] for b, v in samples.items()}


def main() -> None:
    torch.set_num_threads(1)
    for name in sys.argv[1].split(","):
        for mode in ("infer", "train"):
            us = measure(name, mode)
            print(name, mode, {b: f"{v:.0f} ({v / us['eager']:.2f}x)" for b, v in us.items()}, flush=True)


if __name__ == "__main__":
    main()
