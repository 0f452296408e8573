"""A timing at compile time (``backend/codegen/gemm_timing.py``) is the GPU's time, not the host's:
another thread of the process holding the GIL (Triton's key hashed in the background, a parallel
compile) may launch the timed replay late, and that wait must not count."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timing,  # two timings compared: another worker's kernels on the GPU would skew either
]


def test_a_thread_holding_the_gil_does_not_lengthen_a_timing():
    from cgtrees.codegen import gemm_timing

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1 << 24, device=device)

    def build():
        return lambda: x.mul_(1.0)  # 128 MB read and written, about 30 us: a batch of ~2 ms

    gemm_timing.forget()
    quiet = gemm_timing.time_us("mul quiet", device, build)
    stop = threading.Event()

    def hold_the_gil() -> None:
        while not stop.is_set():
            sum(range(10_000))  # pure Python: it gives the GIL up only at the switch interval

    thread = threading.Thread(target=hold_the_gil, daemon=True)
    thread.start()
    try:
        busy = gemm_timing.time_us("mul busy", device, build)
    finally:
        stop.set()
        thread.join()
    print(f"quiet {quiet:.2f} us, with a thread holding the GIL {busy:.2f} us ({busy / quiet:.2f}x)")
    assert busy <= quiet * 1.25 + 0.5, (quiet, busy)
