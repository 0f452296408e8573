"""The lowering table: ``@lowering(aten.op, ...)`` registers how an aten op becomes IR values.

A lowering receives a ``LowerCtx`` (the state of the graph being lowered, passed explicitly), the
FX node, and the node's arguments with every FX node replaced by its lowered value (a
``TensorValue``, a python scalar, or a sympy expression for a SymInt). It returns a ``TensorValue``
(or a tuple of them). Broadcasting and dtype promotion live here, once, in ``pointwise()``.

An op is lowered when it is in the table and its ``can_lower`` check passes (dtypes we generate
code for, and the op's own check); anything else becomes an aten call with the reason logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx

from cgtrees.codegen import ir, ops
from cgtrees.codegen.ir import Const, Expr, Load, Op

aten = torch.ops.aten

SUPPORTED_DTYPES = frozenset({
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
})
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TensorValue:
    """A lowered tensor: how to compute element ``(x0, x1, ...)`` of a tensor of ``size``.

    ``view`` is set when the value is exactly a strided view of a materialized buffer
    ``(buffer name, layout relative to that buffer's data pointer)``: such a value can be handed to
    aten or returned without computing anything.
    """

    size: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    body: Expr
    view: tuple[str, ir.Layout] | None = None


class CannotLower(Exception):
    """Raised by a lowering that finds, while lowering, that this node must run through aten."""


LoweringFn = Callable[..., Any]
CanLowerFn = Callable[[torch.fx.Node, "LowerCtx"], "str | None"]


@dataclass(frozen=True)
class Entry:
    fn: LoweringFn
    can_lower: CanLowerFn | None


LOWERINGS: dict[Any, Entry] = {}


def lowering(*ops: Any, can_lower: CanLowerFn | None = None) -> Callable[[LoweringFn], LoweringFn]:
    """Register ``fn`` for every overload in ``ops`` (an OpOverloadPacket registers all overloads)."""

    def register(fn: LoweringFn) -> LoweringFn:
        for op in ops:
            overloads = [getattr(op, name) for name in op.overloads()] if hasattr(op, "overloads") else [op]
            for overload in overloads:
                LOWERINGS[overload] = Entry(fn, can_lower)
        return fn

    return register


def why_not_lowered(node: torch.fx.Node, ctx: "LowerCtx") -> str | None:
    """``None`` when ``node`` can be lowered, else the reason it runs through aten."""
    entry = LOWERINGS.get(node.target)
    if entry is None:
        return f"no lowering for {node.target}"
    for value in _meta_tensors(node):
        if value.dtype not in SUPPORTED_DTYPES:
            return f"dtype {value.dtype} is not generated"
    for arg in node.all_input_nodes:
        for value in _meta_tensors(arg):
            if value.dtype not in SUPPORTED_DTYPES:
                return f"input dtype {value.dtype} is not generated"
    if entry.can_lower is not None:
        return entry.can_lower(node, ctx)
    return None


def _meta_tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [v for v in vals if isinstance(v, torch.Tensor)]


class LowerCtx:
    """What lowerings may use: the node being lowered, mode flags, and the program being built.

    ``builder`` is the graph lowerer (``cgtrees.codegen.graph``): it owns buffers and steps.
    ``unfuse_addmm``: the config's option of that name (``lower_addmm``).
    """

    def __init__(self, interpret: bool, builder: Any, unfuse_addmm: bool = True) -> None:
        self.interpret = interpret
        self.builder = builder
        self.unfuse_addmm = unfuse_addmm
        self.node: torch.fx.Node | None = None

    def realize(self, value: TensorValue) -> TensorValue:
        """Materialize ``value`` into a buffer (named after the current node) and return a view of it."""
        if value.view is not None:
            return value
        return self.builder.realize(value, self.node)

    def realize_input(self, value: TensorValue) -> TensorValue:
        """Materialize an argument of the current node (a view of it needs a buffer)."""
        if value.view is not None:
            return value
        return self.builder.realize_input(value, self.node)

    def in_place_target(self) -> TensorValue | None:
        """The current node's first argument, where the node may write into it in place (see
        ``GraphBuilder.in_place_target``), else None."""
        return self.builder.in_place_target(self.node)

    def fresh(self, value: TensorValue, suffix: str = "") -> TensorValue:
        """A new buffer holding ``value``, even where ``value`` is a buffer already (a scatter then
        writes into it): named after the current node (plus ``suffix``), laid out as its result
        where the suffix is empty, else contiguous."""
        return self.builder.realize(TensorValue(value.size, value.dtype, value.body), self.node, suffix=suffix,
                                    share=False)

    def scatter_into(self, buf: str, dtype: torch.dtype, ranges: tuple[sympy.Expr, ...], body: Expr,
                     where: ir.Scatter) -> None:
        """Add a step that writes ``body`` (over ``ranges``) into buffer ``buf`` where ``where`` says."""
        self.builder.add_scatter(buf, dtype, ranges, body, where)

    def add_reduction(self, name: str, layout: ir.Layout, dtype: torch.dtype, ranges: tuple[sympy.Expr, ...],
                      reduced: tuple[int, ...], kind: ir.Reduce, body: Expr) -> TensorValue:
        """Add a reduction step writing a new buffer; returns the buffer as a value."""
        return self.builder.add_reduction(name, layout, dtype, ranges, reduced, kind, body, self.node)

    def library_call(self, target: Any, args: tuple, val: torch.Tensor, suffix: str) -> TensorValue:
        """Call library op ``target`` (``aten.mm``) on ``args`` (FX nodes or plain values) through
        aten: a buffer named after the current node plus ``suffix``, laid out as ``val`` (its meta)."""
        return self.builder.library_call(self.node, target, args, val, self.node.name + suffix)

    def allocate(self) -> TensorValue:
        """A new buffer laid out as the current node's result, allocated and never filled: the
        value of ``empty_strided`` and friends (no kernel; whoever reads it reads garbage, as in eager)."""
        meta = self.out_meta()
        return self.builder.add_empty(self.node, meta_layout(meta), meta.dtype, meta.device)

    def meta_offset(self, buf: str) -> sympy.Expr:
        """The storage offset (in the node metas) of the tensor that buffer ``buf`` points at."""
        return self.builder.meta_offsets[buf]

    def out_meta(self, i: int | None = None) -> torch.Tensor:
        val = self.node.meta["val"]
        return val[i] if i is not None else val


# Ops that read the tensor in their first argument for its metadata only (size, strides, dtype,
# device), never its values: our lowerings of them never look at its body.
METADATA_FIRST = frozenset({
    aten.copy.default,  # copy(self, src): self says where src goes
    aten.new_empty_strided.default, aten.new_empty.default, aten.empty_like.default, aten.full_like.default,
})


def reads_values(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether ``user`` reads the values of ``node`` (not only its size, strides, dtype, device): a
    value read only for its metadata is no reason to write it to memory."""
    if user.target in METADATA_FIRST and user.args and user.args[0] is node:
        return node in user.args[1:] or node in user.kwargs.values()
    return True


