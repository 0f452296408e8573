"""Which dimension of each value of an aten graph carries the batch, and whether every op keeps the
rows of the batch apart (``trace``): what ``buckets`` must know before it pads a batch.

Padding the batch from B to P rows leaves the first B rows of every output as they were exactly
when row b of every output depends on row b of the inputs alone (and on values that carry no
batch). Where the batch is, is read off the shapes: a value's *batch dimension* is the one
dimension whose size involves the batch symbol ``s``, and its size must be ``s * inner`` with
``inner`` free of ``s`` (``inner`` > 1: the batch folded as the outermost factor of a flattened
dimension, as ``view(B*S, D)`` makes it). Which rows of the inputs each row of an output reads is
the op's semantics: one rule per op family, in ``RULES`` (a conservative allow-list: an op without
a rule, a random op, or a rule that finds rows mixed makes the whole graph run unbucketed, with
the reason). The rules, in short:

- pointwise ops, ``expand``, ``copy``: every batch dimension lines up with the output's (broadcast
  from the right), same size;
- views and reshapes: the product of the dimensions before the batch is the same on both sides
  (the batch stays the outermost factor of its dimension: ``view(B*S, D)`` yes, ``view(S, B, D)``
  of a ``(B, S, D)`` tensor no); permutes move the batch dimension where they move it;
- ``slice``/``select``/``split``/``cat``/padding/``index_select``/``gather``/indexing along other
  dimensions; ``embedding`` and lookups into batch-free tables by batch-carrying indices;
- reductions, scans, softmax, sort, ``topk``, norms over other dimensions (batch norm with batch
  statistics is a reduction over the batch: refused);
- ``mm``/``addmm``/``bmm``/``baddbmm`` that do not contract over the batch, and only one operand
  carrying it (but both operands of a ``bmm`` batched alike); convolution, pooling, group norm and
  attention with the batch as their first dimension;
- constructors (``full``, ``arange``, ``*_like``) and the graph's size arithmetic.

The batch size itself may appear only where it is a size (``view``'s shape, ``full``'s size,
``arange``'s end, ``slice``'s end over the whole batch): ``x * B`` or ``x[:, :B]`` would give the
real rows other values at size P, and is refused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import sympy
import torch
import torch.fx

aten = torch.ops.aten


class NotBucketable(Exception):
    """Why a graph cannot run at a padded batch size (the message is logged)."""


@dataclass(frozen=True)
class BatchDim:
    """Where the batch is in one tensor: its size along ``dim`` is ``batch * inner``."""

    dim: int
    inner: sympy.Expr


Rule = Callable[["Trace", torch.fx.Node, dict[str, Any]], None]
RULES: dict[Any, tuple[Rule, tuple[str, ...]]] = {}  # op packet -> (rule, arguments that may be sizes)


def rule(*packets: Any, sizes: tuple[str, ...] = ()) -> Callable[[Rule], Rule]:
    """Register ``fn`` for the ops; ``sizes``: the arguments where the batch size may appear."""
    def register(fn: Rule) -> Rule:
        for packet in packets:
            RULES[packet] = (fn, sizes)
        return fn
    return register


class Trace:
    """The batch dimension of every value of one graph, read off ``meta["val"]``."""

    def __init__(self, symbol: sympy.Symbol) -> None:
        self.symbol = symbol
        self._dims: dict[tuple[torch.fx.Node, int], BatchDim | None] = {}

    def dim(self, arg: Any, index: int = -1) -> BatchDim | None:
        """The batch dimension of a tensor argument (of output ``index`` of a node that returns
        several); None for a batch-free value or anything that is not a graph value."""
        if not isinstance(arg, torch.fx.Node):
            return None
        key = (arg, index)
        if key not in self._dims:
            val = value(arg) if index < 0 else value(arg)[index]
            self._dims[key] = self.batch_dim(val) if isinstance(val, torch.Tensor) else None
        return self._dims[key]

    def outs(self, node: torch.fx.Node) -> list[BatchDim | None]:
        """The batch dimensions of every tensor a node returns (one or several)."""
        val = value(node)
        if isinstance(val, (tuple, list)):
            return [self.dim(node, i) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
        return [self.dim(node)]

    def batch_dim(self, val: torch.Tensor) -> BatchDim | None:
        found = [(d, e) for d, e in enumerate(sizes(val)) if self.symbol in e.free_symbols]
        if not found:
            return None
        if len(found) > 1:
            raise NotBucketable(f"the batch size is in dimensions {[d for d, _ in found]} of one value")
        d, size = found[0]
        inner = size / self.symbol
        if self.symbol in inner.free_symbols:
            raise NotBucketable(f"a dimension of size {size} does not hold the batch as its outermost factor")
        return BatchDim(d, inner)

    def involves(self, arg: Any) -> bool:
        """Whether an argument (a symbolic size, or a list of them) is computed from the batch size."""
        if isinstance(arg, (list, tuple)):
            return any(self.involves(a) for a in arg)
        if not isinstance(arg, torch.fx.Node):
            return False
        val = value(arg)
        return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) and \
            self.symbol in val.node.expr.free_symbols

    def check(self, node: torch.fx.Node) -> None:
        """Raise NotBucketable where ``node`` may mix rows of the batch."""
        target = node.target
        if node.op != "call_function":
            if node.op in ("placeholder", "get_attr", "output"):  # inputs: ``buckets._inputs``
                return
            raise NotBucketable(f"{node.op} {target} is not an aten op")
        if not isinstance(target, torch._ops.OpOverload):
            return self._python(node)
        fn, allowed = _rule_of(target)
        if torch.Tag.nondeterministic_seeded in target.tags and fn is not _attention:  # its dropout_p is checked
            raise NotBucketable(f"{target} is random: padding would change which numbers the real rows get")
        args = named_args(node)
        for name, arg in args.items():
            if name not in allowed and self.involves(arg):
                raise NotBucketable(f"{target} ({node.name}) uses the batch size as a value (argument {name})")
        try:
            fn(self, node, args)
            self._writes(target, args)
        except NotBucketable as exc:
            raise NotBucketable(f"{target} ({node.name}) {exc}") from None

    def _writes(self, target: torch._ops.OpOverload, args: dict[str, Any]) -> None:
        """An op that writes in place must not write into a value that holds the batch: a padded
        input is a copy, and the caller's tensor must change."""
        for a in target._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write and self.dim(args.get(a.name)) is not None:
                raise NotBucketable(f"writes in place into {a.name}, which holds the batch")

    def _python(self, node: torch.fx.Node) -> None:
        """``getitem`` of a multi-output op (its rule saw every output), and size arithmetic."""
        if node.target is operator.getitem:
            return
        if any(isinstance(a, torch.fx.Node) and isinstance(value(a), torch.Tensor) for a in node.all_input_nodes):
            raise NotBucketable(f"{node.target} ({node.name}) is not an aten op")
        if not isinstance(value(node), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            raise NotBucketable(f"{node.target} ({node.name}) is not size arithmetic")


def _rule_of(target: torch._ops.OpOverload) -> tuple[Rule, tuple[str, ...]]:
    found = RULES.get(target.overloadpacket)
    if found is not None:
        return found
    if torch.Tag.pointwise in target.tags:
        return _broadcast, ()
    raise NotBucketable(f"{target} is not known to keep the rows of a batch apart")


def value(node: torch.fx.Node) -> Any:
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None and node.op not in ("get_attr", "output"):
        raise NotBucketable(f"{node.name} has no traced value (shape)")
    return val


def expr(size: Any) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def sizes(val: torch.Tensor) -> list[sympy.Expr]:
    return [expr(s) for s in val.shape]


def same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.expand(a - b) == 0


def product(exprs: Iterable[sympy.Expr]) -> sympy.Expr:
    out: sympy.Expr = sympy.Integer(1)
    for e in exprs:
        out = out * e
    return out


def named_args(node: torch.fx.Node) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _ndim(node: Any) -> int:
    return value(node).dim()


def _dims(dims: Any, ndim: int) -> set[int]:
    """Reduced dimensions, normalised; None or [] is every dimension."""
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return set(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return {d % max(ndim, 1) for d in dims}


def _expect(t: Trace, node: torch.fx.Node, want: BatchDim | None, index: int = -1) -> None:
    got = t.dim(node, index)
    if got != want and not (got and want and got.dim == want.dim and same(got.inner, want.inner)):
        raise NotBucketable(f"puts the batch in dimension {got and got.dim}, not {want and want.dim}")


def _tensors(args: dict[str, Any]) -> list[torch.fx.Node]:
    found = []
    for arg in args.values():
        for a in arg if isinstance(arg, (list, tuple)) else [arg]:
            if isinstance(a, torch.fx.Node) and isinstance(value(a), torch.Tensor):
                found.append(a)
    return found


# ---- pointwise: the batch dimensions line up, broadcast from the right ----------------------------

@rule(aten.expand, aten.copy, aten._to_copy, aten.alias, aten.lift_fresh_copy, aten.detach,
      aten.masked_fill, aten.where, aten.clone, sizes=("size",))
def _broadcast(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    out, ndim = t.dim(node), _ndim(node)
    for x in _tensors(args):
        b = t.dim(x)
        if b is None:
            continue
        if out is None or b.dim + ndim - _ndim(x) != out.dim or not same(b.inner, out.inner):
            raise NotBucketable("broadcasts the batch dimension against another dimension")


# ---- views ---------------------------------------------------------------------------------------

@rule(aten.view, aten._unsafe_view, aten.reshape, aten.view_copy, aten.squeeze, aten.unsqueeze,
      aten.flatten, aten.unflatten, aten._reshape_alias, sizes=("size", "shape", "sizes", "stride"))
def _reshape(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    """Row-major order is kept, so the rows stay rows where the dimensions before the batch hold
    as many elements on both sides (the batch is then the outermost factor of its dimension)."""
    x = args["self"]
    b, out = t.dim(x), t.dim(node)
    if b is None and out is None:
        return
    if b is None or out is None:
        raise NotBucketable("reshapes the batch dimension away, or a batch-free value into one")
    before = product(sizes(value(x))[:b.dim])
    if not same(before, product(sizes(value(node))[:out.dim])):
        raise NotBucketable("reshapes the batch dimension inside another one")


@rule(aten.permute, aten.transpose, aten.t)
def _permute(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    b = t.dim(args["self"])
    if b is None:
        return _expect(t, node, None)
    ndim = _ndim(node)
    order = list(range(ndim))
    if node.target.overloadpacket is aten.permute:
        order = [d % ndim for d in args["dims"]]
    elif ndim > 1:
        d0, d1 = (args["dim0"] % ndim, args["dim1"] % ndim) if "dim0" in args else (0, 1)
        order[d0], order[d1] = order[d1], order[d0]
    _expect(t, node, BatchDim(order.index(b.dim), b.inner))


@rule(aten.slice, sizes=("end",))
def _slice(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    x = args["self"]
    b, dim = t.dim(x), args["dim"] % max(_ndim(x), 1)
    whole = args["start"] in (0, None) and args["step"] == 1
    if b is None:  # a batch-free table cut to the batch size: row i of it is row i, at any size
        out = t.dim(node)
        if out is not None and not (whole and out.dim == dim):
            raise NotBucketable("cuts a table to the batch size other than from its start")
        return
    if dim == b.dim and not (whole and same(sizes(value(node))[dim], sizes(value(x))[dim])):
        raise NotBucketable("slices the batch dimension")
    if dim != b.dim and t.involves(args["end"]):
        raise NotBucketable("slices another dimension by the batch size")
    _expect(t, node, b)


@rule(aten.select, aten.unbind)
def _select(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    b = t.dim(args["self"])
    dim = args["dim"] % max(_ndim(args["self"]), 1)
    if b is not None and dim == b.dim:
        raise NotBucketable("selects rows of the batch")
    want = None if b is None else BatchDim(b.dim - (dim < b.dim), b.inner)
    for i in range(len(t.outs(node))):
        _expect(t, node, want, i if isinstance(value(node), (list, tuple)) else -1)


@rule(aten.split, aten.split_with_sizes, aten.chunk)
def _split(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    b = t.dim(args["self"])
    if b is not None and args.get("dim", 0) % max(_ndim(args["self"]), 1) == b.dim:
        raise NotBucketable("splits the batch dimension")
    for i in range(len(t.outs(node))):
        _expect(t, node, b, i)


@rule(aten.cat)
def _cat(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    out = t.dim(node)
    if out is not None and args["dim"] % max(_ndim(node), 1) == out.dim:
        raise NotBucketable("concatenates along the batch dimension")
    for x in args["tensors"]:
        b = t.dim(x)
        if (b is None) != (out is None) or (b is not None and (b.dim != out.dim or not same(b.inner, out.inner))):
            raise NotBucketable("concatenates values that hold the batch differently")


@rule(aten.constant_pad_nd)
def _pad(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    b, pad = t.dim(args["self"]), list(args["pad"])
    if b is not None:
        i = 2 * (_ndim(args["self"]) - 1 - b.dim)
        if any(p != 0 for p in pad[i:i + 2]):
            raise NotBucketable("pads the batch dimension")
    _expect(t, node, b)


# ---- indexing ------------------------------------------------------------------------------------

@rule(aten.embedding)
def _embedding(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    if t.dim(args["weight"]) is not None:
        raise NotBucketable("looks up in a table that holds the batch")
    _expect(t, node, t.dim(args["indices"]))


@rule(aten.index_select)
def _index_select(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    b, index = t.dim(args["self"]), t.dim(args["index"])
    dim = args["dim"] % max(_ndim(args["self"]), 1)
    if b is not None and (index is not None or dim == b.dim):
        raise NotBucketable("selects rows of the batch")
    _expect(t, node, b if b is not None else (index and BatchDim(dim, index.inner)))


@rule(aten.gather)
def _gather(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    b, index = t.dim(args["self"]), t.dim(args["index"])
    if b is not None and (index != b or args["dim"] % max(_ndim(args["self"]), 1) == b.dim):
        raise NotBucketable("gathers across rows of the batch")
    _expect(t, node, index)


@rule(aten.index)
def _index(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    """``x[idx]`` into a batch-free table, or ``x[:, idx]`` of a batch tensor by batch-free indices."""
    b, indices = t.dim(args["self"]), list(args["indices"])
    carrying = [i for i, a in enumerate(indices) if t.dim(a) is not None]
    if b is None:
        if carrying and (carrying != [0] or any(a is not None for a in indices[1:])):
            raise NotBucketable("indexes with batch-carrying indices other than x[idx]")
        out = t.dim(node)
        if carrying and (out is None or out.dim != t.dim(indices[0]).dim):
            raise NotBucketable("puts the batch of its indices elsewhere")
        return
    if carrying or (b.dim < len(indices) and indices[b.dim] is not None):
        raise NotBucketable("indexes the batch dimension")
    out = t.dim(node)
    if out is None or not same(out.inner, b.inner):
        raise NotBucketable("indexes the batch dimension away")


# ---- reductions, scans, normalisation: over other dimensions -------------------------------------

_REDUCTIONS = {aten.sum: "dim", aten.mean: "dim", aten.amax: "dim", aten.amin: "dim", aten.argmax: "dim",
               aten.argmin: "dim", aten.max: "dim", aten.min: "dim", aten.var: "dim", aten.var_mean: "dim",
               aten.std: "dim", aten.std_mean: "dim", aten.prod: "dim", aten.any: "dim", aten.all: "dim",
               aten.logsumexp: "dim", aten.linalg_vector_norm: "dim", aten.nansum: "dim"}
_ALONG = (aten._softmax, aten._log_softmax, aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax,
          aten.cummin, aten.sort, aten.topk, aten.argsort)  # shape kept but for the dimension they run along


@rule(*_REDUCTIONS, *_ALONG)
def _reduction(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    if "other" in args:  # max.other, min.other: pointwise
        return _broadcast(t, node, args)
    x = args["self"]
    b, ndim = t.dim(x), _ndim(x)
    along = node.target.overloadpacket in _ALONG
    dims = _dims(args.get("dim", -1 if along else None), ndim)
    if b is not None and b.dim in dims:
        raise NotBucketable(f"{'runs along' if along else 'reduces over'} the batch dimension: "
                            "the real rows would see the padding rows")
    keep = along or args.get("keepdim", False)
    want = None if b is None else BatchDim(b.dim - (0 if keep else sum(d < b.dim for d in dims)), b.inner)
    for i in range(len(t.outs(node))):
        _expect(t, node, want, i if isinstance(value(node), (list, tuple)) else -1)


@rule(aten.native_layer_norm)
def _layer_norm(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    b = t.dim(args["input"])
    if b is not None and b.dim >= _ndim(args["input"]) - len(args["normalized_shape"]):
        raise NotBucketable("normalizes over the batch dimension")
    _per_sample_params(t, args, ("weight", "bias"))
    for i in range(3):
        _expect(t, node, b, i)


@rule(aten.native_group_norm, sizes=("N",))
def _group_norm(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    b, n = t.dim(args["input"]), args["N"]
    n = expr(value(n)) if isinstance(n, torch.fx.Node) else sympy.Integer(n)
    if b is not None and (b.dim != 0 or not same(n, sizes(value(args["input"]))[0])):
        raise NotBucketable("normalizes over the batch dimension")
    _per_sample_params(t, args, ("weight", "bias"))
    for i in range(3):
        _expect(t, node, b, i)


def _per_sample_params(t: Trace, args: dict[str, Any], names: Iterable[str]) -> None:
    if any(t.dim(args.get(n)) is not None for n in names):
        raise NotBucketable("takes parameters that hold the batch")


# ---- matrix products, convolution, pooling, attention --------------------------------------------

@rule(aten.mm, aten.addmm, aten.bmm, aten.baddbmm)
def _matmul(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    """Rows of the first operand or columns of the second, or (``bmm``) the matrices of both, alike;
    never the contracted dimension."""
    a, b = (args["mat1"], args["mat2"]) if "mat1" in args else \
        (args["batch1"], args["batch2"]) if "batch1" in args else (args["self"], args["mat2"])
    da, db, ndim = t.dim(a), t.dim(b), _ndim(a)
    if da is not None and db is not None:
        if ndim != 3 or da.dim != 0 or db != da:
            raise NotBucketable("multiplies two matrices that both hold the batch")
        want: BatchDim | None = da
    elif da is not None:
        if da.dim != ndim - 2:
            raise NotBucketable("contracts over the batch dimension")
        want = da
    elif db is not None:
        if db.dim != ndim - 1:
            raise NotBucketable("contracts over the batch dimension")
        want = db
    else:
        want = None
    _expect(t, node, want)
    if "mat1" in args or "batch1" in args:  # addmm's, baddbmm's added term
        _broadcast(t, node, {"self": args["self"]})


@rule(aten.convolution)
def _convolution(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    _first_dim_only(t, args["input"])
    _per_sample_params(t, args, ("weight", "bias"))
    _expect(t, node, t.dim(args["input"]))


_POOLING = {aten.max_pool2d_with_indices: 2, aten.avg_pool2d: 2, aten._adaptive_avg_pool2d: 2,
            aten.adaptive_avg_pool2d: 2, aten.max_pool3d_with_indices: 3, aten.avg_pool3d: 3,
            aten._adaptive_avg_pool3d: 3, aten.avg_pool1d: 1, aten.upsample_nearest2d: 2,
            aten.upsample_bilinear2d: 2}  # op -> the trailing dimensions it pools over


@rule(*_POOLING)
def _pooling(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    x = args.get("self", args.get("input"))
    b = t.dim(x)
    if b is not None and b.dim >= _ndim(x) - _POOLING[node.target.overloadpacket]:
        raise NotBucketable("pools over the batch dimension")
    for i in range(len(t.outs(node))):
        _expect(t, node, b, i if isinstance(value(node), (list, tuple)) else -1)


_ATTENTION = (aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_efficient_attention,
              aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_cudnn_attention,
              aten.scaled_dot_product_attention, aten._scaled_dot_product_attention_math)


@rule(*_ATTENTION)
def _attention(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    """Each (batch, head) attends within itself: batch first in q, k, v, the mask and the outputs."""
    if args.get("dropout_p", 0.0) != 0.0:
        raise NotBucketable("drops out at random")
    first = t.dim(args["query"])
    for x in _tensors(args):
        b = t.dim(x)
        if b is not None and (b.dim != 0 or first is None or not same(b.inner, first.inner)):
            raise NotBucketable("attends across the batch")
    if first is not None:
        for b in t.outs(node):
            if b is not None and (b.dim != 0 or not same(b.inner, first.inner)):
                raise NotBucketable("returns the batch outside the first dimension")


def _first_dim_only(t: Trace, x: Any) -> None:
    b = t.dim(x)
    if b is not None and b.dim != 0:
        raise NotBucketable("holds the batch outside the first dimension")


# ---- values without data: constructors, sizes, asserts; and input writes -------------------------

@rule(aten.full, aten.zeros, aten.ones, aten.empty, aten.empty_strided, aten.scalar_tensor, aten.arange,
      aten.full_like, aten.zeros_like, aten.ones_like, aten.empty_like, aten.fill, aten.new_zeros,
      aten.new_ones, aten.new_full, aten.new_empty, aten.new_empty_strided, sizes=("size", "stride", "end"))
def _constructor(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    """Row i of ``full([B, ...])`` or ``arange(B)`` is the same at any size; ``*_like``, ``new_*`` and
    ``fill`` read only the shape, dtype and device of their tensor."""


@rule(aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten._assert_scalar,
      aten.sym_constrain_range_for_size, aten._assert_tensor_metadata, sizes=("size", "stride"))
def _no_data(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    """Sizes are checked where they are used; an assertion on the batch size is refused."""


@rule(aten.copy_)
def _input_write(t: Trace, node: torch.fx.Node, args: dict[str, Any]) -> None:
    if t.dim(args["self"]) is not None:
        raise NotBucketable("writes into a batch input in place: the caller's tensor, not a padded copy, must change")
    _broadcast(t, node, args)
