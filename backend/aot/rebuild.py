"""Turn a ``CompiledFunction`` (the level-1 value) into the callable: one ``rebuild`` for a cache
hit and a loaded precompiled function, and (``lean_training``) a cold process's training graph, so
that every process runs the same wrappers.

The cache only stores and loads the value (``cache.aot``); here each part's module (``load_module``:
a kernel module, read in from level 2 by the cache, or an aten graph's FX code) is wrapped in the
runtime by the driver's ``wrap``, which shares one tree between a forward and its backward, and our
own wrapper (``wrappers``) goes around them. A function that keeps its backward graph uncompiled
(the process that made it ran the backward under compiled autograd, or had not run it yet) gets a
``LazyBackward``, compiled at its first call by the driver's backward compiler, as AOTAutograd
compiles a backward.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx

from cgtrees import codegen
from cgtrees.aot import backward_graph, compat, fx_code, records, wrappers
from cgtrees.cache.store import CorruptEntry
from cgtrees.codegen import compat as codegen_compat
from cgtrees.compiled import CompiledGraph, CompiledModule
from cgtrees.compiled_function import AtenCode, BackwardGraph, CompiledFunction, CompiledPart, RuntimePlan
from cgtrees.config import Config
from cgtrees.context import GraphContext
from cgtrees.runtime import first_calls
from cgtrees.runtime.examples import Examples

if TYPE_CHECKING:
    from cgtrees.aot.recorder import Recorder

Wrap = Callable[[CompiledModule, Examples, GraphContext], Callable[[list[Any]], Any]]
# The driver's backward compiler: (graph, example inputs, its static inputs by name) -> call
CompileBackward = Callable[[torch.fx.GraphModule, list[Any], tuple[str, ...]], Callable[[list[Any]], Any]]


def rebuild(function: CompiledFunction, config: Config, name: str, wrap: Wrap,
            compile_backward: CompileBackward) -> Callable[..., Any]:
    """The callable of a self-contained function (``cache.aot.resolve``'s): each module wrapped by
    ``wrap``; a backward the function keeps uncompiled compiled by ``compile_backward`` at its first call."""
    plan = function.plan
    start_first_calls(function, config)
    calls = {part.kind: _load_part(part, config, wrap, name) for part in function.parts}
    if set(calls) == {"inference"}:
        return wrappers.inference_function(calls["inference"], plan)
    graph = function.backward_graph
    if set(calls) == {"forward"} and graph is not None:  # the backward was never compiled: compile it lazily
        calls["backward"] = LazyBackward(graph, compile_backward)
    if set(calls) == {"forward", "backward"}:
        return wrappers.training_function(calls["forward"], calls["backward"], plan, function.detach,
                                          _aot_attributes(graph, function.aot_metadata, plan))
    raise CorruptEntry(f"entry holds graphs {sorted(calls)}")


def start_first_calls(function: CompiledFunction, config: Config) -> None:
    """The function's library calls and Triton's driver, made in a thread beside the load
    (``runtime.first_calls``; each once per process: precompile starts them as it reads its file)."""
    if not config.warm_first_calls:
        return
    calls: dict[bool, list[str]] = {False: [], True: []}  # by whether the module runs as a backward
    binaries = False
    for part in function.parts:
        graph = part.module
        if not isinstance(graph, CompiledGraph):
            continue
        calls[part.runs_as == "backward"] += graph.library_calls
        binaries = binaries or bool(graph.binaries)
    driver = codegen_compat.triton_driver if binaries and not config.interpret else None
    first_calls.start(calls[False], calls[True], driver)


def _aot_attributes(graph: BackwardGraph | None, meta: str | None, plan: RuntimePlan) -> dict[str, Any] | None:
    """What compiled autograd needs to inline the function's backward graph (``backward_graph``)."""
    if graph is None or meta is None or plan.num_saved_no_vc_check:
        return None  # compiled autograd traces our Function's backward instead
    return compat.aot_backward_attributes(meta, lambda: backward_graph.graph_module(graph)[0])


class LazyBackward:
    """The backward of an entry that keeps only its graph (the process that wrote it ran the
    backward under compiled autograd): compiled at its first call, as AOTAutograd compiles a
    backward, by the driver's backward compiler (its kernel module from level 2 when one is there).
    ``graph``: the function's record of it, or, on a miss, AOTAutograd's GraphModule itself with its
    static inputs by name (``static_saved``)."""

    def __init__(self, graph: BackwardGraph | torch.fx.GraphModule, compile_backward: CompileBackward,
                 static_saved: tuple[str, ...] = ()) -> None:
        self.graph, self.compile_backward, self.static_saved = graph, compile_backward, static_saved
        self.call: Callable[[list[Any]], Any] | None = None

    def __call__(self, args: list[Any]) -> Any:
        if self.call is None:
            self.call = self._compile()
        return self.call(args)

    def _compile(self) -> Callable[[list[Any]], Any]:
        # As AOTAutograd compiles a backward: grad mode and autocast off (the graph holds its casts)
        with torch.no_grad(), compat.no_autocast(True):
            if isinstance(self.graph, torch.fx.GraphModule):  # a copy, as AOTAutograd compiles one
                gm, inputs = backward_graph.copy_with_inputs(self.graph)
                static_saved = self.static_saved
            else:
                gm, static_saved = backward_graph.graph_module(self.graph)
                inputs = backward_graph.example_inputs(gm, self.graph)
            call = self.compile_backward(gm, inputs, static_saved)  # the compiler AOTAutograd would call
        self.graph = None  # compiled: not needed again (kept until then, so a failed compile can retry)
        return call


def _load_part(part: CompiledPart, config: Config, wrap: Wrap, name: str) -> Callable[[list[Any]], Any]:
    consts = records.load_constants(part.constants)
    # The function's names are those of the process that made it ("g3_forward"): this process
    # names its graphs itself, so two functions never share a name in the runtime.
    _, sep, suffix = part.name.partition("_")
    ctx = GraphContext(config=config, kind=part.runs_as, name=f"{name}_{suffix}" if sep else name,
                       static_input_indices=part.static_inputs, mutated_input_indices=part.mutated_inputs,
                       constants=consts, saved_from=part.saved_from)
    return wrap(load_module(part, ctx), records.examples(part.inputs), ctx)  # no fake tensors: they cost ms


def load_module(part: CompiledPart, ctx: GraphContext) -> CompiledModule:
    """The part's module; one read from level 2 keeps its digest, which names its copy in
    ``CGTREES_DEBUG_DIR``."""
    module = part.module
    if isinstance(module, AtenCode):
        return fx_code.load(module.source, ctx.name, module.graph())
    if not isinstance(module, CompiledGraph):
        raise CorruptEntry(f"{part.name}'s module was not read in from level 2")
    if part.level_2:
        ctx = dataclasses.replace(ctx, cache_key=part.level_2)
    return codegen.load(module, ctx, fresh=False)


def lean_training(recorder: Recorder, forward_call: Callable[[list[Any]], Any],
                  compile_backward: CompileBackward) -> Callable[..., Any] | None:
    """On a miss, the function a hit on the entry just written would give: our wrapper around this
    process's compiled forward and its backward (compiled at the first ``backward()`` by the
    driver's backward compiler, as AOTAutograd would). It replaces AOTAutograd's, so that a cold
    process's calls cost what a warm one's do (AOTAutograd's runtime wrappers: about 750 Python
    calls a mobilenet_v3_small training step). None where AOTAutograd's function stays: a graph
    level 1 does not take, or what compiled autograd needs of the entry is missing."""
    if recorder.bypass is not None or recorder.plan is None:
        return None
    if "forward" not in recorder.parts or "backward" in recorder.parts or recorder.bw_graph is None:
        return None  # not a training graph, or its backward compiled already (not AOTAutograd's lazy way)
    attributes = _aot_attributes(recorder.backward_graph, recorder.aot_metadata, recorder.plan)
    if attributes is None:
        return None  # compiled autograd would trace our backward instead of AOTAutograd's graph
    backward = LazyBackward(recorder.bw_graph, compile_backward, recorder.static_saved)
    return wrappers.training_function(forward_call, backward, recorder.plan, recorder.detach, attributes)
