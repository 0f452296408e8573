"""A write into a graph input goes just after the values it writes are computed.

AOTAutograd ends a forward with one ``aten.copy_(input, value)`` per input the program mutates: a
training BatchNorm's running mean and variance (``running * 0.9 + batch_stat * 0.1``). At the end
of the graph, each became a kernel of its own (15 launches on the convnet workload) that read
back the statistics its BatchNorm's reduction had just written. ``placed`` moves each such write,
with the steps that only it reads, to just after its last other input: the update joins the
reduction's kernel as a row step (``scheduler.py``), one value per channel.

A write moves only when nothing else reads or writes that input: the steps between the new place
and the old one then cannot tell the difference.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def placed(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm``, or a copy of it with every movable write into an input moved early (the caller's
    graph is left as it is: the cache records it)."""
    if not any(_chain(n) for n in _writes(gm.graph)):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # nodes' meta shared, not copied
    for write in _writes(graph):
        chain = _chain(write)
        if chain:
            _move(graph, chain)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


def _writes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.find_nodes(op="call_function", target=aten.copy_.default)
            if n.args[0].op == "placeholder"]


def _chain(write: torch.fx.Node) -> list[torch.fx.Node]:
    """``write`` and the pure steps only it reads (in graph order), or [] when the input has other
    readers or writers, or the write would not move."""
    chain = {write}
    stack = [a for a in write.all_input_nodes if a.op == "call_function"]
    while stack:
        node = stack.pop()
        if node in chain or not _pure(node) or any(u not in chain for u in node.users):
            continue
        chain.add(node)
        stack.extend(a for a in node.all_input_nodes if a.op == "call_function")
    target = write.args[0]
    if any(u not in chain for u in target.users):
        return []
    order = [n for n in write.graph.nodes if n in chain]
    return [] if _in_place(order) else order


def _in_place(chain: list[torch.fx.Node]) -> bool:
    """Whether ``chain`` already follows its anchor, one node after the other."""
    node = _anchor(chain)
    for member in chain:
        node = node.next
        if node is not member:
            return False
    return True


def _pure(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and not (schema is not None and schema.is_mutable)


def _anchor(chain: list[torch.fx.Node]) -> torch.fx.Node:
    """The last node that the chain reads from outside itself (or the last input)."""
    members = set(chain)
    graph = chain[0].graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    outside = [a for n in chain for a in n.all_input_nodes if a not in members]
    last_input = max(graph.find_nodes(op="placeholder"), key=position.__getitem__)
    return max([last_input, *outside], key=position.__getitem__)


def _move(graph: torch.fx.Graph, chain: list[torch.fx.Node]) -> None:
    at = _anchor(chain)
    for node in chain:
        at.append(node)
        at = node
