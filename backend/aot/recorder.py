"""Level 1 on a miss: the driver builds the Dynamo graph's ``CompiledFunction`` as AOTAutograd
hands it the aten graphs, and the cache writes it (``cache.aot.Slot``: the cache calls nothing back).

An inference graph's function is complete once it is compiled (a symbolic one's once AOTAutograd
has returned: its guards are all in then). A training graph's is written when AOTAutograd returns
(``finish``), with AOTAutograd's backward graph and metadata (``BackwardGraph``, which compiled
autograd reads off the forward's Function instead of a compiled backward), whether or not the
backward is compiled by then; a backward compiled later (lazily, at the first plain
``backward()``) replaces that entry by one that holds it too. Under compiled autograd the backward
is never compiled here: the first entry is the only one. A graph found uncacheable leaves a bypass
marker (``Slot.bypass``), so later processes count a bypass with the reason instead of a miss.

The stored entry refers to the kernel modules level 2 holds; with ``keep`` (precompile will save
the function) each part holds its module itself, so that the saved file needs no cache.
``function`` is the latest complete value, ``bypass`` the reason there is none.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.fx

from cgtrees import codegen
from cgtrees.aot import backward_graph, compat, records
from cgtrees.aot.compat import Uncacheable
from cgtrees.aot.fx_code import fx_code
from cgtrees.cache.aot import Slot
from cgtrees.cache.modules import kept_graph
from cgtrees.compiled import CompiledModule
from cgtrees.compiled_function import (
    AtenCode,
    BackwardGraph,
    CompiledFunction,
    CompiledPart,
    Level2Ref,
    Module,
    Origin,
    RuntimePlan,
)
from cgtrees.config import Config
from cgtrees.context import GraphContext
from cgtrees.logs import log_once

log = logging.getLogger("cgtrees.cache")


class Recorder:
    """Collects one Dynamo graph's aten graphs into its ``CompiledFunction`` and has ``slot`` write it."""

    def __init__(self, slot: Slot, config: Config, num_inputs: int, backward: bool = False,
                 keep: bool = False) -> None:
        self.slot, self.config, self.num_inputs = slot, config, num_inputs
        self.backward, self.keep = backward, keep  # keep: each part holds its module (precompile's file)
        key = slot.key
        self.origin = Origin(key.torch_version, key.triton_version, key.backend_source, key.device)
        self.disable_amp = compat.autocast_enabled()  # read before AOTAutograd, which turns autocast off
        self.parts: dict[str, CompiledPart] = {}
        self.plan: RuntimePlan | None = None
        self.meta: Any = None  # AOTAutograd's metadata of the forward (runtime-safe once it returns)
        self.detach: tuple[int, ...] = ()
        self.bw_graph: torch.fx.GraphModule | None = None  # AOTAutograd's, from our partition
        self.static_saved: tuple[str, ...] = ()  # its static inputs, by name
        self.backward_graph: BackwardGraph | None = None  # its record, once AOTAutograd returns
        self.aot_metadata: str | None = None
        self.finished = False  # AOTAutograd has returned
        self.partial = False  # an entry without the compiled backward is written
        self.done = False
        self.function: CompiledFunction | None = None  # the latest complete value
        self.bypass: str | None = None  # why the graph gave up on level 1

    def release(self) -> None:
        """The compile is over: no process of the cluster waits any longer for an entry this one
        did not write (a written one has dropped its claim already)."""
        self.slot.release()

    def keep_backward_graph(self, bw: torch.fx.GraphModule, static_saved: tuple[str, ...]) -> None:
        """AOTAutograd's backward graph as our partition made it, and its static inputs by name."""
        self.bw_graph, self.static_saved = bw, static_saved

    def add(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext,
            module: CompiledModule, level_2: str | None = None) -> None:
        """``level_2``: the digest of the level-2 entry that holds ``module``, if one does."""
        if self.done:
            return
        kind = "inference" if self.backward else ctx.kind  # AOTAutograd's kind of graph
        try:
            self._add(gm, example_inputs, ctx, kind, module, level_2)
        except Uncacheable as exc:
            self._give_up(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - our bug must not fail the compile; it is logged
            self._give_up(f"recording failed ({type(exc).__name__}: {exc})")
            return
        # A symbolic inference graph's entry waits for AOTAutograd to return: its guards are all in then.
        if kind == "inference" and self.slot.symbols is None or (kind == "backward" and self.finished):
            self._write()

    def finish(self) -> None:
        """AOTAutograd has returned: write a training graph's entry, with its backward graph (a
        symbolic inference graph's, now that its guards are all in)."""
        self.finished = True
        if not self.done and "inference" in self.parts:
            self._write()
        if self.done or "forward" not in self.parts:
            return
        try:
            self.backward_graph = backward_graph.record(self._backward_graph(), self.static_saved)
            if "backward" not in self.parts:
                self.detach = _inputs_to_detach(self.bw_graph, self.plan)
        except Uncacheable as exc:
            self.backward_graph = None
            if "backward" not in self.parts:  # a plain backward may still compile it and write the entry
                log_once(log, f"no-bw-graph:{self.slot.name}", "cgtrees: %s's level-1 entry waits for its "
                         "backward to be compiled (under compiled autograd it never is): %s", self.slot.name, exc,
                         level=logging.INFO)
                return
        except Exception as exc:  # noqa: BLE001 - our bug must not fail the compile; it is logged
            self._give_up(f"recording the backward graph failed ({type(exc).__name__}: {exc})")
            return
        self._keep_metadata()
        self._write()

    def _backward_graph(self) -> torch.fx.GraphModule:
        if self.bw_graph is None:
            raise Uncacheable("AOTAutograd's backward graph did not come through our partition")
        return self.bw_graph

    def _keep_metadata(self) -> None:
        """AOTAutograd's metadata, which compiled autograd reads off the forward's Function."""
        if self.backward_graph is None:
            return
        try:
            self.aot_metadata = compat.pickle_aot_metadata(self.meta)
        except Uncacheable as exc:  # a hit then runs our backward under compiled autograd: other graphs
            log_once(log, f"no-aot-meta:{self.slot.name}", "cgtrees: %s: compiled autograd will not inline the "
                     "backward of its level-1 entry: %s", self.slot.name, exc, level=logging.INFO)

    def _add(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], ctx: GraphContext, kind: str,
             module: CompiledModule, level_2: str | None) -> None:
        if kind in self.parts:
            raise Uncacheable(f"AOTAutograd compiled a second {kind} graph")
        num_constants = len(ctx.constants) if ctx.constants else 0
        if kind in ("forward", "inference"):
            if len(gm.graph.find_nodes(op="placeholder")) - num_constants != self.num_inputs:
                raise Uncacheable("AOTAutograd deduplicated or merged inputs")
            if kind == "forward" and compat.saved_tensors_hooks_inlined():
                raise Uncacheable("saved-tensor hooks are inlined")
            self.meta = compat.fw_metadata()
            self.plan = compat.runtime_plan(self.meta, kind, self.disable_amp)
        elif self.plan is None:
            raise Uncacheable("backward without a forward")
        else:
            self.detach = _inputs_to_detach(gm, self.plan)
        level_2 = level_2 if self.slot.store is not None else None
        self.parts[kind] = CompiledPart(
            kind=kind, name=ctx.name, module=part_module(gm, module, self.config, None if self.keep else level_2),
            inputs=tuple(records.input_record(x) for x in example_inputs),
            constants=records.constant_records(ctx.constants),
            static_inputs=tuple(ctx.static_input_indices), mutated_inputs=tuple(ctx.mutated_input_indices),
            runtime_kind=ctx.kind if ctx.kind != kind else None, saved_from=ctx.saved_from, level_2=level_2)

    def _write(self) -> None:
        replace = self.partial  # the entry written without the compiled backward: this one holds it
        self.done = "forward" not in self.parts or "backward" in self.parts
        self.partial = not self.done
        try:
            guards = self.slot.symbols.guards_text() if self.slot.symbols is not None else None
        except Uncacheable as exc:
            self._give_up(str(exc))
            return
        assert self.plan is not None  # every part has added it
        self.function = CompiledFunction(self.origin, self.plan, tuple(self.parts.values()), self.detach,
                                         self.backward_graph, self.aot_metadata, guards or None)
        self.slot.write(self.function, replace)

    def _give_up(self, reason: str) -> None:
        self.done = True
        self.bypass = reason  # an entry written before stays the value precompile takes
        self.slot.bypass(reason)


def part_module(gm: torch.fx.GraphModule, module: CompiledModule, config: Config,
                level_2: str | None = None) -> Module:
    """What a part keeps of its compiled graph (Uncacheable if it cannot be kept): a generated
    module by the digest of its level-2 entry (``level_2``: the store holds it), else its whole
    ``CompiledGraph`` (binaries and compiled code in it, as a level-2 entry keeps them); a graph
    that runs through aten by its FX code."""
    if not isinstance(module, codegen.KernelModule):
        return AtenCode(fx_code(gm), module.graph.facts, module.graph.launches)
    if level_2 is not None:
        return Level2Ref(level_2, module.graph.facts)
    return kept_graph(module, config)


def _inputs_to_detach(bw: torch.fx.GraphModule, plan: RuntimePlan | None) -> tuple[int, ...]:
    """Non-leaf inputs that require grad but get no gradient: AOTAutograd detaches them."""
    assert plan is not None
    output = next(iter(bw.graph.find_nodes(op="output")))
    grads = list(output.args[0])
    if len(grads) != plan.num_inputs:
        raise Uncacheable("backward returns extra outputs")
    return tuple(i for i in plan.nonleaf_requiring_grad if grads[i] is None)
