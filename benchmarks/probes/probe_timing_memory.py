"""Where a training step's peak memory comes from: the first step (compile, GEMM timing, warm-up)
against the steady steps, for ``backend="cudagraphs"`` and cgtrees under each ``gemm_decisions``.

The deep MLP of ``tests/gpu/test_runtime_memory.py`` (6 x Linear 1024, batch 256, fp32, SGD).
On the GPU machine: ``python benchmarks/probes/probe_timing_memory.py``; one line per backend,
MiB above the model and its input.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

MIB = 2**20


def _peak_since(base: int) -> float:
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MIB
    torch.cuda.reset_peak_memory_stats()
    return peak


def one(backend_name: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.ReLU())]).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 1024, device="cuda")
    f = torch.compile(model, backend=backend_name)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peaks = []
    for _ in range(6):
        f(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peaks.append(_peak_since(base))
    reserved = torch.cuda.memory_reserved() / MIB
    return " ".join(f"{p:6.1f}" for p in peaks) + f"  max {max(peaks):.1f}, reserved {reserved:.0f}"


def main() -> None:
    if len(sys.argv) > 1:
        print(one(sys.argv[1]))
        return
    print("MiB above the model, per step (1: compile + warm-up)")
    for name, env in (("cudagraphs", {}), ("cgtrees keep", {"CGTREES_GEMM_DECISIONS": "keep"}),
                      ("cgtrees measure", {"CGTREES_GEMM_DECISIONS": "measure"}),
                      ("cgtrees unfuse", {"CGTREES_GEMM_DECISIONS": "unfuse"})):
        out = subprocess.run([sys.executable, __file__, name.split()[0]], env={**os.environ, **env},
                             capture_output=True, text=True)
        print(f"{name:16s} {out.stdout.strip() or out.stderr[-500:]}", flush=True)


if __name__ == "__main__":
    main()
