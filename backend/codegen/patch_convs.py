"""A convolution whose kernel tiles its input (a ViT's or a ConvNeXt's patch embedding) as one GEMM over
the patches, where timing says so (issue 55, "Fuse across the matmul").

A convolution with stride equal to its kernel, no padding, no dilation and one group reads every input
element once, in disjoint patches: it is a matrix product of the patches, laid out as rows, with the
weight viewed as [O, C*kh*kw]::

    p = view(x, [N, C, Hp, kh, Wp, kw])                  splits H and W: a view for any strides
    a = view(clone(permute(p, [0, 2, 4, 1, 3, 5])), [N*Hp*Wp, C*kh*kw])    one copy of the input
    y = addmm(bias, a, t(view(w, [O, C*kh*kw])))         (mm without a bias)
    out = permute(view(y, [N, Hp, Wp, O]), [0, 3, 1, 2])  [N, O, Hp, Wp], channels-last strides

cuDNN runs such a convolution as an implicit GEMM over 3 input channels padded for its tensor cores
and converts NCHW to NHWC around it: ViT-B/16 at 64 images, an H200, bf16, 0.43 ms of convolution and
0.16 of conversions a step (Inductor's step and ours, ``real-size`` a247473), for 15 GFLOP that
cuBLAS runs in tens of microseconds. The copy that lays the patches out as rows is one of our
pointwise kernels.

Its backward (``convolution_backward`` without the bias gradient, which ``aot.decompositions`` takes
out as a sum) is GEMMs over the same patches, with the output gradient as rows [N*Hp*Wp, O] (a view
where the gradient is channels-last, else one copy)::

    grad_w = view(mm(t(rows), a), [O, C, kh, kw])                 the patches laid out again
    grad_x = view(clone(permute(view(mm(rows, w2), [N, Hp, Wp, C, kh, kw]), [0, 3, 1, 4, 2, 5])), [N, C, H, W])

cuDNN converts the gradient from NCHW to NHWC and back around its weight-gradient kernel (ViT-B/16
training at 32 images, an H200: about 0.17 ms a step, a247473).

The patches' columns follow the weight's memory order (``Order``), so the weight is a matrix as it
lies: (C, kh, kw) for a contiguous weight, (kh, kw, C) for a channels-last one (the layout pass gives
a convolution-heavy graph's weights that layout; the input's gradient is then channels-last too).

``rewritten(gm, plan)`` times both forms on the device at compile time, as ``gemm_choice`` times a
GEMM's: the convolution as traced, against the copy and the GEMM (in eager ops), and takes the GEMM
where it is faster by more than ``gemm_choice.MARGIN``; ``gemm_decisions=rewrite`` always takes it,
``keep`` never, and where nothing can be timed the graph stays as traced. Each choice is a line of the
module's header. The result's strides are channels-last where the convolution's were contiguous: what
reads it is propagated again, and where that fails (a view the new strides cannot express), the
result is copied to the traced layout first, as it is where it leaves the graph. The graph handed in
is left as it is: the rewrite works on a copy.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx

from cgtrees.codegen import fx_copy
from cgtrees.codegen.gemm_choice import MARGIN, layout_text, random_like, span_bytes
from cgtrees.codegen.gemm_padding import NotPadded, settle, traced_outputs

if TYPE_CHECKING:
    from cgtrees.codegen.gemm_choice import GemmPlan

aten = torch.ops.aten

TRACED, PATCHES = "as traced", "patches as one GEMM"
BACKWARD = aten.convolution_backward.default


def rewritten(gm: torch.fx.GraphModule, plan: "GemmPlan") -> torch.fx.GraphModule:
    """``gm``, or a copy of it where some patch convolution runs as a GEMM; each choice one note."""
    nodes = [*gm.graph.find_nodes(op="call_function", target=aten.convolution.default),
             *gm.graph.find_nodes(op="call_function", target=BACKWARD)]
    choices = [_choose(node, plan) for node in nodes if tiles_its_input(node)]
    chosen = [c for c in choices if c.taken == PATCHES]
    out, why = _rewritten(gm, [c.node for c in chosen]) if chosen else (gm, "")
    for c in choices:
        if c in chosen and out is gm:
            c = Choice(c.node, c.what, TRACED, c.timings, f"not rewritten: {why}")
        plan.note(c.node, c.what, c.taken, c.timings, c.why)
    return out


@dataclass(frozen=True)
class Choice:
    """One convolution's choice, noted once the rewrite is known to hold."""

    node: str
    what: str
    taken: str
    timings: tuple[tuple[str, float], ...] = ()
    why: str = "timed"


