"""codegen: lower one aten graph to a kernel module with ``call(args) -> outputs``.

    generate(gm, example_inputs, ctx) -> CompiledGraph   the module text (readable, runs on its own)
                                                         and what is known of it (``cgtrees.compiled``)
    load(graph, ctx, fresh=True) -> KernelModule         import it (from a file, so Triton can read
                                                         it); its kernels launch from compiled
                                                         binaries: compiled now (``fresh``) or the
                                                         graph's own (a cache hit)
    compile_graph(gm, example_inputs, ctx)               load(generate(...)); CGTREES_DEBUG_DIR keeps a copy
    prepare(example_inputs, config, remember_key_in, compiles)  start what the first kernel will
                                                         wait for (Triton's hash of itself, when it compiles)

The steps of ``generate``: lower the FX graph to IR (``graph``), group steps into kernels
(``scheduler``), write kernels and the ``call`` wrapper (``kernel``, ``wrapper``). CPU graphs
without the interpreter become a module of aten calls only (still cacheable as source). An op that
cannot be lowered becomes an aten call; a graph that cannot be generated raises, and the driver
runs it through aten (``aot.driver``, the one place such a failure is caught and counted); a kernel
that fails to compile switches its module to its aten path (``CompiledGraph.fallback``) with the
reason and the source path logged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.fx

from cgtrees import counters
from cgtrees.codegen.module import AtenModule, KernelModule, aten_launches
from cgtrees.codegen.precompile import precompile
from cgtrees.compiled import CompiledGraph, GraphFacts, has_symbolic_shapes
from cgtrees.config import Config
from cgtrees.context import GraphContext
from cgtrees.logs import log_once

if TYPE_CHECKING:
    from cgtrees.codegen.gemm_choice import GemmPlan

log = logging.getLogger("cgtrees.codegen")

__all__ = ["generate", "load", "compile_graph", "prepare", "KernelModule", "AtenModule", "debug_path"]


def prepare(example_inputs: list, config: Config, remember_key_in: Path | None = None, compiles: bool = True) -> None:
    """Called as a Dynamo graph arrives, before AOTAutograd (``compiles``: a level-1 miss) or before a
    warm load: a graph with CUDA inputs launches Triton kernels. A compiled kernel's first launch
    waits for Triton's hash of itself (remembered in ``remember_key_in``, a file of our cache, for
    later processes), started here in the background when the graph ``compiles``. A warm load's
    kernels launch stored binaries, which need no hash: it is only put where a kernel that goes
    through the JIT after all reads it back (no thread walking Triton's files beside Dynamo's guard
    building, whose GIL it would share)."""
    if config.interpret or not any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        return
    from cgtrees.codegen.compat import hash_triton_in_background, share_triton_key

    if compiles:
        hash_triton_in_background(remember_key_in)
    else:
        share_triton_key(remember_key_in)


# ----------------------------------------------------------------------------------------- generate
def generate(gm: torch.fx.GraphModule, example_inputs: list, ctx: GraphContext) -> CompiledGraph:
    """The kernel module for ``gm``: its source and what is known of it."""
    from cgtrees.codegen import device_scalars, wrapper

    _ensure_meta(gm, example_inputs)  # shapes/strides/dtypes of every node
    facts, dynamic = GraphFacts.of(gm), has_symbolic_shapes(example_inputs)
    scalars = device_scalars.moved(gm)  # CPU 0-d inputs of a CUDA graph, on the device
    header = _header(ctx)
    if not _uses_triton(gm, ctx):  # CPU without the interpreter: aten calls only, as eager makes them
        from cgtrees.codegen import eager_ops

        source = "\n".join([*header, "import math", "import operator", "", "import torch", "",
                            "aten = torch.ops.aten", "", "", *wrapper.aten_call(eager_ops.fold(gm), "call"), ""])
        return CompiledGraph(source, facts, ctx.graph_hash, launches=aten_launches(gm), device="cpu", dynamic=dynamic)
    from cgtrees.codegen import (
        float_gemms,
        gate_up_gemms,
        gemm_choice,
        grouped_attention,
        input_writes,
        merged_sums,
        patch_convs,
        rmsnorm_gemms,
        shared_input_gemms,
    )
    from cgtrees.codegen.graph import GraphLowerer
    from cgtrees.codegen.scheduler import schedule

    gm = merged_sums.rewritten(gm)  # a bias gradient's sum next to the kernel of what it sums
    gm = input_writes.placed(gm)  # a running statistic's update next to the kernel of the statistic
    gemms = gemm_choice.GemmPlan.of(gm, ctx.config.gemm_decisions)  # GEMM forms, timed on the device
    gm = _padded(gm, gemms)  # GEMMs of unaligned sizes padded where that was faster
    gm = patch_convs.rewritten(gm, gemms)  # a convolution over disjoint patches as one GEMM where faster
    gm = grouped_attention.rewritten(gm, gemms)  # SDPA on unexpanded grouped K/V where that was faster
    gm = gate_up_gemms.rewritten(gm, gemms, ctx.kind)  # silu(x @ gate) * (x @ up) in one launch where faster
    gm = shared_input_gemms.rewritten(gm, gemms)  # few-row GEMMs of one input in one launch where faster
    gm = rmsnorm_gemms.rewritten(gm, gemms, ctx.kind)  # add + RMSNorm + the one-row GEMVs reading it, one launch
    gm = float_gemms.rewritten(gm, gemms)  # a bf16 GEMM cast to float32 writes float32 itself where faster
    lowerer = GraphLowerer(gm, ctx.config, gemms)
    program = lowerer.run()  # aten nodes -> IR steps (fallbacks as aten calls)
    items = schedule(program)  # steps -> fused kernels, aten calls, views
    header = [*header, *lowerer.gemm.comment()]
    text = wrapper.module_source(header, program, items, ctx.config.interpret)  # the module's source
    counters.bump("kernels_generated", len(text.kernels))
    return CompiledGraph(text.source, facts, ctx.graph_hash, text.kernels, text.launches, text.precompile,
                         text.library_calls, program.device, dynamic, "\n".join(wrapper.aten_call(gm)),
                         gemm_choices=lowerer.gemm.lines(), device_scalars=scalars)


def _padded(gm: torch.fx.GraphModule, gemms: "GemmPlan") -> torch.fx.GraphModule:
    """``gm`` with the GEMMs ``gemms`` pads rewritten (``gemm_padding``); as it was, each choice
    noted as not taken, where the rewrite would change an output's layout."""
    from cgtrees.codegen import gemm_padding

    try:
        return gemm_padding.padded(gm, gemms.pads)
    except gemm_padding.NotPadded as exc:
        gemms.undo_pads(str(exc))
        return gm


