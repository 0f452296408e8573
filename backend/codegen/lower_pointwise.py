"""Lowerings of pointwise aten ops: arithmetic, comparisons, logic, ``where``, casts, unary math,
constants (``full``, ``scalar_tensor``, ``arange``), and allocations (``empty_strided`` and friends).

An allocation is a buffer ``call`` allocates and no kernel fills. Where its only users are ``copy``s
into it (``copy(new_empty_strided(...), grad)``: how accumulate-grad clones a gradient with the
parameter's strides, in every compiled-autograd backward), nothing reads it at all: it is left
unmaterialized and vanishes, and the ``copy`` is the source written with the node's strides and
dtype, fused with the source's producer or consumer.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from cgtrees.codegen import ir
from cgtrees.codegen.ir import Const, IndexValue, Op
from cgtrees.codegen.lowering import (
    CannotLower,
    LowerCtx,
    TensorValue,
    broadcast,
    cast,
    compute_dtype,
    lowering,
    meta_size,
    pointwise,
    promoted,
    reads_values,
)

aten = torch.ops.aten


# ------------------------------------------------------------------------------------ unary math
UNARY_FLOAT = {  # the result is floating point (integers are promoted first)
    aten.exp: "exp", aten.exp2: "exp2", aten.log: "log", aten.log2: "log2", aten.log10: "log10",
    aten.sqrt: "sqrt", aten.rsqrt: "rsqrt", aten.sin: "sin", aten.cos: "cos", aten.tan: "tan",
    aten.tanh: "tanh", aten.sigmoid: "sigmoid", aten.erf: "erf", aten.log1p: "log1p", aten.expm1: "expm1",
    aten.asin: "asin", aten.acos: "acos", aten.atan: "atan", aten.sinh: "sinh", aten.cosh: "cosh",
    aten.asinh: "asinh", aten.acosh: "acosh", aten.atanh: "atanh", aten.reciprocal: "reciprocal",
}
UNARY_ROUNDING = {aten.floor: "floor", aten.ceil: "ceil", aten.trunc: "trunc", aten.round: "round"}


def _unary(name: str):
    def lower(ctx: LowerCtx, x: TensorValue) -> TensorValue:
        return pointwise(ctx, name, [x])

    return lower


for _op, _name in UNARY_FLOAT.items():
    lowering(_op.default)(_unary(_name))


def _rounding(name: str):
    def lower(ctx: LowerCtx, x: TensorValue) -> TensorValue:
        if not x.dtype.is_floating_point:  # rounding an integer is the identity
            return TensorValue(x.size, x.dtype, x.body, x.view)
        return pointwise(ctx, name, [x])

    return lower


for _op, _name in UNARY_ROUNDING.items():
    lowering(_op.default)(_rounding(_name))


@lowering(aten.neg.default)
def _neg(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    return pointwise(ctx, "neg", [x])


@lowering(aten.abs.default)
def _abs(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    if x.dtype == torch.bool:
        return TensorValue(x.size, x.dtype, x.body, x.view)
    return pointwise(ctx, "abs", [x])


@lowering(aten.sign.default)
def _sign(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    if x.dtype == torch.bool:
        return TensorValue(x.size, x.dtype, x.body, x.view)
    return pointwise(ctx, "sign", [x])


@lowering(aten.relu.default)
def _relu(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    return pointwise(ctx, "fmax" if x.dtype.is_floating_point else "imax", [x, 0])


@lowering(aten.isnan.default)
def _isnan(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    return pointwise(ctx, "isnan", [x], compute=x.dtype)


@lowering(aten.isinf.default, can_lower=lambda n, c: None if n.args[0].meta["val"].is_floating_point()
          else "isinf of an integer tensor")
def _isinf(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    return pointwise(ctx, "isinf", [x], compute=x.dtype)


@lowering(aten.logical_not.default)
def _logical_not(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    return pointwise(ctx, "not", [x], compute=x.dtype)


@lowering(aten.bitwise_not.default)
def _bitwise_not(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    if x.dtype == torch.bool:
        return pointwise(ctx, "not", [x], compute=torch.bool)
    return pointwise(ctx, "invert", [x])


# ---------------------------------------------------------------------------------- binary arithmetic
def _with_alpha(ctx: LowerCtx, b: Any, alpha: Any) -> Any:
    if alpha is None or alpha == 1:
        return b
    if not isinstance(b, TensorValue):
        return b * alpha
    dtype = compute_dtype(ctx.out_meta().dtype)
    body = Op("mul", (cast(b.body, dtype), broadcast(alpha, (), dtype)), dtype)
    return TensorValue(b.size, dtype, body)


@lowering(aten.add.Tensor, aten.add.Scalar)
def _add(ctx: LowerCtx, a: Any, b: Any, alpha: Any = None) -> TensorValue:
    return pointwise(ctx, "add", [a, _with_alpha(ctx, b, alpha)])


@lowering(aten.sub.Tensor, aten.sub.Scalar)
def _sub(ctx: LowerCtx, a: Any, b: Any, alpha: Any = None) -> TensorValue:
    return pointwise(ctx, "sub", [a, _with_alpha(ctx, b, alpha)])


@lowering(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(ctx: LowerCtx, a: Any, b: Any, alpha: Any = None) -> TensorValue:
    return pointwise(ctx, "sub", [b, _with_alpha(ctx, a, alpha)])


@lowering(aten.mul.Tensor, aten.mul.Scalar)
def _mul(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
    if ctx.out_meta().dtype == torch.bool:
        return pointwise(ctx, "and", [a, b], compute=torch.bool)
    return pointwise(ctx, "mul", [a, b])


@lowering(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div(ctx: LowerCtx, a: Any, b: Any, rounding_mode: str | None = None) -> TensorValue:
    out = ctx.out_meta().dtype
    if rounding_mode is None:
        return pointwise(ctx, "truediv", [a, b])
    if out.is_floating_point and rounding_mode == "floor":
        return pointwise(ctx, "ffloordiv", [a, b])
    if out.is_floating_point:  # "trunc"
        size, compute = meta_size(ctx.out_meta()), compute_dtype(out)
        quotient = Op("truediv", (broadcast(a, size, compute), broadcast(b, size, compute)), compute)
        return TensorValue(size, out, cast(Op("trunc", (quotient,), compute), out))
    return pointwise(ctx, "ifloordiv" if rounding_mode == "floor" else "itruncdiv", [a, b])


@lowering(aten.remainder.Tensor, aten.remainder.Scalar)
def _remainder(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
    return pointwise(ctx, "fremainder" if ctx.out_meta().dtype.is_floating_point else "iremainder", [a, b])


@lowering(aten.fmod.Tensor, aten.fmod.Scalar)
def _fmod(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
    return pointwise(ctx, "ffmod" if ctx.out_meta().dtype.is_floating_point else "ifmod", [a, b])


def _minmax(kind: str):
    def lower(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
        out = ctx.out_meta().dtype
        if out == torch.bool:
            return pointwise(ctx, "or" if kind == "max" else "and", [a, b], compute=torch.bool)
        return pointwise(ctx, ("f" if out.is_floating_point else "i") + kind, [a, b])

    return lower


lowering(aten.maximum.default)(_minmax("max"))
lowering(aten.minimum.default)(_minmax("min"))


@lowering(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
          aten.clamp_min.Tensor, aten.clamp_max.Tensor)
def _clamp(ctx: LowerCtx, x: TensorValue, lo: Any = None, hi: Any = None) -> TensorValue:
    target = ctx.node.target
    if target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        lo, hi = None, lo
    out = ctx.out_meta().dtype
    if out == torch.bool:
        raise CannotLower("clamp of a bool tensor")
    prefix = "f" if out.is_floating_point else "i"
    value: Any = x
    if lo is not None:
        value = pointwise(ctx, prefix + "max", [value, lo])
    if hi is not None:
        value = pointwise(ctx, prefix + "min", [value, hi])
    return value


@lowering(aten.pow.Tensor_Scalar)
def _pow_scalar(ctx: LowerCtx, x: TensorValue, exponent: Any) -> TensorValue:
    special = {2: "square", 3: "cube", 0.5: "sqrt", -1: "reciprocal", -0.5: "rsqrt"}
    out = ctx.out_meta().dtype
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        if exponent == 1:
            return pointwise(ctx, "cast", [x]) if x.dtype != out else TensorValue(x.size, x.dtype, x.body, x.view)
        if exponent == 0:
            return pointwise(ctx, "cast", [1])
        if exponent in special and (out.is_floating_point or exponent in (2, 3)):
            return pointwise(ctx, special[exponent], [x])
    if not out.is_floating_point:
        raise CannotLower("integer pow")
    return pointwise(ctx, "pow", [x, exponent])


@lowering(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
    if not ctx.out_meta().dtype.is_floating_point:
        raise CannotLower("integer pow")
    return pointwise(ctx, "pow", [a, b])


@lowering(aten.atan2.default)
def _atan2(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
    return pointwise(ctx, "atan2", [a, b])


# ------------------------------------------------------------------------------ comparisons and logic
def _compare(name: str):
    def lower(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
        return pointwise(ctx, name, [a, b], compute=promoted(a, b))

    return lower


for _op, _name in {aten.eq: "eq", aten.ne: "ne", aten.lt: "lt", aten.le: "le", aten.gt: "gt", aten.ge: "ge"}.items():
    lowering(_op.Tensor, _op.Scalar)(_compare(_name))


def _logical(name: str):
    def lower(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
        return pointwise(ctx, name, [_truth(ctx, a), _truth(ctx, b)], compute=torch.bool)

    return lower


def _truth(ctx: LowerCtx, x: Any) -> Any:
    if not isinstance(x, TensorValue) or x.dtype == torch.bool:
        return x if isinstance(x, TensorValue) else bool(x)
    zero = broadcast(0, (), x.dtype)
    return TensorValue(x.size, torch.bool, Op("ne", (x.body, zero), torch.bool))


for _op, _name in {aten.logical_and: "and", aten.logical_or: "or", aten.logical_xor: "xor"}.items():
    lowering(_op.default)(_logical(_name))


def _bitwise(name: str):
    def lower(ctx: LowerCtx, a: Any, b: Any) -> TensorValue:
        return pointwise(ctx, name, [a, b])

    return lower


for _op, _name in {aten.bitwise_and: "and", aten.bitwise_or: "or", aten.bitwise_xor: "xor"}.items():
    lowering(_op.Tensor, _op.Scalar)(_bitwise(_name))
lowering(aten.bitwise_left_shift.Tensor)(_bitwise("lshift"))
lowering(aten.bitwise_right_shift.Tensor)(_bitwise("rshift"))


@lowering(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(ctx: LowerCtx, cond: Any, a: Any, b: Any) -> TensorValue:
    meta = ctx.out_meta()
    size = meta_size(meta)
    compute = compute_dtype(meta.dtype)
    c = broadcast(cond, size, torch.bool)
    body = Op("where", (c, broadcast(a, size, compute), broadcast(b, size, compute)), compute)
    return TensorValue(size, meta.dtype, cast(body, meta.dtype))


# ------------------------------------------------------------------------------------- casts, copies
def _same_device(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    device = node.kwargs.get("device")
    src = node.args[0].meta["val"].device
    if device is not None and torch.device(device) != src:
        return f"copy to another device ({src} -> {device})"
    return None


@lowering(aten._to_copy.default, can_lower=_same_device)
def _to_copy(ctx: LowerCtx, x: TensorValue, **kwargs: Any) -> TensorValue:
    out = ctx.out_meta().dtype
    return TensorValue(x.size, out, cast(x.body, out))


@lowering(aten.clone.default, aten.lift_fresh_copy.default, aten.alias.default, aten.detach.default)
def _clone(ctx: LowerCtx, x: TensorValue, **kwargs: Any) -> TensorValue:
    # A clone is a new buffer only where it is realized (its strides come from the node's meta).
    return TensorValue(x.size, x.dtype, x.body, x.view if ctx.node.target in _ALIASES else None)


_ALIASES = (aten.alias.default, aten.detach.default)


def _copy_same_device(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    dst, src = (a.meta["val"].device for a in node.args[:2])
    return None if dst == src else f"copy to another device ({src} -> {dst})"


@lowering(aten.copy.default, can_lower=_copy_same_device)
def _copy(ctx: LowerCtx, dst: TensorValue, src: Any, non_blocking: bool = False) -> TensorValue:
    # ``dst``'s values are never read (``reads_values`` relies on it): the result is ``src``
    # broadcast to ``dst``'s size and cast to its dtype; realized, it takes the node's (dst's) strides.
    meta = ctx.out_meta()
    return TensorValue(meta_size(meta), meta.dtype, broadcast(src, meta_size(meta), meta.dtype))


# ---------------------------------------------------------------------------------------- allocations
def _plain_allocation(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    if node.kwargs.get("pin_memory"):
        return "pinned memory"
    return _plain_device(node, ctx)


def _only_overwritten(node: torch.fx.Node) -> bool:
    """Whether every user of ``node`` only takes its metadata (``copy`` into it, ``new_empty``...)."""
    return bool(node.users) and not any(reads_values(user, node) for user in node.users)


@lowering(aten.empty_strided.default, aten.new_empty_strided.default, aten.new_empty.default,
          aten.empty.memory_format, aten.empty_like.default, aten.empty_permuted.default,
          can_lower=_plain_allocation)
def _empty(ctx: LowerCtx, *args: Any, **kwargs: Any) -> TensorValue:
    meta = ctx.out_meta()
    if _only_overwritten(ctx.node):  # never read, never returned: no buffer at all
        return TensorValue(meta_size(meta), meta.dtype, broadcast(0, (), meta.dtype))
    return ctx.allocate()


# ---------------------------------------------------------------------------------------- constants
def _plain_device(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.layout != torch.strided:
        return "not a strided tensor"
    return None


@lowering(aten.full.default, can_lower=_plain_device)
def _full(ctx: LowerCtx, size: Any, value: Any, **kwargs: Any) -> TensorValue:
    meta = ctx.out_meta()
    return TensorValue(meta_size(meta), meta.dtype, broadcast(value, (), meta.dtype))


@lowering(aten.full_like.default, can_lower=_plain_device)
def _full_like(ctx: LowerCtx, x: TensorValue, value: Any, **kwargs: Any) -> TensorValue:
    meta = ctx.out_meta()  # its strides (memory_format) are the node's, as every realized value's
    return TensorValue(meta_size(meta), meta.dtype, broadcast(value, (), meta.dtype))


@lowering(aten.scalar_tensor.default, can_lower=_plain_device)
def _scalar_tensor(ctx: LowerCtx, value: Any, **kwargs: Any) -> TensorValue:
    meta = ctx.out_meta()
    return TensorValue((), meta.dtype, broadcast(value, (), meta.dtype))


@lowering(aten.fill.Scalar)
def _fill(ctx: LowerCtx, x: TensorValue, value: Any) -> TensorValue:
    meta = ctx.out_meta()
    return TensorValue(meta_size(meta), meta.dtype, broadcast(value, (), meta.dtype))


@lowering(aten.arange.start_step, aten.arange.start, aten.arange.default, can_lower=_plain_device)
def _arange(ctx: LowerCtx, *args: Any, **kwargs: Any) -> TensorValue:
    meta = ctx.out_meta()
    numbers = [a for a in args if not isinstance(a, (torch.dtype, torch.device))]
    start, step = (0, 1) if len(numbers) == 1 else (numbers[0], numbers[2] if len(numbers) > 2 else 1)
    x0 = ir.index_symbol(0)
    if meta.dtype.is_floating_point or any(isinstance(v, float) for v in (start, step)):
        compute = compute_dtype(meta.dtype) if meta.dtype.is_floating_point else torch.float64
        i = Op("cast", (IndexValue(x0, torch.int64),), compute)
        body = Op("add", (Op("mul", (i, Const(float(step), compute)), compute), Const(float(start), compute)),
                  compute)
        return TensorValue(meta_size(meta), meta.dtype, cast(body, meta.dtype))
    index = sympy.Integer(int(start)) + int(step) * x0 if not isinstance(start, sympy.Expr) else start + step * x0
    return TensorValue(meta_size(meta), meta.dtype, cast(IndexValue(index, torch.int64), meta.dtype))
