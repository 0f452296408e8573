"""Where the two halves of a partition compute what crossed the cut.

torch's helper builds the forward and the backward in the joint graph's order, and our scheduler
fuses steps in program order (``backend/codegen/scheduler.py``). Two kinds of value land where it
cannot fuse them with what reads or writes the same memory:

- **In the forward, values computed only for the backward** (GELU's derivative, where the cut
  saves it) come after the forward's outputs, past every matmul of the step. All of them become
  one kernel at the end that reads again what each layer's kernel had in registers. ``hoist``
  moves each to just after its last input, beside the kernel that computes from the same values.
- **In the backward, what it recomputes** (LayerNorm's statistics) comes first, before the first
  gradient. All of it becomes one kernel that reads every saved input and writes the results
  back. ``sink`` moves each to just before its first reader, the kernel it then fuses into.

Only pure values move (``cost.is_recomputable``), and none that reads a buffer the graph writes.
"""

from __future__ import annotations

import torch.fx

from cgtrees.aot import compat
from cgtrees.aot.cost import is_recomputable


def place(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int) -> None:
    """Reorder both halves in place (see the module docstring)."""
    output = next(iter(fw.graph.find_nodes(op="output")))
    hoist(fw.graph, keep=ancestors(a for a in output.args[0][:num_fwd_outputs] if isinstance(a, torch.fx.Node)))
    sink(bw.graph, anchors=descendants(n for n in bw.graph.nodes if compat.is_tangent(n)))
    fw.recompile()
    bw.recompile()


def hoist(graph: torch.fx.Graph, keep: set[torch.fx.Node]) -> None:
    """Move every movable node not in ``keep`` to just after its last input (and after the
    graph's inputs, whose order is the calling convention)."""
    movable = _movable(graph) - keep
    order: list[torch.fx.Node] = []
    inputs = 0
    for node in graph.nodes:
        if node in movable:
            order.insert(max([inputs - 1, *(order.index(a) for a in node.all_input_nodes)]) + 1, node)
        else:
            order.append(node)
            inputs += node.op == "placeholder"
    _reorder(graph, order)


def sink(graph: torch.fx.Graph, anchors: set[torch.fx.Node]) -> None:
    """Move every movable node not in ``anchors`` to just before its first reader."""
    movable = _movable(graph) - anchors
    order: list[torch.fx.Node] = []
    placed: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node not in movable:
            _place(node, movable, placed, order)
    for node in graph.nodes:  # what nothing reads, last
        _place(node, movable, placed, order)
    _reorder(graph, order)


def _place(node: torch.fx.Node, movable: set[torch.fx.Node], placed: set[torch.fx.Node],
           order: list[torch.fx.Node]) -> None:
    """Append ``node`` to ``order`` after the movable inputs not yet placed (depth first)."""
    stack = [(node, False)]
    while stack:
        current, expanded = stack.pop()
        if current in placed:
            continue
        if expanded:
            placed.add(current)
            order.append(current)
            continue
        stack.append((current, True))
        stack.extend((a, False) for a in reversed(current.all_input_nodes) if a in movable and a not in placed)


def ancestors(roots) -> set[torch.fx.Node]:
    return _reach(roots, lambda n: n.all_input_nodes)


def descendants(roots) -> set[torch.fx.Node]:
    return _reach(roots, lambda n: n.users)


def _reach(roots, step) -> set[torch.fx.Node]:
    """``roots`` and every node reached from them through ``step`` (inputs or users)."""
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


def _movable(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    written = {n.args[0] for n in graph.nodes if n.op == "call_function" and _mutates(n)}
    return {n for n in graph.nodes if is_recomputable(n) and not written.intersection(n.all_input_nodes)}


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable and bool(node.args)


def _reorder(graph: torch.fx.Graph, order: list[torch.fx.Node]) -> None:
    output = next(iter(graph.find_nodes(op="output")))
    for node in order:
        if node is not output:
            output.prepend(node)
    graph.lint()
