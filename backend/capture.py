"""One CUDA-graph capture at a time in the process: ``recording_lock`` (public as
``cgtrees.runtime.recording_lock``), taken by every capture of ours: the runtime's recordings and
codegen's GEMM timings.

A capture's device synchronize and cuBLAS workspace reset must not run while another thread
captures. And with torch 2.11 a capture flags the device's default CUDA generator as capturing for
every thread, whether or not the graph draws random numbers: another thread's ``torch.randn`` then
raises "Offset increment outside graph capture encountered unexpectedly" (reduce-overhead's
recordings do the same; torch 2.13 keeps that state per capture), and two captures at once would
share one generator state. A program whose other threads draw from the default generator holds
this lock around those draws, or gives each thread a generator of its own (README, "Threads").
"""

from __future__ import annotations

import threading

recording_lock = threading.RLock()
