"""Probe: what the first call of a convolution configuration costs in a fresh process, by layout.

Run on the GPU machine: ``python benchmarks/probes/probe_conv_first_calls.py``. For each configuration
(mobilenet_v3_small's and convnext_atto's depthwise convolutions, and a few ordinary ones, fp32,
batch 32) it prints the first call's time in channels-last and in NCHW, a steady call's time for
each, and the first call of the same channels-last configuration on another thread (torch caches
cuDNN's plans per thread). One convolution of an unrelated shape runs first, so that cuDNN's own
loading is not counted against the first configuration.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F

CONFIGS = [  # name, channels in, channels out, size, kernel, stride, groups
    ("mb dw3 s2 16@112", 16, 16, 112, 3, 2, 16),
    ("mb dw3 s2 72@56", 72, 72, 56, 3, 2, 72),
    ("mb dw3 s1 88@28", 88, 88, 28, 3, 1, 88),
    ("mb dw5 s2 96@28", 96, 96, 28, 5, 2, 96),
    ("mb dw5 s1 240@14", 240, 240, 14, 5, 1, 240),
    ("mb dw5 s1 576@7", 576, 576, 7, 5, 1, 576),
    ("cx dw7 s1 40@56", 40, 40, 56, 7, 1, 40),
    ("cx dw7 s1 320@7", 320, 320, 7, 7, 1, 320),
    ("conv3 64->64@56", 64, 64, 56, 3, 1, 1),
    ("conv1 72->24@28", 72, 24, 28, 1, 1, 1),
    ("se conv1 96->24@1", 96, 24, 1, 1, 1, 1),
    ("cx stem4 s4 3->40@224", 3, 40, 224, 4, 4, 1),
]


def tensors(cin: int, cout: int, size: int, k: int, groups: int, cl: bool):
    x = torch.randn(32, cin, size, size, device="cuda")
    w = torch.randn(cout, cin // groups, k, k, device="cuda")
    if cl:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    return x, w


def first_and_steady(x, w, stride: int, k: int, groups: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    F.conv2d(x, w, None, stride, k // 2, 1, groups)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    for _ in range(3):
        F.conv2d(x, w, None, stride, k // 2, 1, groups)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        F.conv2d(x, w, None, stride, k // 2, 1, groups)
    end.record()
    torch.cuda.synchronize()
    return first, start.elapsed_time(end) / 20 * 1e3


def on_thread(x, w, stride: int, k: int, groups: int) -> float:
    out = []
    thread = threading.Thread(target=lambda: out.append(first_and_steady(x, w, stride, k, groups)[0]))
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name(),
          "benchmark", torch.backends.cudnn.benchmark, "tf32", torch.backends.cudnn.allow_tf32)
    x, w = tensors(8, 8, 20, 3, 1, True)
    t = time.perf_counter()
    first_and_steady(x, w, 1, 3, 1)
    print(f"cuDNN's load (one unrelated conv): {time.perf_counter() - t:.3f} s")
    print(f"{'config':24s} {'CL first ms':>11s} {'CL us':>8s} {'CL other thread ms':>18s} "
          f"{'NCHW first ms':>13s} {'NCHW us':>8s}")
    for name, cin, cout, size, k, stride, groups in CONFIGS:
        x, w = tensors(cin, cout, size, k, groups, True)
        cl_first, cl_us = first_and_steady(x, w, stride, k, groups)
        cl_thread = on_thread(x, w, stride, k, groups)
        x, w = tensors(cin, cout, size, k, groups, False)
        nc_first, nc_us = first_and_steady(x, w, stride, k, groups)
        print(f"{name:24s} {cl_first * 1e3:11.1f} {cl_us:8.1f} {cl_thread * 1e3:18.1f} "
              f"{nc_first * 1e3:13.1f} {nc_us:8.1f}")


if __name__ == "__main__":
    main()
