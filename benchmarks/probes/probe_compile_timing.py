"""A decode step's attention compiled twice in one process (``gemm_decisions=measure``), each timing
the compile makes printed with its key, then the same forms timed by ``probe_attention_timing``: do
the figures a compile takes agree with those of a probe? Run from the repository root on a GPU:

    python3 benchmarks/probes/probe_compile_timing.py
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu"), os.path.dirname(__file__)]

import probe_attention_timing as probe  # noqa: E402
from codegen_helpers import compile_fn, config  # noqa: E402
from test_grouped_attention import decode_attention  # noqa: E402
from test_grouped_attention_gpu import _inputs  # noqa: E402

from cgtrees.codegen import gemm_timing  # noqa: E402

timed: list[tuple[str, bool, float, float]] = []
_time_us = gemm_timing.time_us


def logged(key, device, build, alone=False):
    start = time.perf_counter()
    us = _time_us(key, device, build, alone)
    timed.append((key, alone, us, time.perf_counter() - start))
    return us


def show() -> None:
    for key, alone, us, seconds in timed:
        print(f"   {us:7.2f} us alone={alone} {seconds:5.2f}s  {key[:260]}")
    timed.clear()


def main() -> None:
    gemm_timing.time_us = logged
    for attempt in range(2):
        module = compile_fn(decode_attention, *_inputs(1, 160), cfg=config(gemm_decisions="measure"))
        print("compile", attempt, [c for c in module.graph.gemm_choices if "attention" in c])
        show()
        gemm_timing.forget()
    print(probe.forms(1, 160, 0))
    show()


if __name__ == "__main__":
    main()