def _rewritten(gm: torch.fx.GraphModule, names: list[str]) -> tuple[torch.fx.GraphModule, str]:
    """A copy of ``gm`` with the convolutions ``names`` as GEMMs, their results channels-last where
    what reads them takes that, else copied to the traced layout; ``gm`` and why, where neither holds."""
    why = ""
    for contiguous in (False, True):
        graph, copied = fx_copy.copied(gm)
        traced = traced_outputs(graph)
        for name in names:
            node = copied[name]
            _rewrite_backward(graph, node) if node.target is BACKWARD else _rewrite(graph, node, contiguous)
        out = torch.fx.GraphModule(gm, graph)
        try:
            settle(out, traced)
            return out, ""
        except (NotPadded, RuntimeError, ValueError) as exc:  # a reader the channels-last strides cannot serve
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    return gm, why


def tiles_its_input(node: torch.fx.Node) -> bool:
    """Whether ``convolution`` (or ``convolution_backward``) ``node`` is 2-d, its stride its kernel's
    size, without padding, dilation, transposition or groups, over static sizes that its kernel
    divides; a backward without its bias gradient (``decompositions`` takes that out as a sum)."""
    if node.kwargs:
        return False
    if node.target is aten.convolution.default and len(node.args) == 9:
        x, w, _bias, stride, padding, dilation, transposed, _out_pad, groups = node.args
    elif node.target is BACKWARD and len(node.args) == 11 and _backward_outputs(node):
        grad, x, w, _sizes, stride, padding, dilation, transposed, _out_pad, groups, _mask = node.args
        if not isinstance(grad.meta.get("val"), torch.Tensor):
            return False
    else:
        return False  # not the positional form the aten graph gives
    xv, wv = x.meta.get("val"), w.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or xv.dim() != 4 or transposed:
        return False
    if groups != 1 or any(p != 0 for p in padding) or any(d != 1 for d in dilation):
        return False
    if not all(isinstance(s, int) for s in (*xv.shape, *wv.shape)) or not xv.is_floating_point():
        return False
    kernel = tuple(wv.shape[2:])
    return tuple(stride) == kernel and kernel != (1, 1) and xv.shape[2] % kernel[0] == 0 and \
        xv.shape[3] % kernel[1] == 0 and (wv.is_contiguous() or wv.is_contiguous(memory_format=torch.channels_last))


def _backward_outputs(node: torch.fx.Node) -> bool:
    """Whether ``convolution_backward`` ``node`` computes no bias gradient, and each of its readers
    takes one of the gradients it computes (or is dead)."""
    mask = node.args[10]
    if not isinstance(mask, (list, tuple)) or len(mask) != 3 or mask[2] or not (mask[0] or mask[1]):
        return False
    return all(u.target is operator.getitem and (not u.users or u.args[1] in (0, 1) and mask[u.args[1]])
               for u in node.users)


@dataclass(frozen=True)
class Order:
    """The patches' columns in the weight's memory order, so that the weight is an [O, C*kh*kw] matrix
    without a copy: (C, kh, kw) for a contiguous weight, (kh, kw, C) for a channels-last one (the
    layout pass gives a convolution-heavy graph's weights that layout)."""

    patches: tuple[int, ...]  # x viewed as [N, C, Hp, kh, Wp, kw] -> [N, Hp, Wp, <the columns>]
    weight: tuple[int, ...]  # w [O, C, kh, kw] -> [O, <the columns>], contiguous

    @staticmethod
    def of(w: torch.Tensor) -> "Order":
        if w.is_contiguous():
            return Order((0, 2, 4, 1, 3, 5), (0, 1, 2, 3))
        return Order((0, 2, 4, 3, 5, 1), (0, 2, 3, 1))


