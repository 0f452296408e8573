"""Compile a kernel module's Triton kernels together, before its first call.

Triton compiles a kernel at its first launch, so a module's first call compiles its kernels one
after the other: the 41 kernels of mlp_small's training step spent 12.3 s there on an H200. Each
compiled (not interpreted) module's graph lists its kernels with the argument types of their
launches (``CompiledGraph.precompile``, made by ``wrapper``); ``precompile`` warms them all at once
on a thread pool, since Triton's passes and ptxas leave the GIL (those 41 kernels: 4.1 s on 8
threads). A warmup
with dtype placeholders specialises like the launch (pointers 16-byte aligned, the same ints), so
the launch finds the compiled kernel; a launch that specialises otherwise (a misaligned view)
compiles as before. A module of one kernel (or a Triton without parallel compiles) warms its
kernels one after the other: what it compiles here is what the cache keeps (``binaries``).

Nothing here can break a module: any error is logged once and the kernels compile at launch.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from types import ModuleType

import torch

from cgtrees.codegen import compat
from cgtrees.compiled import CompiledGraph
from cgtrees.logs import log_once

log = logging.getLogger("cgtrees.codegen")

MAX_THREADS = 16


def precompile(module: ModuleType, graph: CompiledGraph, name: str) -> int:
    """Compile every kernel of ``module`` that ``graph.precompile`` lists; the number handed to the compiler."""
    entries = graph.precompile
    if not entries:
        return 0
    threads = max(1, min(MAX_THREADS, os.cpu_count() or 1, len(entries)))
    parallel = threads > 1 and compat.parallel_compiles_supported()
    device = torch.device(graph.device)
    namespace = vars(module)
    start = time.perf_counter()
    try:  # Triton compiles for the current device: make it the module's
        with torch.cuda.device(device) if device.type == "cuda" and device.index is not None else nullcontext():
            with compat.parallel_compiles(threads) if parallel else nullcontext():
                for launch in entries:
                    dtypes = [getattr(torch, d) for d in launch.pointers]  # a placeholder stands for a tensor
                    namespace[launch.kernel].warmup(*dtypes, *launch.sizes, grid=(1,), **dict(launch.meta))
    except Exception as exc:  # noqa: BLE001  (the kernels still compile at their launches)
        log_once(log, f"precompile:{name}", "cgtrees codegen: %s: compiling its kernels together failed "
                 "(%s: %s); they compile at their first launch", name, type(exc).__name__, exc)
        return 0
    log.debug("cgtrees codegen: %s: %d kernels compiled on %d threads in %.2f s", name, len(entries), threads,
              time.perf_counter() - start)
    return len(entries)
