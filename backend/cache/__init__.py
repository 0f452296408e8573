"""cache: the persistent on-disk compile cache, in two levels.

    level 1 (aot.py)      Dynamo graph -> its ``CompiledFunction`` (``cgtrees.compiled_function``:
                          runtime plan, the level-2 digests of its kernel modules, ...): a hit
                          skips AOTAutograd, partitioning and codegen
    level 2 (modules.py)  aten graph -> kernel module: a hit skips codegen

A kernel module is kept as its source and its kernels' compiled binaries (``codegen.binaries``),
so a hit at either level compiles no kernel and launches them without Triton's JIT.

Keys are explicit objects (key.py); entries live in a versioned, private directory, written
atomically under a lock per entry (store.py). The driver builds the level-1 value
(``aot.recorder``) and turns it into the callable (``aot.rebuild``, which re-wraps the modules in
the runtime on every hit); the cache only stores and loads it. Every torch private API the cache
itself uses is in compat.py.

With the option ``remote_cache``, a cluster's Redis server is a second tier behind the local
directory (remote.py): both levels, signed with the cluster's key, one compile per graph.

The cache sits beside the pipeline: the driver (``aot.driver``) lists the steps and asks it
    open_store        the cache, opened once per Dynamo graph and handed to each step below
    load_aot          level 1, before AOTAutograd: the whole compiled function (a hit), or the
                      ``Slot`` the driver's recorder writes the new entry to (a miss)
    module_key        level 2's key for an aten graph (None: cache off, or a counted bypass)
    lookup_module     the stored kernel module, or None
    store_module      keep a generated module
    graph_hash        the digest of an aten graph's canonical text, for its module's header
``triton_key_file`` names the file where codegen keeps Triton's hash of itself between processes;
``triton_cache_dir`` points Triton's own cache at the store's directory for one compile.
The cache imports nothing of the driver and calls nothing back: it hands out typed values.
"""

from __future__ import annotations

import torch.fx

from cgtrees.cache.aot import load as load_aot
from cgtrees.cache.compat import Uncacheable
from cgtrees.cache.key import graph_digest, text_digest
from cgtrees.cache.modules import ModuleKey, open_store, triton_cache_dir, triton_key_file
from cgtrees.cache.modules import key_for as module_key
from cgtrees.cache.modules import lookup as lookup_module
from cgtrees.cache.modules import store as store_module
from cgtrees.cache.store import Store

__all__ = ["open_store", "load_aot", "module_key", "lookup_module", "store_module", "graph_hash", "triton_key_file",
           "triton_cache_dir", "Store"]


def graph_hash(gm: torch.fx.GraphModule, key: ModuleKey | None) -> str | None:
    """The digest of the graph's canonical text (from its key, which holds it, when there is one);
    None for a graph with no such text (a call target without a stable name, say)."""
    if key is not None:
        return text_digest(key.key.graph)
    try:
        return graph_digest(gm)
    except Uncacheable:
        return None