def _inverse(perm: tuple[int, ...]) -> list[int]:
    return sorted(range(len(perm)), key=lambda i: perm[i])


# -------------------------------------------------------------------------------------------- choice
def _choose(node: torch.fx.Node, plan: "GemmPlan") -> Choice:
    how, why = plan.other_choice()
    what = _describe(node)
    if how != "time":
        return Choice(node.name, what, PATCHES if how == "rewrite" else TRACED, (), why)
    if node.target is BACKWARD:
        forms = {TRACED: _traced_backward(node, plan.device), PATCHES: _patch_backward(node, plan.device)}
    else:
        x, w, bias = (a.meta["val"] if isinstance(a, torch.fx.Node) else None for a in node.args[:3])
        forms = {TRACED: _traced_form(node, x, w, bias, plan.device), PATCHES: _patch_form(x, w, bias, plan.device)}
    timings = plan.time_forms(forms)
    if timings is None:
        return Choice(node.name, what, TRACED, (), "too large to time")
    taken = PATCHES if timings[PATCHES] < timings[TRACED] * (1 - MARGIN) else TRACED
    return Choice(node.name, what, taken, tuple(timings.items()))


def _describe(node: torch.fx.Node) -> str:
    if node.target is BACKWARD:
        x, w = node.args[1].meta["val"], node.args[2].meta["val"]
        grads = " and ".join(g for g, m in zip(("input", "weight"), node.args[10]) if m)
        return f"convolution_backward ({grads}) {list(x.shape)} * {list(w.shape)} stride {list(node.args[4])} {x.dtype}"
    x, w = node.args[0].meta["val"], node.args[1].meta["val"]
    return f"convolution {list(x.shape)} * {list(w.shape)} stride {list(node.args[3])} {x.dtype}"


def _traced_form(node: torch.fx.Node, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                 device: torch.device) -> tuple[str, Callable[[], Callable[[], None]], int]:
    stride = list(node.args[3])
    key = f"convolution {layout_text(x)} * {layout_text(w)} stride {stride} {x.dtype} {device}"

    def build() -> Callable[[], None]:
        tx, tw = random_like(x, device), random_like(w, device)
        tb = random_like(bias, device) if bias is not None else None
        return lambda: torch.convolution(tx, tw, tb, stride, [0, 0], [1, 1], False, [0, 0], 1)

    return key, build, span_bytes(x, w, bias) * 2