# ---------------------------------------------------------------------------------------- helpers
def sym(value: Any) -> sympy.Expr:
    """A python int, SymInt or sympy expression as a sympy expression."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    if isinstance(value, sympy.Expr):
        return value
    return sympy.Integer(int(value))


def meta_size(t: torch.Tensor) -> tuple[sympy.Expr, ...]:
    return tuple(sym(s) for s in t.shape)


def meta_layout(t: torch.Tensor) -> ir.Layout:
    return ir.Layout(meta_size(t), tuple(sym(s) for s in t.stride()), sympy.Integer(0))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types compute in float32 (and reductions accumulate in it)."""
    return torch.float32 if dtype in HALF else dtype


def cast(expr: Expr, dtype: torch.dtype) -> Expr:
    src = expr_dtype(expr)
    if src == dtype:
        return expr
    if isinstance(expr, Const) and not isinstance(expr.value, sympy.Expr):
        return const(_py_cast(expr.value, dtype), dtype)
    # Eager converts to and from bfloat16 through float32 (c10::BFloat16 holds a float), rounding
    # to nearest even; Triton's interpreter casts bfloat16 to anything but float32 as its raw
    # uint16 bits, and truncates float32 to bfloat16 (``to_bf16`` rounds there as eager does).
    if dtype == torch.bfloat16:
        return Op("to_bf16", (cast(expr, torch.float32),), dtype)
    if src == torch.bfloat16 and dtype != torch.float32:
        return Op("cast", (Op("cast", (expr,), torch.float32),), dtype)
    return Op("cast", (expr,), dtype)


