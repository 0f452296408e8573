# ruff: noqa: B023  (each closure is timed before its loop variables change)
"""One-row GEMVs of a 1.1B Llama's decode step on the GPU (issue 55): cuBLAS, the grouped kernel as it
was (a reduction inside its loop over K), and ``gemv_row_kernel`` (``backend/codegen/grouped_gemv.py``)
over a sweep of block sizes, warps and K splits.

    python benchmarks/probes/probe_gemv.py [--out probe.json] [--budget 150]

Each figure is ``gemm_timing.time_us``'s (a CUDA graph of back-to-back calls, the best of three
replays), every call on another copy of the weights so that the copies together are twice the L2
cache: a decode step reads each weight once, from device memory. *TB/s*: the weights', x's and the
products' bytes over the time; the device's copy bandwidth (a 1 GiB ``copy_``, read plus write) is
measured first as the ceiling.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import torch

from cgtrees.codegen import gemm_timing, grouped_gemv

SHAPES = {  # name -> (weights' rows, K): nn.Linear's [N, K] of TinyLlama's shape
    "down": ((2048,), 5632), "qkv": ((2048, 256, 256), 2048), "o": ((2048,), 2048),
    "gate_up": ((5632, 5632), 2048), "lm_head": ((32000,), 2048),
}
OLD_CONFIGS = ((4, 512, 2), (8, 512, 2), (16, 512, 2))


def sweep() -> list[tuple[int, int, int, int]]:
    out = []
    for bn, bk, warps, split in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4, 8), (1, 2, 4, 8)):
        per_thread = bn * bk // (32 * warps)
        if bn * bk <= 8192 and 8 <= per_thread <= 64:
            out.append((bn, bk, warps, split))
    random.Random(0).shuffle(out)  # a sweep cut short by its budget still spans the space
    return out


def copy_tbs(device: torch.device) -> float:
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    us = gemm_timing.time_us("copy 1GiB", device, lambda: lambda: b.copy_(a))
    return 2 * a.numel() * 2 / us / 1e6


def operands(ns: tuple[int, ...], k: int, device: torch.device):
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    nbytes = sum(ns) * k * 2
    sets = [[torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5 for n in ns]
            for _ in range(max(1, -(-2 * l2 // nbytes)))]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    outs = [torch.empty(1, n, device=device, dtype=torch.bfloat16) for n in ns]
    return x, sets, outs, nbytes + 2 * k + 2 * sum(ns)


def rotating(fn, sets):
    turn = iter(range(1 << 62))
    return lambda: lambda: fn(sets[next(turn) % len(sets)])


def old_kernel(x, ws, outs, block_n, block_k, warps):
    """The grouped kernel's one-row path before this probe (M=1, no tl.dot)."""
    ns = [w.shape[0] for w in ws] + [0] * (3 - len(ws))
    ws, outs = ws + [ws[-1]] * (3 - len(ws)), outs + [outs[-1]] * (3 - len(outs))
    grid = (sum(-(-n // block_n) for n in ns),)
    grouped_gemv._kernel()[grid](x, *ws, *outs, *ns, M=1, K=x.shape[1], BLOCK_M=1, BLOCK_N=block_n,
                                 BLOCK_K=block_k, DOT=False, num_warps=warps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--budget", type=float, default=150.0, help="seconds for the sweep")
    a = p.parse_args()
    device = torch.device("cuda")
    start = time.time()
    result = {"gpu": torch.cuda.get_device_name(device), "copy_tbs": copy_tbs(device), "shapes": {}}
    print(f"{result['gpu']}: copy {result['copy_tbs']:.2f} TB/s", flush=True)
    configs = sweep()
    for name, (ns, k) in SHAPES.items():
        x, sets, outs, nbytes = operands(ns, k, device)
        rows = {}
        rows["cublas"] = gemm_timing.time_us(f"{name} cublas", device, rotating(
            lambda ws: [torch.mm(x, w.t(), out=o) for w, o in zip(ws, outs)], sets))
        for c in OLD_CONFIGS:
            rows[f"old {c}"] = gemm_timing.time_us(f"{name} old {c}", device, rotating(
                lambda ws, c=c: old_kernel(x, ws, outs, *c), sets))
        result["shapes"][name] = {"bytes": nbytes, "us": rows}
    per_shape = a.budget / len(SHAPES)
    for name, (ns, k) in SHAPES.items():
        x, sets, outs, nbytes = operands(ns, k, device)
        rows = result["shapes"][name]["us"]
        t0 = time.time()
        for c in configs:
            if time.time() - t0 > per_shape:
                rows["sweep cut"] = float(configs.index(c))
                break
            try:
                rows[f"row {c}"] = gemm_timing.time_us(f"{name} row {c}", device, rotating(
                    lambda ws, c=c: grouped_gemv.launch(x, ws, outs, *c), sets))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, not a stop
                print(f"{name} {c}: {type(exc).__name__}: {str(exc)[:100]}")
        ref = [x.float() @ w.float().t() for w in sets[0]]
        best = min((us, form) for form, us in rows.items() if form.startswith("row"))[1]
        grouped_gemv.launch(x, sets[0], outs, *configs[[f"row {c}" for c in configs].index(best)])
        err = max(((o.float() - r).abs().max() / r.abs().max()).item() for o, r in zip(outs, ref))
        result["shapes"][name]["best_rel_err"] = err
    result["seconds"] = time.time() - start
    print(f"\n{'shape':8} {'form':28} {'us':>8} {'TB/s':>6}")
    for name, r in result["shapes"].items():
        timed = sorted((us, form) for form, us in r["us"].items() if form != "sweep cut")
        shown = [t for t in timed if not t[1].startswith("row")] + [t for t in timed if t[1].startswith("row")][:4]
        for us, form in shown:
            print(f"{name:8} {form:28} {us:8.2f} {r['bytes'] / us / 1e6:6.2f}")
        print(f"{name:8} best row kernel rel err {r['best_rel_err']:.1e}, swept {len(timed)} forms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
