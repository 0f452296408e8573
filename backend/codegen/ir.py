"""The codegen IR: frozen dataclasses, no closures, so a program is printable, hashable and picklable.

Two layers:

- *Values* (``Expr`` subclasses) describe how ONE element is computed, as a tree over index symbols
  ``x0, x1, ...`` (one per dimension of the iteration space). ``Load`` reads a buffer at a sympy
  index, ``Const`` is a scalar, ``IndexValue`` is an index expression used as data (``arange``),
  ``Op`` applies an entry of ``cgtrees.codegen.ops.OPS``, ``Indirect`` is an index read from data
  (``embedding``'s token ids), range-checked.
- A ``Load`` may read where a condition holds only (``mask``: ``cat`` and ``constant_pad_nd`` read
  each input only inside its own range, 0 elsewhere), and its index may hold indirect symbols
  ``ind0, ind1, ...``, bound to the ``Indirect`` values in its ``indirect`` (a gather: ``weight[ids[x0],
  x1]`` is ``Load(weight, 32*ind0 + x1, indirect=(Indirect(Load(ids, x0), 100),))``).
- *Steps* (``Compute``, ``Extern``, ``Alias``) form the straight-line program that ``call(args)``
  runs: a ``Compute`` fills a buffer (pointwise, or a reduction over some dimensions), an ``Extern``
  calls an aten op, an ``Alias`` is a strided view of an existing buffer.

Index and size expressions are sympy expressions; symbolic sizes (``s0``...) stay symbolic.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Union

import sympy
import torch

Index = sympy.Expr


def index_symbol(i: int, prefix: str = "x") -> sympy.Symbol:
    """The symbol of dimension ``i`` of an iteration space (integer, non-negative)."""
    return sympy.Symbol(f"{prefix}{i}", integer=True, nonnegative=True)


def index_symbols(n: int, prefix: str = "x") -> tuple[sympy.Symbol, ...]:
    return tuple(index_symbol(i, prefix) for i in range(n))


# ---------------------------------------------------------------------------------------- values
def indirect_symbol(k: int) -> sympy.Symbol:
    """The symbol that stands for ``load.indirect[k]`` in a load's index."""
    return sympy.Symbol(f"ind{k}", integer=True)


def is_kernel_symbol(s: sympy.Symbol) -> bool:
    """An index symbol (``x0``, ``r0``, ``ind0``), not a size (``s0``, ``u0``)."""
    name = s.name
    return (name[:1] in ("x", "r") and name[1:].isdigit()) or (name[:3] == "ind" and name[3:].isdigit())


@dataclass(frozen=True)
class Load:
    """``buf[index]``. Where ``mask`` (a bool value) is given, only where it holds (0 elsewhere, and
    nothing is read there). ``index`` may use ``indirect_symbol(k)`` for ``indirect[k]``."""

    buf: str
    index: Index
    dtype: torch.dtype
    mask: "Expr | None" = None
    indirect: tuple["Indirect", ...] = ()


@dataclass(frozen=True, eq=False)
class Const:
    """A scalar. Two are equal when they are written the same: ``0.0`` and ``-0.0`` differ (``x + 0.0``
    is not ``x + -0.0``), ``1`` and ``1.0`` and ``True`` differ, a NaN equals itself (dataclass
    equality compares values with ``==``, which gets all three wrong for a kernel's caches)."""

    value: Any  # bool | int | float | sympy.Expr (a symbolic size used as data)
    dtype: torch.dtype

    def _key(self) -> tuple:
        v = self.value
        return (float, struct.pack("<d", v), self.dtype) if isinstance(v, float) else (type(v), v, self.dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Const) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True)
class IndexValue:
    index: Index
    dtype: torch.dtype


