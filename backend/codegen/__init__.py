"""codegen: lower one aten graph to a kernel module with ``call(args) -> outputs``.

    generate(gm, example_inputs, ctx) -> source     the module text (readable, runs on its own)
    load(source, ctx, path=None, binaries=None)     import it (from a file, so Triton can read it);
                                                    its kernels launch from compiled binaries
                                                    (``binaries``), given or its own
    compile_graph(gm, example_inputs, ctx)          load(generate(...)); CGTREES_DEBUG_DIR keeps a copy
    prepare(example_inputs, config, remember_key_in, compiles)  start what the first kernel will
                                                    wait for (Triton's hash of itself, when it compiles)
    first_calls.start(forward, backward)            a warm load: the modules' cuDNN/cuBLAS calls
                                                    (``LIBRARY_CALLS``) made beforehand, a backward
                                                    module's on autograd's device thread

The steps of ``generate``: lower the FX graph to IR (``graph``), group steps into kernels
(``scheduler``), write kernels and the ``call`` wrapper (``kernel``, ``wrapper``). CPU graphs
without the interpreter become a module of aten calls only (still cacheable as source). Nothing
here crashes the user's program: an op that cannot be lowered becomes an aten call, a graph that
cannot be generated runs through aten, and a kernel that fails to compile switches its module to
the aten path (``call_aten``) with the reason and the source path logged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.fx

from backend import counters
from backend.codegen.module import (
    UNKNOWN,
    AtenModule,
    CompiledModule,
    GraphFacts,
    KernelModule,
    facts_of,
    has_symbolic_shapes,
    library_calls,
)
from backend.codegen.precompile import precompile
from backend.context import GraphContext
from backend.logs import log_once

log = logging.getLogger("backend.codegen")

__all__ = ["generate", "load", "compile_graph", "prepare", "CompiledModule", "KernelModule", "AtenModule",
           "GraphFacts", "facts_of", "has_symbolic_shapes", "graph_hash", "debug_path", "UNKNOWN"]


def prepare(example_inputs: list, config: Any, remember_key_in: Path | None = None, compiles: bool = True) -> None:
    """Called as a Dynamo graph arrives, before AOTAutograd (``compiles``: a level-1 miss) or before a
    warm load: a graph with CUDA inputs launches Triton kernels. A compiled kernel's first launch
    waits for Triton's hash of itself (remembered in ``remember_key_in``, a file of our cache, for
    later processes), started here in the background when the graph ``compiles``. A warm load's
    kernels launch stored binaries, which need no hash: it is only put where a kernel that goes
    through the JIT after all reads it back (no thread walking Triton's files beside Dynamo's guard
    building, whose GIL it would share)."""
    if config.interpret or not any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        return
    from backend.codegen.compat import hash_triton_in_background, share_triton_key

    if compiles:
        hash_triton_in_background(remember_key_in)
    else:
        share_triton_key(remember_key_in)


# ----------------------------------------------------------------------------------------- generate
def generate(gm: torch.fx.GraphModule, example_inputs: list, ctx: GraphContext) -> str:
    """The full source of the kernel module for ``gm``."""
    from backend.codegen import wrapper

    _ensure_meta(gm, example_inputs)  # shapes/strides/dtypes of every node
    header = [*_header(ctx, graph_hash(gm)), f"MUTATED_INPUTS = {mutated_inputs(gm)!r}"]
    if not _uses_triton(gm, ctx):  # CPU without the interpreter: aten calls only
        return "\n".join([*header, "import math", "import operator", "", "import torch", "", "aten = torch.ops.aten",
                          "", "", *wrapper.aten_call(gm), "", "", "call = call_aten", ""])
    from backend.codegen import input_writes, merged_sums
    from backend.codegen.graph import GraphLowerer
    from backend.codegen.scheduler import schedule

    gm = merged_sums.rewritten(gm)  # a bias gradient's sum next to the kernel of what it sums
    gm = input_writes.placed(gm)  # a running statistic's update next to the kernel of the statistic
    program = GraphLowerer(gm, ctx.config).run()  # aten nodes -> IR steps (fallbacks as aten calls)
    items = schedule(program)  # steps -> fused kernels, aten calls, views
    source, n_kernels = wrapper.module_source(header, program, items, gm, ctx.config.interpret)  # text
    counters.bump("kernels_generated", n_kernels)
    return source


def _header(ctx: GraphContext, digest: str | None) -> list[str]:
    """The module's header: the digest of the canonical graph text (``cache.key.graph_text``, the
    text the cache key holds) and the digest of the key itself, the name of its cache entry."""
    import triton

    return [
        f"# cgtrees kernel module for {ctx.name} ({ctx.kind})",
        f"# graph hash: {digest or 'none (the graph has no canonical text)'}",
        f"# cache key: {ctx.cache_key or 'none (not cached)'}",
        f"# versions: torch {torch.__version__}, triton {triton.__version__}",
        f"GRAPH_HASH = {digest!r}",
    ]


def mutated_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """The inputs the graph writes into (``aten.copy_(input, value)``, an in-place op of the program
    that AOTAutograd functionalised), by position: a first call that fails puts them back before it
    reruns through aten (``KernelModule.call``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, p in enumerate(placeholders)
                 if any(u.target is torch.ops.aten.copy_.default and u.args[0] is p for u in p.users))


def graph_hash(gm: torch.fx.GraphModule) -> str | None:
    """The digest of the graph's canonical text, the one the cache key holds; None for a graph
    with no such text (a call target without a stable name, say)."""
    from backend.cache.compat import Uncacheable
    from backend.cache.key import graph_digest

    try:
        return graph_digest(gm)
    except Uncacheable:
        return None


