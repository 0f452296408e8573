"""A row's max and its sum of exponentials in one pass: softmax's statistics over a long row.

Softmax, log-softmax and a cross-entropy's log-sum-exp decompose into ``m = max(a)`` and
``s = sum(exp(a - m))`` over a row (``aot/decompositions.py``). A row that fits a block is held in
registers and reduced twice there. A longer row (a language model's 50257 logits) is walked in a
loop of ``RBLOCK`` columns, and as written the sum needs the finished max: two loops, each reading
the row from memory. Reduced online they are one loop: every lane keeps a running max ``m_i`` and the
sum ``s_i`` of ``exp(a - m_i)`` over what it saw, rescaled when its max grows,

    m' = max(m_i, a)        s' = s_i * exp(m_i - m') + exp(a - m')

and after the loop the lanes combine: ``m = max_i m_i``, ``s = sum_i s_i * exp(m_i - m)``. The kernel
writer (``kernel.py``) does this for each pair ``pairs`` finds in a looped kernel.

Infinities and NaN come out as the two loops give them. Where a lane's max is still ``-inf`` (it has
seen only ``-inf``: a masked logit, or nothing yet), ``exp(-inf - -inf)`` would be NaN, so the shift
is taken as 0 there and the lane's sum stays 0; a row of ``-inf`` only has ``m = -inf``, ``s = 0``
(two loops: NaN, then whatever reads ``a - m`` is NaN either way). A ``+inf`` or a NaN makes the
sum NaN, as ``exp(inf - inf)`` does in two loops.

Such a pair is not split in two stages over a row's chunks (``heuristics.split_reduction``, for
few long rows): its max and sum would be two split reductions, the difference ``a - m`` that both
the sum and the output read a buffer between them, six kernels where one does (``in_softmax``).
"""

from __future__ import annotations

import torch
import torch.fx

from cgtrees.codegen import ir

aten = torch.ops.aten

_NEG_INF = 'float("-inf")'


def pairs(members: tuple, bodies: dict[str, ir.Expr]) -> dict[str, str]:
    """``{sum member: max member}`` for each sum over ``exp(a - m)`` where ``m`` is a max member of
    the same kernel over the same ``a`` (after the kernel's member loads became ``Ref``s)."""
    maxima = {m.name: m for m in members if m.role == "reduce" and m.step.reduction == ir.Reduce.MAX}
    out = {}
    for m in members:
        if m.role != "reduce" or m.step.reduction != ir.Reduce.SUM:
            continue
        partner = _partner(bodies[m.name])
        if partner is None or partner.name not in maxima:
            continue
        top = maxima[partner.name]
        a = bodies[m.name].args[0].args[0]
        if bodies[top.name] == a and a.dtype.is_floating_point and top.step.dtype == a.dtype == m.step.body.dtype:
            out[m.name] = top.name
    return out


def _partner(body: ir.Expr) -> ir.Ref | None:
    """``m`` where ``body`` is ``exp(a - m)``, a member's row value."""
    if not (isinstance(body, ir.Op) and body.name == "exp"):
        return None
    inner = body.args[0]
    if not (isinstance(inner, ir.Op) and inner.name == "sub" and isinstance(inner.args[1], ir.Ref)):
        return None
    return inner.args[1]


def shift(m: str) -> str:
    """What exponents are taken against: the max, or 0 where it is ``-inf`` (nothing but ``-inf`` seen)."""
    return f"tl.where({m} == {_NEG_INF}, 0.0, {m})"


def grown(acc_m: str, a: str) -> str:
    """A lane's new running max (NaN once it saw a NaN, as the max reduction propagates it)."""
    return f"tl.maximum({acc_m}, {a}, propagate_nan=tl.PropagateNan.ALL)"


def rescaled(acc_m: str, acc_s: str, a: str, shifted: str) -> str:
    """A lane's new running sum: its old sum moved to the new max ``shifted``, plus ``exp(a - new)``."""
    return f"{acc_s} * tl.exp({acc_m} - {shifted}) + tl.exp({a} - {shifted})"


def total(acc_m: str, acc_s: str, shifted: str) -> str:
    """The row's sum from its lanes' running maxima and sums (``shifted``: the row's ``shift``)."""
    return f"tl.sum({acc_s} * tl.exp({acc_m} - {shifted}), 1)[:, None]"


def in_softmax(node: torch.fx.Node) -> bool:
    """Whether an ``amax`` or ``sum`` node is a softmax's max or sum of exponentials: ``m =
    amax(x, d)`` read by ``sub(x, m)``, whose ``exp`` is summed over ``d`` (the decompositions'
    form of softmax, log-softmax and a cross-entropy's log-sum-exp)."""
    if node.target == aten.sum.dim_IntList:
        e = node.args[0]
        sub = e.args[0] if _is(e, aten.exp.default) else None
        top = sub.args[1] if _is(sub, aten.sub.Tensor) else None
        return _is(top, aten.amax.default) and _softmax_max(top)
    return _is(node, aten.amax.default) and _softmax_max(node)


def _softmax_max(top: torch.fx.Node) -> bool:
    x, dims = top.args[0], _dims(top)
    for sub in top.users:
        if not (_is(sub, aten.sub.Tensor) and sub.args[0] is x and sub.args[1] is top):
            continue
        for e in sub.users:
            if _is(e, aten.exp.default) and any(_is(s, aten.sum.dim_IntList) and _dims(s) == dims for s in e.users):
                return True
    return False


def _is(node: object, target: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def _dims(node: torch.fx.Node) -> tuple[int, ...] | None:
    """A reduction's dimensions, non-negative (None: every dimension)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    val = node.args[0].meta.get("val")
    if dims is None or not isinstance(val, torch.Tensor):
        return None
    dims = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(d % max(val.dim(), 1) for d in dims))
