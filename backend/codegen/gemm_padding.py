"""The padded form of a GEMM (``gemm_choice`` decides where): a graph rewrite before lowering.

``mm(a, b)`` with sizes (M, K, N) padded to (M', K', N') becomes

    a' = constant_pad_nd(a, [0, K' - K, 0, M' - M])      zero columns (and rows) appended
    b' = constant_pad_nd(b, [0, N' - N, 0, K' - K])
    out = mm(a', b')[:M, :N]                             a view: readers go through its strides

``addmm`` the same, its 1-D bias padded to N'. Zeros make the padded products exact: the extra
terms of each sum are 0 * 0, and the extra rows and columns are never read.

Where the operand is a transpose (``t``, ``transpose``, ``permute`` of a matrix), the matrix under
it is padded and transposed again, so the operand keeps its layout, and the backward's two GEMMs
of one gradient share one pad; where it is a reshape that keeps the padded last dimension, the
pad goes above the reshape, into the kernel that computes the value (a view that merges the
dimensions of a value not yet in memory would write it first and pad a copy). Our lowering of
``constant_pad_nd`` is a masked read fused into the producer's kernel, so a pad of a value we
compute costs nothing; a pad of an input (the weight) is a copy, which the timing counted.

Every node's meta is then computed again (the slices have the padded strides, and what reads
them follows), and an output whose strides changed is copied to its traced (contiguous) layout;
where a traced output was not contiguous the graph is left as it was (``NotPadded``).
"""

from __future__ import annotations

import torch
import torch.fx

from cgtrees.codegen import compat

aten = torch.ops.aten

TRANSPOSES = frozenset({aten.t.default, aten.transpose.int, aten.permute.default})
_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
VIEWS = TRANSPOSES | _RESHAPES | {aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim,
                                  aten.squeeze.default, aten.squeeze.dims, aten.expand.default}


class NotPadded(Exception):
    """The rewrite would change a graph output's layout in a way a contiguous copy cannot restore."""


def padded(gm: torch.fx.GraphModule, pads: dict[str, tuple[int, int, int]]) -> torch.fx.GraphModule:
    """``gm`` with each GEMM named in ``pads`` padded to its (M, K, N); ``gm`` itself where there
    is none. Raises ``NotPadded`` (``gm`` untouched) where an output's layout could not be kept."""
    if not pads:
        return gm
    out = torch.fx.GraphModule(gm, _copy(gm.graph))
    traced = traced_outputs(out.graph)
    memo: dict[tuple, torch.fx.Node] = {}
    for node in list(out.graph.nodes):
        if node.name in pads:
            _pad_gemm(out.graph, node, pads[node.name], memo)
    out.graph.eliminate_dead_code()
    out.recompile()
    settle(out, traced)
    return out


def traced_outputs(graph: torch.fx.Graph) -> list:
    """The fake value of each of ``graph``'s outputs (None where not a node), before a rewrite."""
    output = next(iter(graph.find_nodes(op="output")))
    return [a.meta["val"] if isinstance(a, torch.fx.Node) else None for a in _flat(output.args[0])]


def settle(gm: torch.fx.GraphModule, traced: list) -> None:
    """After a rewrite of ``gm``: every node's meta computed again, and each output whose strides
    changed copied back to its ``traced`` layout. Raises ``NotPadded`` where that cannot be done,
    and fake propagation's own error where a reader cannot take the new strides."""
    compat.refresh_meta(gm)
    if _restore_output_layouts(gm.graph, traced):
        gm.recompile()
        compat.refresh_meta(gm)


