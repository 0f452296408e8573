"""cache: the persistent on-disk compile cache, in two levels.

    level 1 (aot.py)      Dynamo graph -> whole AOT result (runtime plan + the level-2 digests
                          of its kernel modules): a hit skips AOTAutograd, partitioning and codegen
    level 2 (modules.py)  aten graph -> kernel module: a hit skips codegen

A kernel module is kept as its source and its kernels' compiled binaries (``codegen.binaries``),
so a hit at either level compiles no kernel and launches them without Triton's JIT.

Keys are explicit objects (key.py); entries live in a versioned, private directory, written
atomically under a lock per entry (store.py). Every hit re-wraps the modules in the runtime.
Every torch private API the cache uses is in compat.py.

The cache sits beside the pipeline: the driver (``aot.driver``) lists the steps and asks it
    load_aot          level 1, before AOTAutograd: the whole compiled function, or None
    module_key        level 2's key for an aten graph (None: cache off, or a counted bypass)
    lookup_module     the stored kernel module, or None
    store_module      keep a generated module
    record_module     hand level 1 each compiled aten graph, so it can write its entry
``triton_key_file`` names the file where codegen keeps Triton's hash of itself between processes.
"""

from __future__ import annotations

from backend.cache.aot import load as load_aot
from backend.cache.aot import record as record_module
from backend.cache.modules import key_for as module_key
from backend.cache.modules import lookup as lookup_module
from backend.cache.modules import store as store_module
from backend.cache.modules import triton_key_file

__all__ = ["load_aot", "module_key", "lookup_module", "store_module", "record_module", "triton_key_file"]
