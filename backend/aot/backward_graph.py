"""The backward graph a level-1 training function keeps beside its compiled forward (``BackwardGraph``).

AOTAutograd compiles a backward lazily, at the first ``backward()``. Compiled autograd never has it
compiled: it copies the backward graph (``_lazy_backward_info.bw_module`` of AOTAutograd's
autograd.Function) into its own capture of the whole backward pass, which then reaches us as a
graph of its own. So the entry keeps the backward graph itself, as AOTAutograd's partition left it:

- a rebuilt forward offers it to compiled autograd as AOTAutograd's function would
  (``compat.aot_backward_attributes``), so a warm process captures the same backward graph as a
  cold one, and that graph hits its own level-1 entry;
- a plain ``backward()`` after a warm start compiles it, as AOTAutograd would (its kernel module
  from level 2 when one is there), where the entry holds no compiled backward.

The graph is kept as its FX code (only torch's own globals: ``aot.fx_code``'s rule) and the
metadata of its inputs; it is traced back into a GraphModule (torch.fx.symbolic_trace), and its
example values are propagated on fake inputs where it is compiled.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx

from cgtrees.aot import compat
from cgtrees.aot.compat import Uncacheable
from cgtrees.aot.fx_code import check_globals, fx_globals
from cgtrees.compiled_function import BackwardGraph, TensorSpec


def record(bw: torch.fx.GraphModule, static_saved: tuple[str, ...]) -> BackwardGraph:
    """What the function keeps of AOTAutograd's backward graph ``bw`` (Uncacheable if it cannot);
    ``static_saved``: its static inputs, by name, as our partition's cut says."""
    if any(n.op in ("get_attr", "call_module") for n in bw.graph.nodes):
        raise Uncacheable("the backward graph reads module attributes")
    code = bw.graph.python_code(root_module="self")
    check_globals(code.globals, "the backward graph's code")
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    static = set(static_saved)
    return BackwardGraph(code.src, tuple(_spec(n) for n in placeholders),
                         tuple(i for i, n in enumerate(placeholders) if n.name in static))


def graph_module(rec: BackwardGraph) -> tuple[torch.fx.GraphModule, tuple[str, ...]]:
    """The backward graph traced back from its code (no example values: ``example_inputs``), and
    its static inputs by name, as our partition's cut said."""
    namespace = dict(fx_globals())
    exec(compile(rec.code, "<cgtrees cached backward graph>", "exec"), namespace)  # noqa: S102 - our entry
    root = type("CachedBackwardGraph", (torch.nn.Module,), {"forward": namespace["forward"]})()
    gm = torch.fx.symbolic_trace(root)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(rec.inputs):
        raise Uncacheable("the backward graph's code does not match its inputs")
    return gm, tuple(placeholders[i].name for i in rec.static)


def example_inputs(gm: torch.fx.GraphModule, rec: BackwardGraph) -> list[torch.Tensor]:
    """Fake inputs for ``gm``, with every node's example value (``meta["val"]``) propagated from
    them, as AOTAutograd hands a backward graph to its compiler."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = compat.fake_mode()
    inputs = compat.fake_tensors(rec.inputs, mode)
    FakeTensorProp(gm, mode).propagate(*inputs)
    return inputs


def copy_with_inputs(bw: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[Any]]:
    """A copy of AOTAutograd's backward graph (kept intact for compiled autograd), and its
    placeholders' example values: what AOTAutograd hands its compiler at a lazy backward."""
    return copy.deepcopy(bw), [n.meta.get("val") for n in bw.graph.find_nodes(op="placeholder")]


def _spec(node: torch.fx.Node) -> TensorSpec:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or any(not isinstance(s, int) for s in (*value.shape, *value.stride())):
        raise Uncacheable(f"backward graph input {node.name} is not a static-shape tensor")
    return TensorSpec(tuple(value.shape), tuple(value.stride()), str(value.dtype).removeprefix("torch."),
                      str(value.device))