def _pad_gemm(graph: torch.fx.Graph, node: torch.fx.Node, to: tuple[int, int, int], memo: dict) -> None:
    m, k, n = to
    addmm = node.target is aten.addmm.default
    a, b = node.args[1:3] if addmm else node.args[:2]
    rows, cols = (int(x) for x in node.meta["val"].shape)
    with graph.inserting_before(node):
        a_p, b_p = _pad(graph, a, m, k, memo), _pad(graph, b, k, n, memo)
        if addmm:
            bias = _pad_last(graph, node.args[0], n, memo)
            product = _new(graph, aten.addmm.default, (bias, a_p, b_p), node.name + "_padded", dict(node.kwargs))
        else:
            product = _new(graph, aten.mm.default, (a_p, b_p), node.name + "_padded")
        result = product
        if m != rows:
            result = _new(graph, aten.slice.Tensor, (result, 0, 0, rows), node.name + "_rows")
        if n != cols:
            result = _new(graph, aten.slice.Tensor, (result, 1, 0, cols), node.name + "_cols")
    product.meta.update({k: v for k, v in node.meta.items() if k != "val"})  # the source line, for comments
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def _pad(graph: torch.fx.Graph, x: torch.fx.Node, rows_to: int, cols_to: int, memo: dict) -> torch.fx.Node:
    """Matrix ``x`` with zero rows and columns appended up to (``rows_to``, ``cols_to``)."""
    rows, cols = (int(s) for s in x.meta["val"].shape)
    if (rows, cols) == (rows_to, cols_to):
        return x
    key = (x, rows_to, cols_to)
    if key not in memo:
        memo[key] = _pad_new(graph, x, rows, cols, rows_to, cols_to, memo)
    return memo[key]


def _pad_new(graph: torch.fx.Graph, x: torch.fx.Node, rows: int, cols: int, rows_to: int, cols_to: int,
             memo: dict) -> torch.fx.Node:
    source = x.args[0] if x.op == "call_function" and x.args and isinstance(x.args[0], torch.fx.Node) else None
    if source is not None and _is_matrix_transpose(x) and source.meta["val"].dim() == 2:
        return _new(graph, aten.t.default, (_pad(graph, source, cols_to, rows_to, memo),), x.name + "_padded")
    if x.target in _RESHAPES and source is not None and rows == rows_to and _keeps_last(source, x):
        inner = _pad_last(graph, source, cols_to, memo)
        return _new(graph, aten.view.default, (inner, [rows, cols_to]), x.name + "_padded")
    return _new(graph, aten.constant_pad_nd.default, (x, [0, cols_to - cols, 0, rows_to - rows], 0.0),
                x.name + "_padded")


def _pad_last(graph: torch.fx.Graph, x: torch.fx.Node, to: int, memo: dict) -> torch.fx.Node:
    """``x`` with its last dimension padded with zeros up to ``to``."""
    size = int(x.meta["val"].shape[-1])
    if size == to:
        return x
    key = (x, "last", to)
    if key not in memo:
        memo[key] = _new(graph, aten.constant_pad_nd.default, (x, [0, to - size], 0.0), x.name + "_padded")
    return memo[key]


def _new(graph: torch.fx.Graph, target: object, args: tuple, name: str, kwargs: dict | None = None) -> torch.fx.Node:
    return graph.create_node("call_function", target, args, kwargs or {}, name=name)


def _is_matrix_transpose(x: torch.fx.Node) -> bool:
    if x.target is aten.t.default:
        return True
    if x.target is aten.transpose.int:
        return sorted(d % 2 for d in x.args[1:3]) == [0, 1]
    return x.target is aten.permute.default and list(x.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])


def _keeps_last(source: torch.fx.Node, x: torch.fx.Node) -> bool:
    """Whether reshape ``x`` of ``source`` only merges or splits the leading dimensions (the last
    is the same size), and ``source`` is contiguous (so the reshape stays a view once padded)."""
    val = source.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 1 and val.is_contiguous() and \
        int(val.shape[-1]) == int(x.meta["val"].shape[-1])


def _restore_output_layouts(graph: torch.fx.Graph, traced: list) -> bool:
    """Copy each output whose strides the rewrite changed to its traced layout (contiguous);
    whether any was copied."""
    output = next(iter(graph.find_nodes(op="output")))
    values = _flat(output.args[0])
    copied = False
    for i, (arg, want) in enumerate(zip(values, traced)):
        if not isinstance(arg, torch.fx.Node) or want is None:
            continue
        if tuple(arg.meta["val"].stride()) == tuple(want.stride()):
            continue
        if not want.is_contiguous():
            raise NotPadded(f"output {i} was traced with strides {tuple(want.stride())}")
        with graph.inserting_before(output):
            values[i] = _new(graph, aten.clone.default, (arg,), arg.name + "_traced",
                             {"memory_format": torch.contiguous_format})
        copied = True
    if copied:
        output.args = (type(output.args[0])(values) if isinstance(output.args[0], (list, tuple)) else values[0],)
    return copied


def _flat(value: object) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    for old, node in env.items():
        node.meta = dict(old.meta)
    return new