@dataclass(frozen=True)
class Op:
    name: str  # a key of cgtrees.codegen.ops.OPS
    args: tuple["Expr", ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Indirect:
    """An integer value used as an index into a dimension of ``size`` elements, as int64. Negative
    values count from the end where ``wrap`` (``x[idx]``; ``gather`` and ``embedding`` do not wrap).
    Kernels assert ``0 <= index < size`` (where ``mask`` holds) and mask the loads that use it, so an
    index out of range never reads memory: it raises, as eager does."""

    value: "Expr"
    size: Index
    wrap: bool
    mask: "Expr | None" = None
    dtype: torch.dtype = torch.int64


@dataclass(frozen=True)
class Ref:
    """Inside a fused kernel: the per-row value of another member (a reduction result)."""

    name: str
    dtype: torch.dtype


Expr = Union[Load, Const, IndexValue, Op, Indirect, Ref]


def children(expr: Expr) -> tuple[Expr, ...]:
    """The values ``expr`` is computed from (an op's arguments, a load's mask and indirect indices)."""
    if isinstance(expr, Op):
        return expr.args
    if isinstance(expr, Load):
        return ((expr.mask,) if expr.mask is not None else ()) + expr.indirect
    if isinstance(expr, Indirect):
        return (expr.value,) + ((expr.mask,) if expr.mask is not None else ())
    return ()


def map_children(expr: Expr, fn: Any) -> Expr:
    """``expr`` with ``fn`` applied to each of its ``children``."""
    if isinstance(expr, Op):
        return Op(expr.name, tuple(fn(a) for a in expr.args), expr.dtype)
    if isinstance(expr, Load) and (expr.mask is not None or expr.indirect):
        mask = fn(expr.mask) if expr.mask is not None else None
        return Load(expr.buf, expr.index, expr.dtype, mask, tuple(fn(i) for i in expr.indirect))
    if isinstance(expr, Indirect):
        mask = fn(expr.mask) if expr.mask is not None else None
        return Indirect(fn(expr.value), expr.size, expr.wrap, mask, expr.dtype)
    return expr


def walk(expr: Expr) -> list[Expr]:
    """``expr`` and every value below it, parents first."""
    out = [expr]
    for child in children(expr):
        out += walk(child)
    return out


def map_indices(expr: Expr, subs: dict) -> Expr:
    """Substitute index symbols in every index expression of ``expr`` (views, broadcasting)."""
    expr = map_children(expr, lambda e: map_indices(e, subs))
    if isinstance(expr, Load):
        index = sympy.expand(sympy.sympify(expr.index).xreplace(subs))
        return Load(expr.buf, index, expr.dtype, expr.mask, expr.indirect)
    if isinstance(expr, IndexValue):
        return IndexValue(sympy.expand(sympy.sympify(expr.index).xreplace(subs)), expr.dtype)
    return expr


def mask_loads(expr: Expr, cond: Expr) -> Expr:
    """``expr`` with every load (and index check) in it done only where ``cond`` holds."""
    expr = map_children(expr, lambda e: mask_loads(e, cond))
    if isinstance(expr, Load):
        mask = cond if expr.mask is None else Op("and", (expr.mask, cond), torch.bool)
        return Load(expr.buf, expr.index, expr.dtype, mask, expr.indirect)
    if isinstance(expr, Indirect):
        mask = cond if expr.mask is None else Op("and", (expr.mask, cond), torch.bool)
        return Indirect(expr.value, expr.size, expr.wrap, mask, expr.dtype)
    return expr


def loads(expr: Expr) -> list[Load]:
    """Every ``Load`` in ``expr``, in first-use order (duplicates kept once)."""
    return list(dict.fromkeys(e for e in walk(expr) if isinstance(e, Load)))


def size_of(expr: Expr) -> int:
    """Number of nodes in the expression tree (used to decide when to stop inlining)."""
    return len(walk(expr))


# ---------------------------------------------------------------------------------------- buffers
@dataclass(frozen=True)
class Layout:
    size: tuple[Index, ...]
    stride: tuple[Index, ...]
    offset: Index = sympy.Integer(0)

    def index(self, syms: tuple[sympy.Expr, ...]) -> Index:
        """Flat element offset of the element at ``syms`` (size-1 dims never contribute)."""
        terms = [s * st for s, st, n in zip(syms, self.stride, self.size) if n != 1]
        return sympy.expand(sympy.Add(self.offset, *terms))


def contiguous_strides(size: tuple[Index, ...]) -> tuple[Index, ...]:
    strides, acc = [], sympy.Integer(1)
    for n in reversed(size):
        strides.append(acc)
        acc = acc * sympy.Max(n, 1) if not isinstance(n, (int, sympy.Integer)) else acc * max(int(n), 1)
    return tuple(reversed(strides))


class Reduce(enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    ARGMAX = "argmax"
    ARGMIN = "argmin"
    ANY = "any"
    CUMSUM = "cumsum"  # scans: one result per element (the running sum along the reduced dim)
    CUMPROD = "cumprod"

    @property
    def is_scan(self) -> bool:
        return self in (Reduce.CUMSUM, Reduce.CUMPROD)


class Write(enum.Enum):
    """How a scatter writes an element: ``STORE`` (where several land on one place, one of them
    wins: eager leaves that undefined too) or ``ADD`` (an atomic add: all of them count)."""

    STORE = "store"
    ADD = "add"


@dataclass(frozen=True)
class Scatter:
    """Where a scatter step writes the element it computes: ``index`` into its buffer, whose
    indirect symbols ``ind{k}`` stand for ``indirect[k]`` (checked like a load's: an index out of
    range raises where the kernel asserts, and is never written)."""

    index: Index
    indirect: tuple[Indirect, ...]
    mode: Write


# ------------------------------------------------------------------------------------------ steps
@dataclass(frozen=True)
class Compute:
    """Fill buffer ``name`` (layout ``layout``) by evaluating ``body`` over ``ranges``.

    Pointwise: ``reduced`` is empty and ``ranges == layout.size``. Reduction: the dimensions in
    ``reduced`` are combined with ``reduction``; the layout is the result with those dimensions
    either kept as size 1 (keepdim) or removed. Scan (``reduction.is_scan``): one reduced dimension,
    along which every element gets the running result; the layout is that of ``ranges``.
    Scatter (``scatter`` set): ``ranges`` is the space of the values written, each written at the
    place ``scatter`` gives into the existing buffer ``name`` (``writes_input``; an earlier step
    filled it). Scans and scatters are kernels of their own.
    """

    name: str
    layout: Layout
    dtype: torch.dtype
    ranges: tuple[Index, ...]
    body: Expr
    reduced: tuple[int, ...] = ()
    reduction: Reduce | None = None
    origins: tuple[str, ...] = ()  # the aten nodes it came from, for the comment above the kernel
    writes_input: bool = False  # the buffer exists: a graph input (``aten.copy_``), or a scatter's target
    scatter: Scatter | None = None

    @property
    def alone(self) -> bool:
        """A kernel of its own: a scatter writes anywhere, a scan's values depend on a whole row."""
        return self.scatter is not None or (self.reduction is not None and self.reduction.is_scan)

    @property
    def is_reduction(self) -> bool:
        return self.reduction is not None

    def store_index(self, syms: tuple[sympy.Expr, ...]) -> Index:
        """Where the element computed at ``syms`` (symbols of ``ranges``) is stored."""
        if self.scatter is not None:
            return self.scatter.index
        if not self.is_reduction or self.reduction.is_scan:
            return self.layout.index(syms)
        kept = [s for d, s in enumerate(syms) if d not in self.reduced]
        if len(self.layout.size) == len(self.ranges):  # keepdim
            kept = [sympy.Integer(0) if d in self.reduced else s for d, s in enumerate(syms)]
        return self.layout.index(tuple(kept))


@dataclass(frozen=True)
class BufRef:
    """A buffer (or graph input) used as an argument of an ``Extern`` call."""

    name: str


@dataclass(frozen=True)
class Extern:
    """``name = target(*args, **kwargs)`` through aten; args hold ``BufRef``s and plain values."""

    name: str
    target: str  # e.g. "aten.mm.default"
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]
    origins: tuple[str, ...] = ()
    returns_view: bool = False  # the result may share memory with an argument (never reuse those)
    layout: Layout | None = None  # the traced layout of a tensor result (None: a tuple, a scalar)
    check_strides: bool = False  # aten may return its tensors with other strides than traced (extern_strides)
    dtype: torch.dtype | None = None  # a tensor result's dtype (None: a tuple, a scalar)


@dataclass(frozen=True)
class Alias:
    """``name`` is a strided view of buffer ``base`` (offset relative to ``base``'s own offset)."""

    name: str
    base: str
    layout: Layout
    item: int | None = None  # ``base[item]`` of an extern that returns a tuple, instead of a view


Step = Union[Compute, Extern, Alias]


@dataclass(frozen=True)
class Input:
    name: str
    kind: str  # "tensor" | "symint" | "other"
    layout: Layout | None = None
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Described:
    """An aten node as the comment above the kernel it went into shows it."""

    text: str  # "name = aten.op.overload(args)"
    source: str = ""  # the user's line it was traced from ("model.py:42 in forward: y = f(x)"), or ""


@dataclass(frozen=True)
class Program:
    """What one aten graph lowers to, before scheduling."""

    inputs: tuple[Input, ...]
    steps: tuple[Step, ...]
    outputs: tuple[Any, ...]  # buffer names, or plain values (None, ints, sympy)
    device: str
    symbols: tuple[tuple[str, str], ...]  # (symbol, python expression reading it from the inputs)
    described: tuple[tuple[str, Described], ...] = ()  # (node name, its line) for the kernels' comments
    device_scalars: tuple[str, ...] = ()  # inputs that are CPU 0-d tensors of the caller's: moved to DEVICE