def _header(ctx: GraphContext) -> list[str]:
    """The module's header: the digest of the canonical graph text (``cache.key.graph_text``, the
    text the cache key holds) and the digest of the key itself, the name of its cache entry."""
    import triton

    return [
        f"# cgtrees kernel module for {ctx.name} ({ctx.kind})",
        f"# graph hash: {ctx.graph_hash or 'none (the graph has no canonical text)'}",
        f"# cache key: {ctx.cache_key or 'none (not cached)'}",
        f"# versions: torch {torch.__version__}, triton {triton.__version__}",
    ]


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


# Checks on data-dependent sizes (MoE routing's ``.item()``: JetMoE), which return nothing: no meta value
_CHECKS = frozenset({torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range.default,
                     torch.ops.aten.sym_constrain_range_for_size.default})


def _ensure_meta(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    """Every node's meta value, propagated again from the inputs only where one is missing: a fresh
    fake mode cannot run a graph's ``.item()`` (``_local_scalar_dense``), so the checks on the
    unbacked sizes it makes, which have none, do not count as missing."""
    if all("val" in n.meta for n in gm.graph.nodes
           if n.op == "placeholder" or (n.op == "call_function" and n.target not in _CHECKS)):
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


# --------------------------------------------------------------------------------------------- load
_counter = itertools.count()


def load(graph: CompiledGraph, ctx: GraphContext, fresh: bool = True) -> KernelModule:
    """Import ``graph``'s source (written to the debug dir, or to a fresh temporary file: Triton
    reads kernels' source through their file) as a module whose kernels launch from compiled
    binaries, without Triton's JIT (``codegen.binaries``). A ``fresh`` module compiles its kernels
    together and launches what that compiled; a cache hit launches ``graph.binaries``, its kernels
    left undecorated until a launch needs the JIT (a kernel without a binary loads from Triton's
    on-disk cache), and runs ``graph.code`` (the compiled Python of its source) where it has it."""
    if ctx.config.interpret:
        # Triton decides interpreted or compiled when a kernel is decorated: set before importing.
        from cgtrees.codegen import interp

        interp.enable()
    path = _written(graph.source, debug_path(ctx, graph), ctx.name)
    name = f"cgtrees_kernels_{_safe(ctx.name)}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton looks kernels' globals up through their module
    from cgtrees.codegen import compat

    with compat.real_tensors():  # a tensor a module would make at import is real under a trace
        if not fresh and not ctx.config.interpret:
            from cgtrees.codegen.binaries import exec_deferred

            exec_deferred(module, graph.source, path, graph.binaries, graph.code)  # kernels with binaries undecorated
        else:
            spec.loader.exec_module(module)
    return KernelModule(graph, module, path, ctx.name, ctx.mutated_input_indices, _ready(module, graph, ctx, fresh))


def _ready(module: ModuleType, graph: CompiledGraph, ctx: GraphContext, fresh: bool) -> bool:
    """Whether every kernel is compiled before the first call (none can fail to compile in it):
    compiled together now, or launched from a binary."""
    if ctx.config.interpret:
        return False
    compiled = fresh and precompile(module, graph, ctx.name) == len(graph.kernels)
    installed = _launch_from_binaries(module, graph, None if fresh else graph.binaries, ctx.name)
    return compiled or installed == len(graph.kernels)


def _written(source: str, path: str | None, name: str) -> str:
    if path is None:
        directory = tempfile.mkdtemp(prefix="cgtrees_kernels_")
        path = os.path.join(directory, f"{_safe(name)}.py")
    if not os.path.exists(path) or open(path).read() != source:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    return path


def _launch_from_binaries(module: ModuleType, graph: CompiledGraph, records: dict[str, list[dict]] | None,
                          name: str) -> int:
    """The number of kernels that launch from a compiled binary (``records``: the graph's stored
    ones; None: those its kernels compiled in this process)."""
    from cgtrees.codegen import binaries

    try:
        if records is None:
            records = binaries.capture(module, graph.kernels)
        n = binaries.install(module, records, name)
    except Exception as exc:  # noqa: BLE001  (the kernels launch through Triton's JIT)
        log_once(log, f"binaries:{name}", "cgtrees codegen: %s: its stored binaries could not be installed "
                 "(%s: %s); its kernels launch through Triton's JIT", name, type(exc).__name__, exc)
        return 0
    log.debug("cgtrees codegen: %s: %d kernels launch from their binaries", name, n)
    return n


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


# ------------------------------------------------------------------------------------ compile_graph
def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, ctx: GraphContext) -> KernelModule:
    """``load(generate(...))``. A graph that cannot be generated raises: the caller decides (the
    driver runs it through aten, counted once)."""
    return load(generate(gm, example_inputs, ctx), ctx)


def debug_path(ctx: GraphContext, graph: CompiledGraph) -> str | None:
    """Where ``CGTREES_DEBUG_DIR`` keeps this module, named by its cache key's digest or else its
    graph's or its source's (None when it is not set); a module loaded from there is the one that
    runs, so tracebacks point at it. A module read from the cache is written there as well."""
    if not ctx.config.debug_dir:
        return None
    os.makedirs(ctx.config.debug_dir, exist_ok=True)
    digest = ctx.cache_key or graph.graph_hash or hashlib.sha256(graph.source.encode()).hexdigest()
    return os.path.join(ctx.config.debug_dir, f"{_safe(ctx.name)}_{digest[:12]}.py")
