"""Every generated kernel of a steady step, with its device time per step (GPU).

Not a benchmark row: ``python benchmarks/kernel_list.py MODEL BACKEND [--mode infer] [--all]`` (a
model of either suite or of the real-size table (``bert_base``: its step as ``size_run`` times it,
optimizer included), ``cgtrees``, ``inductor`` or ``reduce-overhead``; ``--all`` lists library kernels too).
The profile in a row shows the top 40 entries and the sum of every kernel by kind; this lists each
generated kernel (ours: ``pw_``/``red_``/``scan_``; Inductor's: ``triton_``), so that two
backends' kernels can be compared by what they compute.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import real_sizes
import size_worker
from measure import GENERATED_PREFIXES
from worker import Kept, make_step


def kernels(model: str, backend: str, mode: str = "train", every: bool = False,
            steps: int = 10) -> list[tuple[float, int, str]]:
    """(us per step, launches per step, name) of each generated kernel (``every``: each kernel),
    the costliest first."""
    if model in real_sizes.MODELS:
        step = size_worker.row_step(model, backend)
    else:
        spec = {"workload": model, "backend": backend, "mode": mode, "device": "cuda", "smoke": False}
        step = make_step(spec, torch.device("cuda"), Kept())
    for _ in range(6):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.self_device_time_total / steps, e.count // steps, e.key) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and (every or e.key.startswith(GENERATED_PREFIXES))]
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("backend")
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument("--all", action="store_true", help="library kernels and copies too")
    args = parser.parse_args()
    rows = kernels(args.model, args.backend, args.mode, args.all)
    what = "kernels" if args.all else "generated kernels"
    print(f"{args.model} {args.mode} {args.backend}: {len(rows)} {what}, {sum(r[0] for r in rows):.1f} us per call")
    for us, n, name in rows:
        print(f"{us:9.1f} us {n:4d}x  {name[:110]}")


if __name__ == "__main__":
    main()