def _uses_triton(gm: torch.fx.GraphModule, ctx: GraphContext) -> bool:
    devices = set()
    for node in gm.graph.nodes:
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor):
                devices.add(v.device.type)
    if len(devices) > 1:
        log_once(log, f"devices:{ctx.name}", "cgtrees codegen: %s mixes devices %s; it runs through aten",
                 ctx.name, sorted(devices), level=logging.INFO)
        return False
    return devices == {"cuda"} or bool(ctx.config.interpret)


def _ensure_meta(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    if all("val" in n.meta for n in gm.graph.nodes if n.op in ("placeholder", "call_function")):
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


# --------------------------------------------------------------------------------------------- load
_counter = itertools.count()


def load(source: str, ctx: GraphContext, path: str | None = None, precompile_kernels: bool = True,
         binaries: dict[str, list[dict]] | None = None, facts: GraphFacts = UNKNOWN,
         dynamic: bool = False, code: dict[str, str] | None = None) -> KernelModule:
    """Import ``source`` (written to ``path``, or to a fresh temporary file) as a kernel module whose
    kernels launch from compiled binaries, without Triton's JIT (``codegen.binaries``). A fresh
    module first compiles its kernels together and launches what that compiled; a cache hit
    (``precompile_kernels=False``) launches the entry's ``binaries``, its kernels left undecorated
    until a launch needs the JIT (a kernel without a binary loads from Triton's on-disk cache);
    ``code``, the entry's compiled code of that source (``binaries.code_record``), spares compiling it."""
    if ctx.config.interpret:
        # Triton decides interpreted or compiled when a kernel is decorated: set before importing.
        from backend.codegen import interp

        interp.enable()
    if path is None:
        directory = tempfile.mkdtemp(prefix="cgtrees_kernels_")
        path = os.path.join(directory, f"{_safe(ctx.name)}.py")
    if not os.path.exists(path) or open(path).read() != source:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    name = f"cgtrees_kernels_{_safe(ctx.name)}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton looks kernels' globals up through their module
    if not isinstance(binaries, (dict, type(None))):
        log_once(log, f"records:{name}", "cgtrees codegen: %s: its stored binaries are not a mapping; its "
                 "kernels launch through Triton's JIT", ctx.name)
        binaries = {}
    if binaries is not None and not precompile_kernels and not ctx.config.interpret:
        from backend.codegen.binaries import exec_deferred

        exec_deferred(module, source, path, binaries, code)  # kernels with binaries are not decorated
    else:
        spec.loader.exec_module(module)
    ready = False  # every kernel compiled before the first call: no compile can fail in it
    if not ctx.config.interpret:
        kernels = source.count("\n@triton.jit\n")
        if precompile_kernels:
            ready = precompile(module, ctx.name) == kernels
        installed = _launch_from_binaries(module, binaries, ctx.name)
        ready = ready or installed == kernels
    if not facts.library_calls:  # a fresh module or a level-2 hit: its own list (a level-1 record keeps it)
        facts = dataclasses.replace(facts, library_calls=library_calls(getattr(module, "LIBRARY_CALLS", None)))
    return KernelModule(module, source, path, ctx.name, facts, dynamic, kernels_ready=ready)


def _launch_from_binaries(module: Any, records: dict[str, list[dict]] | None, name: str) -> int:
    """The number of kernels that launch from a compiled binary."""
    from backend.codegen import binaries

    try:
        n = binaries.install(module, binaries.capture(module) if records is None else records, name)
    except Exception as exc:  # noqa: BLE001  (the kernels launch through Triton's JIT)
        log_once(log, f"binaries:{name}", "cgtrees codegen: %s: its stored binaries could not be installed "
                 "(%s: %s); its kernels launch through Triton's JIT", name, type(exc).__name__, exc)
        return 0
    log.debug("cgtrees codegen: %s: %d kernels launch from their binaries", name, n)
    return n


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


# ------------------------------------------------------------------------------------ compile_graph
def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, ctx: GraphContext) -> KernelModule | AtenModule:
    """``load(generate(...))``; a graph that cannot be generated runs through aten (reason logged)."""
    try:
        source = generate(gm, example_inputs, ctx)
    except Exception as exc:  # noqa: BLE001
        counters.bump("graph_fallbacks")
        log_once(log, f"generate:{ctx.name}:{type(exc).__name__}", "cgtrees codegen: %s could not be generated "
                 "(%s: %s); it runs through aten", ctx.name, type(exc).__name__, exc)
        return AtenModule(gm)
    return load(source, ctx, path=debug_path(gm, ctx), facts=facts_of(gm),
                dynamic=has_symbolic_shapes(example_inputs))


def debug_path(gm: torch.fx.GraphModule | None, ctx: GraphContext) -> str | None:
    """Where ``CGTREES_DEBUG_DIR`` keeps this graph's module, named by its cache key's digest or
    else its graph's (None when it is not set, or there is neither); a module loaded from there is
    the one that runs, so tracebacks point at it."""
    if not ctx.config.debug_dir or (gm is None and not ctx.cache_key):
        return None
    os.makedirs(ctx.config.debug_dir, exist_ok=True)
    digest = ctx.cache_key or graph_hash(gm) or hashlib.sha256(gm.code.encode()).hexdigest()
    return os.path.join(ctx.config.debug_dir, f"{_safe(ctx.name)}_{digest[:12]}.py")

