"""A sum over a view that merges dimensions reads the unmerged value, next to where it is computed.

A Linear's bias gradient is ``grad.view(B*T, C).sum(0)``, where ``grad`` (B, T, C) is what a
kernel just computed (GELU's backward, say). The scheduler fuses a reduction into the kernel of
its input only over the same index space (``scheduler.py``), and the view makes it (B*T, C)
against the kernel's (B, T, C); the sum also comes after the matmuls that read ``grad``. So it was
a kernel of its own, reading ``grad`` back from memory.

``rewritten`` turns ``sum(view(x, merged), dims)`` into ``view(sum(x, the dims merged into dims))``
and places the sum just after ``x``: the same elements summed, a reduction the scheduler can
fuse with ``x``'s kernel. Only merges of whole dimensions of static sizes greater than 1.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def rewritten(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm``, or a copy of it with every such sum rewritten (the caller's graph is left as it is:
    the cache records it)."""
    if not any(_plan(n) for n in gm.graph.find_nodes(op="call_function", target=aten.sum.dim_IntList)):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # nodes' meta shared, not copied
    for node in list(graph.find_nodes(op="call_function", target=aten.sum.dim_IntList)):
        plan = _plan(node)
        if plan is not None:
            _rewrite(graph, node, *plan)
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(gm, graph)


def _plan(node: torch.fx.Node) -> tuple[torch.fx.Node, list[int]] | None:
    """The value a sum over a merging view can read instead, and the dimensions it then reduces."""
    view = node.args[0]
    if not (isinstance(view, torch.fx.Node) and view.target in _VIEWS and isinstance(view.args[0], torch.fx.Node)):
        return None
    source = view.args[0]
    while source.target in _VIEWS and isinstance(source.args[0], torch.fx.Node) and \
            _merge_groups(_shape(source.args[0]), _shape(source)) is not None:
        source = source.args[0]  # a merge of a merge: one merge of the first value
    groups = _merge_groups(_shape(source), _shape(view))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if groups is None or not dims:
        return None
    return source, sorted(d for v in {d % len(groups) for d in dims} for d in groups[v])


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, source: torch.fx.Node, reduced: list[int]) -> None:
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    kwargs = {k: v for k, v in node.kwargs.items() if k not in ("dim", "keepdim")}  # dtype
    # just after its input, where the scheduler may fuse it (an input: where the sum was)
    with graph.inserting_before(node) if source.op == "placeholder" else graph.inserting_after(source):
        summed = graph.call_function(aten.sum.dim_IntList, (source, reduced, keepdim), kwargs)
    summed.meta["val"] = aten.sum.dim_IntList(source.meta["val"], reduced, keepdim, **kwargs)
    with graph.inserting_before(node):
        shaped = graph.call_function(aten.view.default, (summed, list(node.meta["val"].shape)))
    shaped.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(shaped)
    graph.erase_node(node)


def _shape(node: torch.fx.Node) -> tuple | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) and s > 1 for s in val.shape):
        return None
    return tuple(val.shape)


def _merge_groups(source: tuple | None, merged: tuple | None) -> list[list[int]] | None:
    """For each dimension of ``merged``, the dimensions of ``source`` it merges; None unless
    ``merged`` only merges runs of whole dimensions (and merges at least one)."""
    if source is None or merged is None or len(merged) >= len(source):
        return None
    groups: list[list[int]] = []
    d = 0
    for size in merged:
        group, product = [], 1
        while d < len(source) and product < size:
            product *= source[d]
            group.append(d)
            d += 1
        if product != size:
            return None
        groups.append(group)
    return groups if d == len(source) else None
