"""Where a steady training (or inference) step's peak memory lives (on the GPU machine).

    python benchmarks/memory_profile.py MODEL BACKEND [BACKEND ...] [--mode infer]

Builds each workload as a benchmark worker does (own or real suite names), runs a few steps, then
one more with the allocator's peak reset before it, and prints: what is allocated between steps,
the peak within the step (the benchmark's "peak allocated"), and the allocated bytes at the end of
the step by memory pool: the default pool (parameters, gradients the caller holds, the optimizer's
state and everything eager allocates) and each private pool (a CUDA graph pool: a replay allocates
nothing, so its blocks are what the recordings left allocated: saved activations, outputs, input
slots). Every backend runs in a process of its own. ``--blocks`` also writes every block allocated
between steps with the Python frames that allocated it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from worker import Kept, make_step  # noqa: E402

MB = 2**20


def by_pool() -> dict[str, int]:
    """Allocated bytes now, by pool: 'default' or the private pool's id."""
    pools: dict[str, int] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = segment.get("segment_pool_id") or (0, 0)
        name = "default" if tuple(pool) == (0, 0) else f"private {tuple(pool)}"
        pools[name] = pools.get(name, 0) + segment["allocated_size"]
    return pools


def held_blocks(path: str) -> None:
    """Every block allocated now, with its size and where it was allocated (the innermost Python
    frames of the allocation, recorded since the process began), as JSON lines: two backends'
    files compared by size show which allocations one holds and the other does not."""
    with open(path, "w") as f:
        for segment in torch.cuda.memory_snapshot():
            for block in segment["blocks"]:
                if block["state"] != "active_allocated":
                    continue
                frames = [f"{fr['filename'].split('site-packages/')[-1]}:{fr['line']} {fr['name']}"
                          for fr in block.get("frames", []) if fr["filename"].endswith(".py")][:8]
                f.write(json.dumps({"size": block["size"], "frames": frames}) + "\n")


def profile(model: str, backend: str, blocks: str | None, mode: str = "train") -> None:
    if blocks:
        torch.cuda.memory._record_memory_history(enabled="state", stacks="python")
    spec = {"workload": model, "backend": backend, "mode": mode, "device": "cuda", "smoke": False}
    keep = Kept()
    step = make_step(spec, torch.device("cuda"), keep)
    for _ in range(8):  # compile, record, warm up
        step()
    keep.to_host()  # as a benchmark worker does before its steady state
    torch.cuda.synchronize()
    between = torch.cuda.memory_allocated()
    if blocks:
        held_blocks(f"{blocks}-{model}-{backend}.jsonl")
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    pools = ", ".join(f"{name} {n / MB:.1f}" for name, n in sorted(by_pool().items()))
    print(f"{model} {backend}: between steps {between / MB:.1f} MB, peak in the step {peak / MB:.1f} MB "
          f"(+{(peak - between) / MB:.1f}); allocated after it by pool (MB): {pools}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("backends", nargs="+")
    p.add_argument("--blocks", metavar="PREFIX", help="write the blocks allocated between steps, with "
                   "where each was allocated, to PREFIX-MODEL-BACKEND.jsonl")
    p.add_argument("--mode", default="train", choices=["train", "infer"])
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    if args.one:
        profile(args.model, args.backends[0], args.blocks, args.mode)
        return
    more = (["--blocks", args.blocks] if args.blocks else []) + ["--mode", args.mode]
    for backend in args.backends:
        subprocess.run([sys.executable, __file__, args.model, backend, "--one", *more], check=False)


if __name__ == "__main__":
    main()
