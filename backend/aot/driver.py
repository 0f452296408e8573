"""aot: drive torch's AOTAutograd over a Dynamo graph and compile each aten graph it hands us.

    Dynamo graph --cache level 1 (a hit skips the rest: ``aot.rebuild`` makes its CompiledFunction the callable)
                 --AOTAutograd (functionalize, decompose, joint trace, OUR partition)--> aten graphs
    aten graph   --key --look up (level 2) --codegen --store --record (level 1)--> kernel module
                 --runtime.wrap_module--> callable
                 --buckets.wrap--> inference graphs with a symbolic batch, option batch_buckets:
                                   padded to the next bucket each call (``aot/buckets.py``)

The cache sits beside the pipeline: it looks up and stores, and the steps are listed here. What
the compilers of one Dynamo graph share (our partition's cut, level 1's recorder, the runtime's
``SharedTree``) is held by its ``Compilers``, never by the graphs or the context. A failure in
codegen or the runtime never reaches the user: that aten graph runs directly, and the reason is
logged once and counted (``graph_fallbacks``) here, where it is caught.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx

from cgtrees import cache, codegen, counters, runtime
from cgtrees.aot import buckets, compat, constants, cse, distributed, layout
from cgtrees.aot.rebuild import lean_training, rebuild
from cgtrees.aot.recorder import Recorder
from cgtrees.cache.aot import NO_HINTS, Level1Hints
from cgtrees.compiled import CompiledModule, has_symbolic_shapes
from cgtrees.compiled_function import CompiledFunction
from cgtrees.config import Config
from cgtrees.context import GraphContext, GraphKind
from cgtrees.logs import log, log_once
from cgtrees.runtime.examples import Examples

if TYPE_CHECKING:  # imported where a graph is partitioned, which a warm start never is (~7 ms)
    from cgtrees.aot.partition import Split


class Compilers:
    """The compilers of one Dynamo graph's aten graphs, which AOTAutograd calls (and a level-1
    entry's lazy backward), and what they share: the runtime's ``SharedTree`` (the forward's tree
    manager, for its backward), our partition's ``Split``, level 1's ``Recorder`` (on a miss), and
    the functions that may replace AOTAutograd's (``lean``, ``forward_call``)."""

    def __init__(self, name: str, config: Config, num_inputs: int,
                 shared: runtime.SharedTree | None = None, store: cache.Store | None = None) -> None:
        self.name = name
        self.config = config
        self.store = store  # the cache, opened once for the graph (None: off or unusable)
        self.key_file = cache.triton_key_file(store)  # where codegen keeps Triton's hash of itself
        self.num_inputs = num_inputs  # the Dynamo graph's
        self.shared = shared or runtime.SharedTree()  # given: a loaded function's forward's
        self.split: Split | None = None
        self.recorder: Recorder | None = None
        # An inference graph in our own runtime wrapper, where AOTAutograd's wrappers would add
        # nothing (``_lean_inference``): it replaces AOTAutograd's function, ~20 us a call less.
        self.lean: Callable[..., Any] | None = None
        # A training graph's compiled forward, for the wrapper a level-1 hit would build
        # (``aot.rebuild.lean_training``), which then replaces AOTAutograd's function as well.
        self.forward_call: Callable[[list[Any]], Any] | None = None
        self._versions = {kind: itertools.count() for kind in ("forward", "backward", "inference")}
        # Whether autocast is on for the graph: read now, AOTAutograd turns it off before it calls a compiler.
        self.autocast = compat.autocast_enabled()

    def wrap(self, module: CompiledModule, examples: Examples, ctx: GraphContext) -> Callable[[list[Any]], Any]:
        """The module in the runtime, sharing this graph's tree (level-1 hits use it too)."""
        return runtime.wrap_module(module, examples, ctx, self.shared)

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Any,
                  **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """AOTAutograd's ``partition_fn``: our cut, kept for the two compilers and for level 1 (the
        backward graph: AOTAutograd compiles it lazily, compiled autograd never has it compiled)."""
        from cgtrees.aot import partition as partitioner  # a miss's only: see the import of Split

        self.split = partitioner.split(joint, joint_inputs, layout_opt=self.config.layout_opt, **kwargs)
        if self.recorder is not None:
            self.recorder.keep_backward_graph(self.split.backward, self.split.static_saved)
        return self.split.forward, self.split.backward

    def forward(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[[list[Any]], Any]:
        if self.config.batch_buckets and has_symbolic_shapes(example_inputs):
            buckets.note_training(f"{self.name}_forward")  # buckets are for inference graphs
        saved_from = self.split.saved_from if self.split is not None else None
        self.forward_call = self._compile(gm, example_inputs, "forward", "forward",
                                          compat.forward_static_input_indices(), saved_from)
        return self.forward_call

    def backward(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                 static_saved: tuple[str, ...] | None = None) -> Callable[[list[Any]], Any]:
        """A backward; ``static_saved``: its static inputs by name (a level-1 entry's), else our cut's."""
        if static_saved is None:
            static_saved = self.split.static_saved if self.split is not None else ()
        names = set(static_saved)
        static = tuple(i for i, n in enumerate(gm.graph.find_nodes(op="placeholder")) if n.name in names)
        return self._compile(gm, example_inputs, "backward", "backward", static)

    def inference(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                  runs_as: GraphKind = "inference") -> Callable[[list[Any]], Any]:
        """An inference graph, which the runtime runs as ``runs_as``: a compiled-autograd graph's is
        a backward, which keeps its layout and AOTAutograd's wrappers."""
        if runs_as == "inference":  # training graphs: in the partition
            layout.optimize(gm, self.config.layout_opt, inference=True)
        if cse.eliminate(gm.graph):  # one node per value computed twice (training graphs: in the partition)
            gm.recompile()
        name, static = f"{self.name}_inference", compat.forward_static_input_indices()
        plan = buckets.plan(gm, self.config.batch_buckets, name, static) if runs_as == "inference" else None
        call = self._compile(gm, example_inputs, "inference", runs_as, static)
        if plan is not None:  # a padded batch: one CUDA graph per bucket
            call = buckets.wrap(call, plan, buckets.shape_env_of(gm), name)
        if runs_as == "inference":
            self.lean = _lean_inference(call, len(example_inputs), self)
        return call

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any], aot_kind: str, kind: GraphKind,
                 static: tuple[int, ...], saved_from: int | None = None) -> Callable[[list[Any]], Any]:
        n = next(self._versions[aot_kind])  # a graph recompiled for new shapes gets a new name
        consts = constants.lift(gm)  # get_attr tensors -> trailing inputs, appended to every call
        ctx = GraphContext(
            config=self.config, kind=kind, name=f"{self.name}_{kind}" + (f"_{n}" if n else ""),
            static_input_indices=static + consts.indices(len(example_inputs)),
            mutated_input_indices=mutated_inputs(gm), constants=consts, saved_from=saved_from,
        )
        return compat.boxed(self.compile_aten_graph(gm, [*example_inputs, *consts.tensors], ctx))

    def compile_aten_graph(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                           ctx: GraphContext) -> Callable[[list[Any]], Any]:
        """One aten graph: its kernel module, recorded for level 1, wrapped in the runtime."""
        # key, look up, codegen, store
        module, level_2 = kernel_module(gm, example_inputs, ctx, self.store, self.key_file)
        if self.recorder is not None:  # for level 1's entry
            self.recorder.add(gm, example_inputs, ctx, module, level_2=level_2)
        return self.wrap(module, Examples.of(example_inputs, ctx.mutated_input_indices, ctx.static_input_indices), ctx)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the driver made of a Dynamo graph: the callable, and its level-1 value (a hit's, or the
    one this compile built; None where there is none) or the reason the graph bypasses level 1."""

    call: Callable[..., Any]
    function: CompiledFunction | None = None
    bypass: str | None = None


def compile_dynamo_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config,
                         graph_id: int, backward: bool = False,
                         hints: Level1Hints = NO_HINTS) -> Compiled:
    """One Dynamo graph. ``backward``: a compiled-autograd graph traced with grad mode off
    (``aot.compiled_autograd``): AOTAutograd makes it one inference graph, which the runtime runs
    as a backward. ``hints``: what the caller knows of the graph for level 1 (whether precompile
    keeps the function, compiled autograd's names or its reason to bypass)."""
    store = cache.open_store(config)  # once for the graph (None: cache off or unusable)
    compilers = Compilers(f"g{graph_id}", config, len(example_inputs), store=store)
    ddp_piece = distributed.is_piece(compilers.name)  # counted: DDPOptimizer splits graphs under DDP
    codegen.prepare(example_inputs, config, compilers.key_file, compiles=False)  # a hit's kernels are compiled
    found = cache.load_aot(gm, example_inputs, config, compilers.name, hints, backward, store)  # level 1
    slot = found.slot  # on a miss: where the recorder writes the entry
    if found.hit is not None:  # a hit skips AOT (a piece's too: DDPOptimizer runs it on its fake inputs)
        try:
            call = rebuild(found.hit.function, config, compilers.name, compilers.wrap, compilers.backward)
            found.hit.accept()  # counted; Dynamo guards the frame on the entry's size guards
            return Compiled(call, found.hit.function)
        except Exception as exc:  # noqa: BLE001 - a bad entry is recompiled, never fatal
            slot = found.hit.reject(exc)
    if slot is not None:
        compilers.recorder = Recorder(slot, config, len(example_inputs), backward, keep=hints.keep)
    try:
        call = _compile_missed(gm, example_inputs, config, compilers, backward, ddp_piece)
    finally:
        if compilers.recorder is not None:
            compilers.recorder.release()  # a cluster's processes waiting for this entry stop waiting
    recorder = compilers.recorder
    if recorder is None:
        return Compiled(call, bypass=found.bypass)
    return Compiled(call, recorder.function, recorder.bypass)


def _compile_missed(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config, compilers: Compilers,
                    backward: bool, ddp_piece: bool) -> Callable[..., Any]:
    """A level-1 miss: AOTAutograd with our compilers, and the entry recorded."""
    codegen.prepare(example_inputs, config, compilers.key_file)  # start what compiled kernels wait for
    from cgtrees.aot import attention_mask, decompositions  # a warm start never needs them

    attention_mask.take_out_row_masks(gm)  # a mask constant along the keys: fused attention may run
    attention_mask.take_out_causal_masks(gm)  # a constant causal mask: is_causal, the faster kernels

    if backward:  # traced with grad mode off: AOTAutograd makes no training graph of it
        fw_compiler = bw_compiler = _not_training
        inference_compiler = functools.partial(compilers.inference, runs_as="backward")
    else:
        fw_compiler, bw_compiler, inference_compiler = compilers.forward, compilers.backward, compilers.inference
    distributed.before_aot()  # DDPOptimizer's sign that AOTAutograd compiled a piece
    compiled = compat.aot_module_simplified(
        gm, example_inputs,
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        inference_compiler=inference_compiler,
        partition_fn=compilers.partition,  # channels-last (layout.py), then our cut
        decompositions=decompositions.for_inputs(example_inputs, config.interpret),  # none: aten graph on CPU
        keep_inference_input_mutations=True,
    )
    if compilers.recorder is not None:
        compilers.recorder.finish()  # level 1: a training graph's entry, its backward compiled or not
    if ddp_piece:  # a piece's first call is fake (distributed.py)
        return compiled
    lean = compilers.lean
    if lean is None and compilers.recorder is not None and compilers.forward_call is not None:
        lean = lean_training(compilers.recorder, compilers.forward_call, compilers.backward)
    return lean or compiled


def compile_backward(name: str, config: Config, shared: runtime.SharedTree, gm: torch.fx.GraphModule,
                     example_inputs: list[Any], static_saved: tuple[str, ...]) -> Callable[[list[Any]], Any]:
    """The backward a loaded precompiled function keeps uncompiled, compiled at its first call as
    AOTAutograd would (its kernel module from level 2 when one is there), in the forward's tree."""
    compilers = Compilers(name, config, len(example_inputs), shared, cache.open_store(config))
    return compilers.backward(gm, example_inputs, static_saved)


def _lean_inference(call: Callable[[list[Any]], Any], num_inputs: int,
                    compilers: Compilers) -> Callable[..., Any] | None:
    """Our wrapper for an inference graph, where it does what AOTAutograd's would (the level-1
    cache's rule: no aliased or metadata-mutated outputs, no subclasses, inputs not merged);
    None where AOTAutograd's wrappers are needed."""
    from cgtrees.aot import wrappers

    if num_inputs != compilers.num_inputs:
        return None  # AOTAutograd deduplicated or merged inputs
    try:
        plan = compat.runtime_plan(compat.fw_metadata(), "inference", compilers.autocast)
    except compat.Uncacheable as exc:
        log.debug("cgtrees: %s: AOTAutograd's runtime wrappers kept (%s)", compilers.name, exc)
        return None
    return wrappers.inference_function(call, plan)


def kernel_module(gm: torch.fx.GraphModule, example_inputs: list[Any], ctx: GraphContext,
                  store: cache.Store | None | EllipsisType = ...,
                  key_file: Path | None = None) -> tuple[CompiledModule, str | None]:
    """The graph's kernel module, and the digest of the level-2 entry that holds it (None: none does).
    ``store``: the cache the Dynamo graph's compile opened; a call on its own (``...``) opens it."""
    if store is ...:
        store = cache.open_store(ctx.config)
        key_file = cache.triton_key_file(store)
    key = cache.module_key(gm, example_inputs, ctx, store)  # None: cache off, or not keyable (a counted bypass)
    ctx = dataclasses.replace(ctx, cache_key=key.digest if key else None)  # shown in the module's header
    module = cache.lookup_module(key, gm, example_inputs, ctx)  # level 2: a hit skips codegen
    if module is not None:
        return module, key.digest
    ctx = dataclasses.replace(ctx, graph_hash=cache.graph_hash(gm, key))  # shown in the header too
    module = _generate(gm, example_inputs, ctx, store, key_file)  # codegen; the aten graph itself if that fails
    stored = cache.store_module(key, module, ctx)  # a generated module, for later processes
    return module, key.digest if key and stored else None


def _generate(gm: torch.fx.GraphModule, example_inputs: list[Any], ctx: GraphContext,
              store: cache.Store | None, key_file: Path | None) -> CompiledModule:
    codegen.prepare(example_inputs, ctx.config, key_file)  # a warm load's lazy backward too
    try:
        with cache.triton_cache_dir(store):  # Triton's own cache beside ours, for this compile only
            return codegen.compile_graph(gm, example_inputs, ctx)
    except Exception as exc:  # noqa: BLE001 - caught and counted here only
        counters.bump("graph_fallbacks")
        log_once(log, f"fallback:{ctx.name}:codegen", "cgtrees: %s: codegen failed (%s: %s); this graph runs "
                 "through aten", ctx.name, type(exc).__name__, exc)
        return codegen.AtenModule(gm)  # the aten graph still gets CUDA graphs


def _not_training(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    raise RuntimeError("cgtrees: a compiled-autograd graph traced with grad mode off became a training graph")


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