def _py_cast(value: Any, dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    return int(value)


def expr_dtype(expr: Expr) -> torch.dtype:
    return expr.dtype


def broadcast(value: Any, size: tuple[sympy.Expr, ...], dtype: torch.dtype | None = None) -> Expr:
    """``value`` (tensor or scalar) as an element of a tensor of ``size``, indexed by x0, x1, ..."""
    if not isinstance(value, TensorValue):
        return scalar(value, dtype)
    syms = ir.index_symbols(len(size))
    lead = len(size) - len(value.size)
    subs = {}
    for j, n in enumerate(value.size):
        own = ir.index_symbol(j)
        subs[own] = sympy.Integer(0) if (n == 1 and size[lead + j] != 1) else syms[lead + j]
    body = ir.map_indices(value.body, _fresh(subs))
    return body if dtype is None else cast(body, dtype)


def _fresh(subs: dict) -> dict:
    """Substitute through temporary symbols so that ``x0 -> x1, x1 -> x0`` does not collide."""
    return dict(subs)  # xreplace substitutes simultaneously, so a plain dict is already safe


def scalar(value: Any, dtype: torch.dtype | None) -> Expr:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        value = value.node.expr
    if isinstance(value, sympy.Expr) and value.is_number:
        value = int(value) if value.is_integer else float(value)
    if dtype is None:
        dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float32
    if isinstance(value, sympy.Expr):
        return cast(Const(value, torch.int64), dtype)
    return const(_py_cast(value, dtype), dtype)


def const(value: Any, dtype: torch.dtype) -> Expr:
    """A python scalar as an element of ``dtype``. Triton types a float literal as float32, so
    where literals meet only each other (``0.4 - 1.0``, ``tl.where(c, 0.4, -0.6)``) a float64 graph
    would compute in float32: a float64 constant is a float64 value in the kernel instead."""
    if dtype == torch.float64 and isinstance(value, float):
        return Op("fp64_const", (Const(value, dtype),), dtype)
    return Const(value, dtype)


def pointwise(ctx: LowerCtx, name: str, args: list[Any], *, compute: torch.dtype | None = None,
              out: torch.dtype | None = None) -> TensorValue:
    """Apply op ``name`` elementwise, with eager's broadcasting and promotion (result: node meta)."""
    if ops.template(name, ctx.interpret) is None:
        raise CannotLower(f"op {name!r} has no {'interpreter' if ctx.interpret else 'Triton'} form")
    meta = ctx.out_meta()
    size = meta_size(meta)
    out = out or meta.dtype
    compute = compute_dtype(compute or out)
    if compute == torch.bool and name in ARITHMETIC:
        compute = torch.int32  # bool + bool is computed on integers, then cast back (nonzero)
    exprs = tuple(broadcast(a, size, compute) for a in args)
    result_dtype = torch.bool if name in BOOL_RESULT else compute
    return TensorValue(size, out, cast(Op(name, exprs, result_dtype), out))


ARITHMETIC = frozenset({"add", "sub", "mul", "neg", "abs", "imax", "imin"})
BOOL_RESULT = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "not"})


def promoted(*args: Any) -> torch.dtype:
    """Eager's result type of ``args`` (tensors via their dtype, python scalars weakly)."""
    metas = []
    for a in args:
        if isinstance(a, TensorValue):
            metas.append(torch.empty((1,) * len(a.size) if a.size else (), dtype=a.dtype, device="meta"))
        elif isinstance(a, (torch.SymInt, sympy.Expr)):
            metas.append(1)
        elif isinstance(a, torch.SymFloat):
            metas.append(1.0)
        else:
            metas.append(a)
    if len(metas) == 1:
        return metas[0].dtype if isinstance(metas[0], torch.Tensor) else torch.tensor(metas[0]).dtype
    out = torch.result_type(metas[0], metas[1])
    for m in metas[2:]:
        out = torch.promote_types(out, torch.result_type(m, torch.empty((), dtype=out, device="meta")))
    return out


def load_buffer(name: str, layout: ir.Layout, dtype: torch.dtype) -> TensorValue:
    syms = ir.index_symbols(len(layout.size))
    return TensorValue(layout.size, dtype, Load(name, layout.index(syms), dtype), view=(name, layout))


# Ops handed to a vendor library or to torch on purpose (matmul, convolution and attention go to cuBLAS
# and cuDNN; random ops to torch's generators, so replays draw fresh values). Every other aten call in a
# kernel module is a gap in our lowerings, counted apart.
_LIBRARY_PREFIXES = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
                     "aten::convolution", "aten::cudnn_convolution", "aten::_convolution",
                     "aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash_attention",
                     "aten::_efficient_attention", "aten::_cudnn_attention",
                     "aten::rand", "aten::randn", "aten::randint", "aten::bernoulli", "aten::native_dropout",
                     "aten::normal", "aten::uniform", "aten::exponential", "aten::multinomial",
                     "cgtrees::")  # our own library ops (codegen/grouped_gemv.py, gemv_silu_mul.py)


def is_library_op(target: Any) -> bool:
    """Whether an aten call is deliberate (a library kernel or a random op), not a missing lowering."""
    name = target.name() if isinstance(target, torch._ops.OpOverload) else str(target)
    return name.startswith(_LIBRARY_PREFIXES)
