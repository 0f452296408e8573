"""Programmatic dependent launch of our GEMV kernels: on Hopper, in a CUDA graph, a GEMV starts while
the kernel before it is still running, reads its weights, and only then waits for that kernel's writes.
``decode_attention`` launches early too, and waits before it reads anything.

A decode step is a chain of small kernels, each of which can only begin when the one before it has
ended: between two of them the GPU drains the first one's last programs, launches the next, and
waits a memory round trip for its first bytes, a few microseconds in which little is read. A kernel
launched with programmatic stream serialization (``launch_pdl``, Triton's name for the launch
attribute) may instead start as soon as every program of the kernel before it has signalled
(``gdc_launch_dependents``, or its end); it then loads what no kernel of the graph writes (a GEMV's
weights) and calls ``gdc_wait``, which returns once the previous kernel has ended and its writes
are visible. So the next weight read overlaps the previous kernel's tail.

Loads before ``gdc_wait`` are safe only for tensors that nothing running at that time writes. Our
GEMVs' weights are graph inputs that the graph does not write (``shared_input_gemms.weight``); and
``on`` is true only while a CUDA graph is being captured, so the graph's first kernel is ordered
after all the work before the graph as a whole, and never launched early after an optimizer's
update of those weights in eager code. Compiled kernels only (the interpreter has no such
instruction), on a device of compute capability 9 or more.

A GEMM timing (``gemm_timing``) runs its candidates once outside its capture too; there ``timing()``
launches them early as well, so each is compiled once, as it will run (a kernel launched early is
another binary for Triton): the values a timing computes are never read.

``ENABLED`` is for measuring what it gives (``benchmarks/serve_worker.py``'s ``cgtrees-nopdl``);
``early_launches`` counts the GEMVs launched early (captured, so never on a replay's path).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator

import torch

from cgtrees.codegen import interp

ENABLED = True
early_launches = 0
_timing = threading.local()  # this thread's: another one's eager launches stay plain


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def on(device: torch.device) -> bool:
    """Whether a GEMV launched now on ``device`` is launched early (``launch_pdl``) and waits inside."""
    global early_launches
    early = ENABLED and device.type == "cuda" and not interp.active() and \
        _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device()) and \
        (getattr(_timing, "on", False) or torch.cuda.is_current_stream_capturing())
    early_launches += early
    return early


@contextlib.contextmanager
def timing() -> Iterator[None]:
    """GEMVs launched in this context launch early, captured or not (their values are not read)."""
    before, _timing.on = getattr(_timing, "on", False), True
    try:
        yield
    finally:
        _timing.on = before
