"""The Llama MLP's gate, up and SiLU-and-multiply of a 1.1B Llama's decode step on the GPU (issue 55):
unfused (cuBLAS twice, or one ``grouped_mm`` with each of ``shared_input_gemms``'s block sizes, then
the pointwise kernel) against ``mm_silu_mul`` (``backend/codegen/gemv_silu_mul.py``) over a sweep of
block sizes and warps.

    python benchmarks/probes/probe_gemv_silu_mul.py [--out probe.json] [--rows 1] [--budget 60]

Each figure is ``gemm_timing.time_us``'s (a CUDA graph of back-to-back calls, the best of three
replays) of the forms ``gate_up_gemms`` times at compile time: every call reads another copy of the
weights, the copies together twice the L2 cache (a decode step reads each weight once, from device
memory). *TB/s*: the two weights' bytes, x's and the result's over the time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from cgtrees.codegen import gate_up_gemms, gemm_timing, gemv_silu_mul, shared_input_gemms

N, K = 5632, 2048  # TinyLlama's intermediate and hidden sizes


def sweep() -> list[tuple[int, int, int]]:
    """Block sizes whose two float32 tiles hold 8 to 64 elements a thread."""
    return [(bn, bk, warps) for bn, bk, warps in itertools.product((1, 2, 4), (256, 512, 1024, 2048), (1, 2, 4, 8))
            if bn * bk <= 4096 and 8 <= 2 * bn * bk // (32 * warps) <= 64]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--budget", type=float, default=60.0, help="seconds for the fused sweep")
    a = p.parse_args()
    device = torch.device("cuda")
    start = time.time()
    x = torch.empty(a.rows, K, dtype=torch.bfloat16, device="meta")
    w = torch.empty(N, K, dtype=torch.bfloat16, device="meta")
    nbytes = 2 * N * K * 2 + a.rows * (K + N) * 2
    us: dict[str, float] = {}
    forms = {"unfused cublas": gate_up_gemms._unfused_form(x, w, w, None, device)}
    forms.update({f"unfused grouped_mm {c}": gate_up_gemms._unfused_form(x, w, w, c, device)
                  for c in shared_input_gemms.configs(a.rows, x.dtype)})
    for name, (key, build, _) in forms.items():
        us[name] = gemm_timing.time_us(key, device, build)
    configs = {f"fused {c}": c for c in [*gate_up_gemms._fused_configs(a.rows, x.dtype), *sweep()]}
    t0 = time.time()
    for c in configs.values():
        if time.time() - t0 > a.budget:
            break
        key, build, _ = gate_up_gemms._fused_form(x, w, w, c, device)
        try:
            us[f"fused {c}"] = gemm_timing.time_us(key, device, build)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a line, not a stop
            print(f"fused {c}: {type(exc).__name__}: {str(exc)[:100]}")
    best = min((t, n) for n, t in us.items() if n.startswith("fused"))[1]
    result = {"gpu": torch.cuda.get_device_name(device), "rows": a.rows, "shape": [N, K], "bytes": nbytes,
              "us": us, "best_fused": best, "rel_err": rel_err(a.rows, configs[best]), "seconds": time.time() - start}
    print(f"{result['gpu']}: gate/up {N} x {K} bf16, {a.rows} row(s)\n{'form':40} {'us':>8} {'TB/s':>6}")
    for t, name in sorted((t, n) for n, t in us.items()):
        print(f"{name:40} {t:8.2f} {nbytes / t / 1e6:6.2f}")
    best_unfused = min(t for n, t in us.items() if n.startswith("unfused"))
    best_fused = min(t for n, t in us.items() if n.startswith("fused"))
    print(f"best unfused {best_unfused:.2f} us, best fused {best_fused:.2f} us ({best_unfused / best_fused:.2f}x); "
          f"fused rel err {result['rel_err']:.1e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


def rel_err(rows: int, best: tuple[int, int, int]) -> float:
    """The best fused form's result against eager's, largest difference over eager's largest value."""
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    wg, wu = ((torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16() for _ in range(2))
    want = F.silu(x @ wg.t()) * (x @ wu.t())
    got = torch.empty_like(want)
    gemv_silu_mul.launch(x, wg, wu, got, *best)
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


if __name__ == "__main__":
    main()