def _patch_form(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                device: torch.device) -> tuple[str, Callable[[], Callable[[], None]], int]:
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    rows, cols, order = n * (h // kh) * (wd // kw), c * kh * kw, Order.of(w)
    key = f"patch gemm {layout_text(x)} * {layout_text(w)} {x.dtype} {device}"

    def build() -> Callable[[], None]:
        tx, tw = random_like(x, device), random_like(w, device)
        tb = random_like(bias, device) if bias is not None else None
        patches = tx.view(n, c, h // kh, kh, wd // kw, kw).permute(order.patches)
        a = torch.empty(patches.shape, dtype=x.dtype, device=device)
        out = torch.empty(rows, o, dtype=x.dtype, device=device)
        wt = tw.permute(order.weight).reshape(o, cols).t()

        def run() -> None:
            a.copy_(patches)
            if tb is None:
                torch.mm(a.view(rows, cols), wt, out=out)
            else:
                torch.addmm(tb, a.view(rows, cols), wt, out=out)
        return run

    return key, build, span_bytes(x, w, bias) * 2 + rows * (cols + o) * x.element_size()


def _traced_backward(node: torch.fx.Node, device: torch.device
                     ) -> tuple[str, Callable[[], Callable[[], None]], int]:
    g, x, w = (a.meta["val"] for a in node.args[:3])
    sizes, stride, mask = node.args[3], list(node.args[4]), list(node.args[10])
    key = f"convolution_backward {layout_text(g)} {layout_text(x)} * {layout_text(w)} {mask} {x.dtype} {device}"

    def build() -> Callable[[], None]:
        tg, tx, tw = (random_like(t, device) for t in (g, x, w))
        return lambda: aten.convolution_backward(tg, tx, tw, sizes, stride, [0, 0], [1, 1], False, [0, 0], 1, mask)

    return key, build, span_bytes(g, x, w) * 2


def _patch_backward(node: torch.fx.Node, device: torch.device
                    ) -> tuple[str, Callable[[], Callable[[], None]], int]:
    """The gradients as GEMMs over the patches: ``grad_w = rows^T @ patches``, ``grad_x`` the patches of
    ``rows @ w`` put back in place; ``rows`` the output gradient as [N*Hp*Wp, O] (a copy unless its
    strides are channels-last)."""
    g, x, w = (a.meta["val"] for a in node.args[:3])
    mask = list(node.args[10])
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    hp, wp = h // kh, wd // kw
    rows_n, cols, order = n * hp * wp, c * kh * kw, Order.of(w)
    key = f"patch gemm backward {layout_text(g)} {layout_text(x)} * {layout_text(w)} {mask} {x.dtype} {device}"

    def build() -> Callable[[], None]:
        tg, tx, tw = (random_like(t, device) for t in (g, x, w))
        laid = tg.permute(0, 2, 3, 1)
        rows = laid.reshape(rows_n, o) if laid.is_contiguous() else torch.empty(rows_n, o, dtype=g.dtype, device=device)
        split = tx.view(n, c, hp, kh, wp, kw)
        patches = torch.empty(split.permute(order.patches).shape, dtype=x.dtype, device=device)
        wmat = tw.permute(order.weight).reshape(o, cols)
        gw = torch.empty(o, cols, dtype=x.dtype, device=device)
        gx_rows = torch.empty(rows_n, cols, dtype=x.dtype, device=device)
        gx = torch.empty(n, c, h, wd, dtype=x.dtype, device=device)

        def run() -> None:
            if not laid.is_contiguous():
                rows.view(n, hp, wp, o).copy_(laid)
            if mask[1]:
                patches.copy_(split.permute(order.patches))
                torch.mm(rows.t(), patches.view(rows_n, cols), out=gw)
            if mask[0]:
                torch.mm(rows, wmat, out=gx_rows)
                gx.view(split.shape).copy_(gx_rows.view(patches.shape).permute(_inverse(order.patches)))
        return run

    return key, build, span_bytes(g, x, w) * 2 + rows_n * (cols * 2 + o) * x.element_size()


# ------------------------------------------------------------------------------------------- rewrite
def _rewrite(graph: torch.fx.Graph, conv: torch.fx.Node, contiguous: bool) -> None:
    x, w, bias = conv.args[:3]
    n, _, h, wd = (int(s) for s in x.meta["val"].shape)
    o, _, kh, kw = (int(s) for s in w.meta["val"].shape)
    hp, wp = h // kh, wd // kw
    with graph.inserting_before(conv):
        a = _patch_rows(graph, x, w)
        wt = _call(graph, aten.t.default, _weight_matrix(graph, w))
        y = graph.call_function(aten.addmm.default, (bias, a, wt)) if bias is not None else \
            _call(graph, aten.mm.default, a, wt)
        result = _call(graph, aten.permute.default, _call(graph, aten.view.default, y, [n, hp, wp, o]), [0, 3, 1, 2])
        if contiguous:
            result = graph.call_function(aten.clone.default, (result,), {"memory_format": torch.contiguous_format})
    y.meta.update({k: v for k, v in conv.meta.items() if k != "val"})  # the source line, for comments
    conv.replace_all_uses_with(result)
    graph.erase_node(conv)


def _rewrite_backward(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """``convolution_backward`` ``node`` as GEMMs over the patches (``_patch_backward``'s steps)."""
    g, x, w = node.args[:3]
    mask = node.args[10]
    xv, wv = x.meta["val"], w.meta["val"]
    n, c, h, wd = (int(s) for s in xv.shape)
    o, _, kh, kw = (int(s) for s in wv.shape)
    hp, wp, order = h // kh, wd // kw, Order.of(wv)
    grads: dict[int, torch.fx.Node] = {}
    with graph.inserting_before(node):
        laid = _call(graph, aten.permute.default, g, [0, 2, 3, 1])
        if not g.meta["val"].permute(0, 2, 3, 1).is_contiguous():
            laid = graph.call_function(aten.clone.default, (laid,), {"memory_format": torch.contiguous_format})
        rows = _call(graph, aten.view.default, laid, [n * hp * wp, o])
        if mask[1]:
            gw = _call(graph, aten.mm.default, _call(graph, aten.t.default, rows), _patch_rows(graph, x, w))
            gw = _call(graph, aten.view.default, gw, [int(wv.shape[i]) for i in order.weight])
            grads[1] = gw if order.weight == (0, 1, 2, 3) else \
                _call(graph, aten.permute.default, gw, _inverse(order.weight))
        if mask[0]:  # laid out as aten lays the input's gradient out: channels-last where the weight is
            gx = _call(graph, aten.mm.default, rows, _weight_matrix(graph, w))
            split = [n, c, hp, kh, wp, kw]
            rows_back = _call(graph, aten.view.default, gx, [split[i] for i in order.patches])
            last = _channels_last(node.meta["val"][0])
            to = (0, 2, 3, 4, 5, 1) if last else (0, 1, 2, 3, 4, 5)  # of the split dims, in memory order
            back = _call(graph, aten.permute.default, rows_back, [order.patches.index(d) for d in to])
            put = graph.call_function(aten.clone.default, (back,), {"memory_format": torch.contiguous_format})
            grads[0] = _call(graph, aten.permute.default, _call(graph, aten.view.default, put, [n, h, wd, c]),
                             [0, 3, 1, 2]) if last else _call(graph, aten.view.default, put, [n, c, h, wd])
    for grad in grads.values():
        grad.meta.update({k: v for k, v in node.meta.items() if k != "val"})  # the source line, for comments
    for user in list(node.users):
        if user.users:
            user.replace_all_uses_with(grads[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


def _channels_last(t: torch.Tensor) -> bool:
    return not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _patch_rows(graph: torch.fx.Graph, x: torch.fx.Node, w: torch.fx.Node) -> torch.fx.Node:
    """The patches of ``x`` as rows [N*Hp*Wp, C*kh*kw], their columns in ``w``'s order: one copy."""
    n, c, h, wd = (int(s) for s in x.meta["val"].shape)
    _, _, kh, kw = (int(s) for s in w.meta["val"].shape)
    split = _call(graph, aten.view.default, x, [n, c, h // kh, kh, wd // kw, kw])
    rows = _call(graph, aten.permute.default, split, list(Order.of(w.meta["val"]).patches))
    laid = graph.call_function(aten.clone.default, (rows,), {"memory_format": torch.contiguous_format})
    return _call(graph, aten.view.default, laid, [n * (h // kh) * (wd // kw), c * kh * kw])


def _weight_matrix(graph: torch.fx.Graph, w: torch.fx.Node) -> torch.fx.Node:
    """``w`` as the [O, C*kh*kw] matrix of its memory order (a view)."""
    wv = w.meta["val"]
    order = Order.of(wv)
    if order.weight != (0, 1, 2, 3):
        w = _call(graph, aten.permute.default, w, list(order.weight))
    return _call(graph, aten.view.default, w, [int(wv.shape[0]), math.prod(int(s) for s in wv.shape[1:])])


def _call(graph: torch.fx.Graph, target: object, *args: object) -> torch.fx.Node:
    return graph.call_function(target, args)

