"""A module of aten calls only (CPU without the interpreter) runs the ops eager would run.

Where no kernel is generated, every aten node is a Python call of its own, a few microseconds each,
and AOTAutograd's graphs hold calls eager never makes: ``nn.Linear`` is one ``linear`` in eager and
``t`` + ``addmm`` in the graph; its backward transposes a weight twice (``t(t(w))``) and sums the bias
gradient with ``keepdim`` only to ``view`` the dimension away. On a small model these calls cost more
than the arithmetic (mlp_small, 16 x 256, one CPU thread: 102 aten calls in its backward, 43 of them
``t``). ``fold`` rewrites them into what eager calls; each rewrite gives the same values, computed by
the same ATen kernel:

1. ``t(t(x))`` -> ``x`` (a tensor of at most 2 dimensions: the same sizes and strides), unless ``x``
   is a graph input and the result an output (the output would then be the input itself, where
   AOTAutograd's metadata expects a view of it);
2. ``addmm(b, x, t(w))`` -> ``linear(x, w, b)`` and ``mm(x, t(w))`` -> ``linear(x, w)``, where ``t`` has
   no other user and ``x`` is 2-D (``linear`` calls ``addmm`` or ``mm`` on ``w.t()`` itself, in C++);
   a ``t(w)`` other nodes read stays;
3. ``view(sum(x, dims, True), shape)`` -> ``sum(x, dims)``, where ``shape`` is the summed size
   without the kept dimensions;
4. ``w = index_copy(buf, d, i, src)`` ... ``copy_(buf, w)`` -> ``index_copy_(buf, d, i, src)`` (and
   ``index_put``): a graph input written in place, as eager writes a KV cache, where
   functionalization made a new copy of the whole buffer and copied it back (the decode workload:
   16 MiB of copies a step, a quarter of its time). Only where ``buf`` has no other reader, so no
   node can see the buffer's old value after the write.

A pass is ``graph -> (graph, changed)``; ``fold`` runs them until none changes anything.
"""

from __future__ import annotations

import torch
import torch.fx

from cgtrees.codegen import fx_copy

aten = torch.ops.aten


def fold(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with the rewrites above applied and its dead nodes removed (``gm`` itself is
    left as it is: the driver may keep it, for a fallback or a later compile)."""
    graph, _ = fx_copy.copied(gm)
    changed = True
    while changed:
        changed = False
        for rewrite in (_double_transposes, _linears, _kept_sums, _in_place_writes):
            changed |= rewrite(graph)
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(gm, graph)


def _is(node: object, target: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _dims(node: torch.fx.Node) -> int | None:
    value = node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else None


def _outputs(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    out = graph.output_node().args[0]
    return {n for n in (out if isinstance(out, (list, tuple)) else (out,)) if isinstance(n, torch.fx.Node)}


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, target: object, args: tuple, *gone: torch.fx.Node) -> None:
    """``node`` replaced by a call of ``target`` on ``args`` (its meta kept); ``node`` and ``gone``
    (nodes only it read) erased."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    for dead in (node, *gone):
        graph.erase_node(dead)


def _double_transposes(graph: torch.fx.Graph) -> bool:
    changed, outputs = False, _outputs(graph)
    for node in list(graph.nodes):
        inner = node.args[0] if _is(node, aten.t.default) and node.users else None
        if not _is(inner, aten.t.default):
            continue
        base = inner.args[0]
        dims = _dims(base) if isinstance(base, torch.fx.Node) else None
        if dims is None or dims > 2 or (base.op == "placeholder" and node in outputs):
            continue
        node.replace_all_uses_with(base)
        changed = True
    return changed


def _linears(graph: torch.fx.Graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        if _is(node, aten.addmm.default) and not node.kwargs:  # beta and alpha (keyword-only) at 1
            bias, x, wt = node.args
        elif _is(node, aten.mm.default):
            (x, wt), bias = node.args, None
        else:
            continue
        if not _is(wt, aten.t.default) or len(wt.users) != 1 or _dims(x) != 2 or _dims(wt.args[0]) != 2:
            continue
        if bias is not None and _dims(bias) != 1:  # addmm broadcasts a 2-D bias; linear's is 1-D
            continue
        args = (x, wt.args[0]) if bias is None else (x, wt.args[0], bias)
        _replace(graph, node, aten.linear.default, args, wt)
        changed = True
    return changed


def _kept_sums(graph: torch.fx.Graph) -> bool:
    changed = False
    for node in list(graph.nodes):
        summed = node.args[0] if _is(node, aten.view.default) else None
        if not _is(summed, aten.sum.dim_IntList) or len(summed.users) != 1 or summed.kwargs.get("dtype") is not None:
            continue
        if len(summed.args) < 3 or summed.args[2] is not True or not isinstance(summed.args[1], (list, tuple)):
            continue
        source = _dims(summed.args[0])
        value = summed.meta.get("val")
        if source is None or not isinstance(value, torch.Tensor):
            continue
        kept = {d % source for d in summed.args[1]}
        squeezed = [n for d, n in enumerate(value.shape) if d not in kept]
        shape = list(node.args[1])
        if not all(type(n) is int for n in [*shape, *squeezed]) or shape != squeezed:  # symbolic: not here
            continue
        _replace(graph, node, aten.sum.dim_IntList, (summed.args[0], summed.args[1]), summed)
        changed = True
    return changed


_IN_PLACE = {aten.index_copy.default: aten.index_copy_.default, aten.index_put.default: aten.index_put_.default}


def _in_place_writes(graph: torch.fx.Graph) -> bool:
    changed = False
    for write in list(graph.nodes):
        if write.op != "call_function" or write.target not in _IN_PLACE or write.kwargs:
            continue
        buf = write.args[0]
        if not isinstance(buf, torch.fx.Node) or buf.op != "placeholder" or len(buf.users) != 2:
            continue
        back = next((u for u in buf.users if u is not write), None)
        if not _is(back, aten.copy_.default) or back.args != (buf, write) or back.users:
            continue
        graph.erase_node(back)  # the write-back: the in-place write below is the buffer's own
        _replace(graph, write, _IN_PLACE[write.target], write.args)
        changed = True
    return changed
