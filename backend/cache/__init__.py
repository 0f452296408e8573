"""cache: the persistent on-disk compile cache, in two levels.

    level 1 (aot.py)      Dynamo graph -> whole AOT result (kernel modules + runtime plan):
                          a hit skips AOTAutograd, partitioning and codegen
    level 2 (modules.py)  aten graph -> kernel module: a hit skips codegen

A kernel module is kept as its source and its kernels' compiled binaries (``codegen.binaries``),
so a hit at either level compiles no kernel and launches them without Triton's JIT.

Keys are explicit objects (key.py); entries live in a versioned, private directory, written
atomically under a lock per entry (store.py). Every hit re-wraps the modules in the runtime.
Every torch private API the cache uses is in compat.py.

The driver calls three functions: ``load_aot`` before AOTAutograd, ``compile_module`` for each aten
graph, and ``record_module`` after it, so that level 1 can write its entry. ``triton_key_file``
names the file where codegen keeps Triton's hash of itself between processes.
"""

from __future__ import annotations

from backend.cache.aot import load as load_aot
from backend.cache.aot import record as record_module
from backend.cache.modules import compile_module, triton_key_file

__all__ = ["load_aot", "compile_module", "record_module", "triton_key_file"]
