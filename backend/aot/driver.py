"""aot: drive torch's AOTAutograd over a Dynamo graph and compile each aten graph it hands us.

    Dynamo graph --cache level 1 (a hit skips the rest)
                 --AOTAutograd (functionalize, decompose, joint trace, OUR partition)--> aten graphs
    aten graph   --key --look up (level 2) --codegen --store --record (level 1)--> kernel module
                 --runtime.wrap_module--> callable

The cache sits beside the pipeline: it looks up and stores, and the steps are listed here. A
failure in codegen or the runtime never reaches the user: that aten graph runs directly, and the
reason is logged once and counted (``graph_fallbacks``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import torch
import torch.fx

from backend import cache, codegen, counters, runtime
from backend.aot import compat, constants, layout
from backend.cache.backward_graph import SAVED_STATIC
from backend.config import Config
from backend.context import SAVED_FROM, GraphContext
from backend.logs import log, log_once
from backend.runtime.examples import Examples


class FunctionPair:
    """Shared by the forward and backward of one Dynamo graph (the runtime keeps state on it)."""

    def __init__(self, name: str, num_inputs: int) -> None:
        self.name = name
        self.num_inputs = num_inputs  # the Dynamo graph's
        # An inference graph in our own runtime wrapper, where AOTAutograd's wrappers would add
        # nothing (``_lean_inference``): it replaces AOTAutograd's function, ~20 us a call less.
        self.lean: Callable[..., Any] | None = None
        # A training graph's compiled forward, for the wrapper a level-1 hit would build
        # (``cache.aot.lean_training``), which then replaces AOTAutograd's function as well.
        self.forward_call: Callable[[list[Any]], Any] | None = None
        # The tree manager the forward ran under, for its backward (the runtime's: ``function._tree``).
        self.cgtrees_manager: Any = None
        # Collects the aten graphs for the level-1 entry on a miss (``cache.aot.Recorder``).
        self.cache_recorder: Any = None


def compile_dynamo_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config,
                         graph_id: int, backward: bool = False) -> Callable[..., Any]:
    """One Dynamo graph. ``backward``: a compiled-autograd graph traced with grad mode off
    (``aot.compiled_autograd``): AOTAutograd makes it one inference graph, which the runtime runs
    as a backward."""
    name = f"g{graph_id}"
    pair = FunctionPair(name, len(example_inputs))
    key_file = cache.triton_key_file(config)
    codegen.prepare(example_inputs, config, key_file, compiles=False)  # a hit's kernels are compiled
    cached = cache.load_aot(gm, example_inputs, config, name, pair, _wrap, backward)  # level 1: a hit skips AOT
    if cached is not None:
        return cached
    codegen.prepare(example_inputs, config, key_file)  # start what compiled kernels wait for
    from backend import distributed
    from backend.aot.decompositions import decomposition_table  # a warm start never needs these
    from backend.aot.partition import partition

    if backward:  # traced with grad mode off: AOTAutograd makes no training graph of it
        fw_compiler = bw_compiler = _not_training
    else:
        fw_compiler = _aten_compiler("forward", name, pair, config)
        bw_compiler = backward_compiler(name, pair, config)
    ddp_piece = distributed.before_aot(name)  # counted for DDPOptimizer, which splits graphs under DDP
    compiled = compat.aot_module_simplified(
        gm, example_inputs,
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        inference_compiler=_aten_compiler("inference", name, pair, config, "backward" if backward else None),
        # channels-last: layout.py; the backward graph is kept for level 1 (compiled autograd inlines it)
        partition_fn=cache.aot.recorded_partition(pair, functools.partial(partition, layout_opt=config.layout_opt)),
        decompositions=decomposition_table(),
        keep_inference_input_mutations=True,
    )
    cache.aot.finish(pair)  # level 1: a training graph's entry, its backward compiled or not
    if ddp_piece:  # a piece's first call is fake (distributed.py)
        return compiled
    return pair.lean or cache.aot.lean_training(pair) or compiled


def backward_compiler(name: str, pair: FunctionPair, config: Config) -> Callable[..., Any]:
    """The compiler of a Dynamo graph's backward (also for one a level-1 entry kept uncompiled)."""
    return _aten_compiler("backward", name, pair, config)


