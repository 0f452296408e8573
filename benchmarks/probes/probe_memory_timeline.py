"""Where a training step's peak reserved memory is reached: reserved, allocated and their peaks after
each of the first steps, and reserved bytes by pool (the default pool, each CUDA-graph pool).

    python benchmarks/probes/probe_memory_timeline.py MODEL BACKEND [BACKEND ...]

Each backend runs in a process of its own (``--one``). Reads the peaks after each step, so a peak
reached during compilation (timing GEMMs, autotuning) shows at step 1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import real_sizes  # noqa: E402
import size_worker  # noqa: E402

MB = 2**20


def reserved_by_pool() -> str:
    pools: dict[str, int] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id") or (0, 0))
        name = "default" if pool == (0, 0) else f"pool{pool}"
        pools[name] = pools.get(name, 0) + segment["total_size"]
    return " ".join(f"{k}={v / MB:.0f}" for k, v in sorted(pools.items()))


def one(model: str, backend: str) -> None:
    device = torch.device("cuda")
    case = real_sizes.build(model, device)
    fn, _ = size_worker.compile_model(case.model, backend)
    opt = case.optimizer(list(case.model.parameters())) if case.optimizer else None
    mark = backend in ("cgtrees", "reduce-overhead")
    step = size_worker.make_step(case, fn, opt, mark, size_worker.Values(), [])
    size_worker.reset_memory(device)  # as the benchmark: peaks from before the first step
    for i in range(1, 9):
        step()
        torch.cuda.synchronize()
        print(f"{model} {backend} step {i}: reserved {torch.cuda.memory_reserved() / MB:.0f} "
              f"(peak {torch.cuda.max_memory_reserved() / MB:.0f}) allocated "
              f"{torch.cuda.memory_allocated() / MB:.0f} (peak {torch.cuda.max_memory_allocated() / MB:.0f}) "
              f"MiB; reserved by pool: {reserved_by_pool()}", flush=True)


def main() -> None:
    if sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3])
        return
    for backend in sys.argv[2:]:
        subprocess.run([sys.executable, __file__, "--one", sys.argv[1], backend], check=False)


if __name__ == "__main__":
    main()
