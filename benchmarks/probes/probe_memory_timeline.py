"""Where a training step's peak reserved memory is reached: reserved, allocated and their peaks after
each of the first steps, and reserved bytes by pool (the default pool, each CUDA-graph pool).

    python benchmarks/probes/probe_memory_timeline.py MODEL BACKEND [BACKEND ...] [--as-benchmark] [--peak]

Each backend runs in a process of its own (``--one``). Reads the peaks after each step, so a peak
reached during compilation (timing GEMMs, autotuning) shows at step 1. ``--as-benchmark`` does what
``size_worker`` does around the steps: an eager reference step before compiling, the chosen
gradients kept from the first step, the cache emptied after step 3; and after the last step lists
the largest allocated blocks of each pool (what pins a pool's segments). ``--peak`` records the
allocator's history during step 1 and prints the moment its reserved bytes peaked: the largest blocks
allocated then, each with the innermost frames of our code, the model's or the benchmark's that made it.
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


def one(model: str, backend: str, as_benchmark: bool, peak: bool) -> None:
    device = torch.device("cuda")
    case = real_sizes.build(model, device)
    chosen = size_worker.chosen_params(case.model) if as_benchmark else []
    if as_benchmark:  # as size_worker.measure_row: an eager step first, then the mark before compiling
        size_worker.reference(case, case.model, chosen)
        if backend in ("cgtrees", "reduce-overhead"):
            torch.compiler.cudagraph_mark_step_begin()
    fn, _ = size_worker.compile_model(case.model, backend)
    opt = case.optimizer(list(case.model.parameters())) if case.optimizer else None
    mark = backend in ("cgtrees", "reduce-overhead")
    step = size_worker.make_step(case, fn, opt, mark, size_worker.Values(), chosen)
    size_worker.reset_memory(device)  # as the benchmark: peaks from before the first step
    for i in range(1, 9):
        if peak and i == 1:
            where_the_peak_was(step)
        else:
            step()
        torch.cuda.synchronize()
        print(f"{model} {backend} step {i}: reserved {torch.cuda.memory_reserved() / MB:.0f} "
              f"(peak {torch.cuda.max_memory_reserved() / MB:.0f}) allocated "
              f"{torch.cuda.memory_allocated() / MB:.0f} (peak {torch.cuda.max_memory_allocated() / MB:.0f}) "
              f"MiB; reserved by pool: {reserved_by_pool()}", flush=True)
        if as_benchmark and i == 3:
            size_worker.reset_memory(device)
    if as_benchmark:
        largest_blocks()


def where_the_peak_was(step, n: int = 12) -> None:
    base = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    step()
    torch.cuda.synchronize()
    events = [e for trace in torch.cuda.memory._snapshot()["device_traces"] for e in trace]
    torch.cuda.memory._record_memory_history(enabled=None)
    reserved = top = top_at = 0
    for i, e in enumerate(events):
        reserved += {"segment_alloc": e["size"], "segment_free": -e["size"]}.get(e["action"], 0)
        if reserved > top:
            top, top_at = reserved, i
    live: dict[int, dict] = {}
    for e in events[: top_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] in ("free_requested", "free_completed"):
            live.pop(e["addr"], None)
    held = sum(e["size"] for e in live.values())
    print(f"step 1 peak: reserved {(base + top) / MB:.0f} MiB ({top / MB:+.0f} over the step's start), "
          f"{held / MB:.0f} MiB of blocks allocated since the step began live then; event {top_at} of {len(events)}")
    for e in sorted(live.values(), key=lambda e: -e["size"])[:n]:
        ours = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in e.get("frames", [])
                if any(k in f["filename"] for k in ("cgtrees", "backend/", "transformers", "benchmarks"))]
        print(f"  {e['size'] / MB:8.1f} MiB  " + " < ".join(ours[:4]), flush=True)


def largest_blocks(n: int = 6) -> None:
    """Per pool: its allocated MiB and the sizes of its largest allocated blocks."""
    blocks: dict[str, list[int]] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id") or (0, 0))
        name = "default" if pool == (0, 0) else f"pool{pool}"
        blocks.setdefault(name, []).extend(b["size"] for b in segment["blocks"] if b["state"] == "active_allocated")
    for name, sizes in sorted(blocks.items()):
        top = ", ".join(f"{s / MB:.1f}" for s in sorted(sizes, reverse=True)[:n])
        print(f"  {name}: {sum(sizes) / MB:.0f} MiB allocated in {len(sizes)} blocks; largest (MiB): {top}", flush=True)


def main() -> None:
    flags = [a for a in sys.argv[1:] if a in ("--as-benchmark", "--peak")]
    args = [a for a in sys.argv[1:] if a not in flags]
    if args[0] == "--one":
        one(args[1], args[2], "--as-benchmark" in flags, "--peak" in flags)
        return
    for backend in args[1:]:
        subprocess.run([sys.executable, __file__, "--one", args[0], backend, *flags], check=False)


if __name__ == "__main__":
    main()
