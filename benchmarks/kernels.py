"""Kernel-level report: achieved bandwidth of generated kernels against the device copy bandwidth.

    python benchmarks/kernels.py [--json]

Each function is compiled alone over a (8192, 4096) fp32 tensor (cgtrees with CUDA graphs off, so
only the kernels are timed; Inductor and eager beside it for reference) and timed with
``triton.testing.do_bench`` (median, L2 flushed between calls). Bandwidth counts the minimal bytes:
every input read once and every output written once. The copy bandwidth is a large
device-to-device copy, bytes read + written. At 128 MiB a call, launch overhead is hidden: the CPU
queues calls faster than the GPU runs them.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch
import torch.nn.functional as F

SHAPE = (8192, 4096)
COPY_BYTES = 2**30  # per buffer: large enough to dwarf caches and launch cost


def pointwise(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) * torch.tanh(x) + x * 0.5


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias)


def _inputs(name: str, device: torch.device) -> tuple:
    x = torch.randn(SHAPE, device=device)
    if name != "layernorm":
        return (x,)
    return x, torch.randn(SHAPE[-1], device=device), torch.randn(SHAPE[-1], device=device)


FUNCTIONS: dict[str, Callable] = {"pointwise": pointwise, "softmax": softmax, "layernorm": layernorm}
BACKENDS = ("cgtrees", "inductor", "eager")


def compiled(fn: Callable, backend: str) -> Callable:
    if backend == "cgtrees":
        return torch.compile(fn, backend="cgtrees", options={"cudagraphs": False})
    if backend == "inductor":
        return torch.compile(fn)
    return fn


def bench_s(fn: Callable, args: tuple) -> float:
    from triton.testing import do_bench

    return do_bench(lambda: fn(*args), warmup=25, rep=200, return_mode="median") / 1e3


def copy_bandwidth(device: torch.device) -> tuple[float, int]:
    """Bytes per second of a device-to-device copy, and the bytes (read + written) it moves."""
    src = torch.empty(COPY_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    moved = 2 * COPY_BYTES
    return moved / bench_s(dst.copy_, (src,)), moved


def one_kernel(name: str, backend: str, device: torch.device, copy_bps: float) -> dict:
    """Time one function under one backend; the error is reported, not raised."""
    row: dict = {"name": name, "backend": backend, "shape": list(SHAPE)}
    try:
        args = _inputs(name, device)
        fn = compiled(FUNCTIONS[name], backend)
        out = fn(*args)
        row["bytes"] = sum(a.nbytes for a in args) + out.nbytes
        row["time_s"] = bench_s(fn, args)
        row["gbps"] = row["bytes"] / row["time_s"] / 1e9
        row["pct_of_copy"] = 100 * row["bytes"] / row["time_s"] / copy_bps
        row["max_err"] = (out - FUNCTIONS[name](*args)).abs().max().item()
    except Exception as exc:  # the report says what failed and goes on
        row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    return row


def measure() -> dict:
    if not torch.cuda.is_available():
        return {"error": "the kernel report needs CUDA"}
    device = torch.device("cuda")
    import triton

    copy_bps, moved = copy_bandwidth(device)
    torch.cuda.empty_cache()
    kernels = [one_kernel(n, b, device, copy_bps) for n in FUNCTIONS for b in BACKENDS]
    return {"copy_gbps": copy_bps / 1e9, "copy_bytes": moved, "kernels": kernels,
            "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "triton": triton.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line (for run.py)")
    args = parser.parse_args()
    result = measure()
    if args.json:
        print(json.dumps(result), flush=True)
        return
    import report

    print(report.kernel_table(result))


if __name__ == "__main__":
    main()