def _aten_compiler(aot_kind: str, name: str, pair: FunctionPair, config: Config,
                   kind: str | None = None) -> Callable[..., Any]:
    """The compiler of AOTAutograd's ``aot_kind`` graphs, which the runtime runs as ``kind`` (by
    default the same; a compiled-autograd graph's inference graph runs as a backward)."""
    versions = itertools.count()
    kind = kind or aot_kind

    def compile_aten(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[[list[Any]], Any]:
        n = next(versions)  # a graph recompiled for new shapes gets a new name
        static = _static_inputs(aot_kind, gm)
        consts = constants.lift(gm)  # get_attr tensors -> trailing inputs, appended to every call
        if kind == "inference":  # training graphs: in the partitioner, on the joint graph
            layout.optimize(gm, config.layout_opt, inference=True)
        ctx = GraphContext(
            config=config, kind=kind, name=f"{name}_{kind}" + (f"_{n}" if n else ""),
            static_input_indices=static + consts.indices(len(example_inputs)),
            mutated_input_indices=mutated_inputs(gm), pair=pair, constants=consts,
            saved_from=gm.meta.get(SAVED_FROM) if aot_kind == "forward" else None,
        )
        call = compat.boxed(compile_aten_graph(gm, [*example_inputs, *consts.tensors], ctx))
        if kind == "inference":
            pair.lean = _lean_inference(call, len(example_inputs), pair)
        elif aot_kind == "forward":
            pair.forward_call = call
        return call

    return compile_aten


def _lean_inference(call: Callable[[list[Any]], Any], num_inputs: int,
                    pair: FunctionPair) -> Callable[..., Any] | None:
    """Our wrapper for an inference graph, where it does what AOTAutograd's would (the level-1
    cache's rule: no aliased or metadata-mutated outputs, no subclasses, inputs not merged);
    None where AOTAutograd's wrappers are needed."""
    from backend.cache import compat as plans
    from backend.cache import wrappers

    if num_inputs != pair.num_inputs:
        return None  # AOTAutograd deduplicated or merged inputs
    try:
        plan = plans.runtime_plan(plans.fw_metadata(), "inference")
    except plans.Uncacheable as exc:
        log.debug("cgtrees: %s: AOTAutograd's runtime wrappers kept (%s)", pair.name, exc)
        return None
    return wrappers.inference_function(call, plan)


def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: list[Any],
                       ctx: GraphContext) -> Callable[[list[Any]], Any]:
    """One aten graph: its kernel module, recorded for level 1, wrapped in the runtime."""
    module, level_2 = kernel_module(gm, example_inputs, ctx)  # key, look up, codegen, store
    cache.record_module(gm, example_inputs, ctx, module, wrapped=True, level_2=level_2)  # for level 1's entry
    return _wrap(module, Examples.of(example_inputs, ctx.mutated_input_indices, ctx.static_input_indices), ctx)


def kernel_module(gm: torch.fx.GraphModule, example_inputs: list[Any], ctx: GraphContext) -> tuple[Any, str | None]:
    """The graph's kernel module, and the digest of the level-2 entry that holds it (None: none does)."""
    key = cache.module_key(gm, example_inputs, ctx)  # None: cache off, or not keyable (a counted bypass)
    ctx = dataclasses.replace(ctx, cache_key=key.digest if key else None)  # shown in the module's header
    module = cache.lookup_module(key, gm, example_inputs, ctx)  # level 2: a hit skips codegen
    if module is not None:
        return module, key.digest
    module = _generate(gm, example_inputs, ctx)  # codegen; the aten graph itself if that fails
    stored = cache.store_module(key, module, ctx)  # a generated module, for later processes
    return module, key.digest if key and stored else None


def _generate(gm: torch.fx.GraphModule, example_inputs: list[Any], ctx: GraphContext) -> Any:
    codegen.prepare(example_inputs, ctx.config, cache.triton_key_file(ctx.config))  # a warm load's lazy backward too
    try:
        return codegen.compile_graph(gm, example_inputs, ctx)
    except Exception as exc:  # noqa: BLE001
        _explain(ctx, "codegen", exc)
        return codegen.AtenModule(gm)  # the aten graph still gets CUDA graphs


_wrap = runtime.wrap_module  # the module in the runtime, its constants appended (level-1 hits use it too)


def _not_training(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    raise RuntimeError("cgtrees: a compiled-autograd graph traced with grad mode off became a training graph")


def _explain(ctx: GraphContext, stage: str, exc: Exception) -> None:
    counters.bump("graph_fallbacks")
    log_once(log, f"fallback:{ctx.name}:{stage}",
             "cgtrees: %s: %s failed (%s: %s); this graph runs through aten", ctx.name, stage,
             type(exc).__name__, exc)


def _static_inputs(kind: str, gm: torch.fx.GraphModule) -> tuple[int, ...]:
    if kind != "backward":
        return compat.forward_static_input_indices()
    saved_static = set(gm.meta.get(SAVED_STATIC, ()))
    return tuple(i for i, n in enumerate(gm.graph.find_nodes(op="placeholder")) if n.name in saved_static)


def mutated_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Inputs the graph writes to: the targets of in-place ops on placeholders (``aten.copy_``)."""
    index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    out = set()
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            for arg, schema_arg in zip(node.args, target._schema.arguments):
                if schema_arg.alias_info is not None and schema_arg.alias_info.is_write and arg in index:
                    out.add(index[arg])
    return tuple(sorted(out))
