"""Lower an aten FX graph to an ``ir.Program``: one method per node kind, values freed of FX.

Pointwise values stay lazy (expressions inlined into their users) until something needs memory:
a graph output, an aten call, a value used more than once, a reshape that is not an index remap.
Reductions always write a buffer; the scheduler later fuses what shares an index space.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import sympy
import torch
import torch.fx

from cgtrees import counters
from cgtrees.codegen import (  # noqa: F401  (register lowerings)
    device_scalars,
    extern_strides,
    gemm_choice,
    ir,
    lower_addmm,
    lower_conv,
    lower_indexing,
    lower_pointwise,
    lower_pool,
    lower_reductions,
    lower_scan,
    lower_scatter,
    lower_views,
    naming,
    ops,
)
from cgtrees.codegen.lowering import (
    LOWERINGS,
    CannotLower,
    LowerCtx,
    TensorValue,
    is_library_op,
    load_buffer,
    meta_layout,
    reads_values,
    sym,
    why_not_lowered,
)
from cgtrees.config import Config
from cgtrees.logs import log_once

log = logging.getLogger("cgtrees.codegen")
aten = torch.ops.aten

INLINE_LIMIT = 120  # expression nodes; a bigger lazy value is materialized rather than inlined again


class ExternTuple:
    """The value of an aten call that returns several tensors (``getitem`` picks one)."""

    def __init__(self, name: str) -> None:
        self.name = name


def describe(node: torch.fx.Node) -> ir.Described:
    """The node's line above the kernel it goes into, and the user's source line it came from."""
    text = describe_node(node) if node.op == "call_function" else node.name
    return ir.Described(text, naming.source_line(node.meta.get("stack_trace")))


def describe_node(node: torch.fx.Node) -> str:
    """``name = aten.op.overload(arg, ...)``: one line per aten node above the kernel it went into."""
    target = _target_name(node.target)

    def fmt(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]"
        return repr(a)

    args = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
    return f"{node.name} = {target}({', '.join(args)})"


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        prefix = "aten" if target.namespace == "aten" else f"torch.ops.{target.namespace}"
        return f"{prefix}.{target.__name__}"
    return getattr(target, "__name__", str(target))


class GraphLowerer:
    def __init__(self, gm: torch.fx.GraphModule, config: Config, gemm: gemm_choice.GemmPlan | None = None) -> None:
        self.gm = gm
        self.interpret = config.interpret
        self.env: dict[torch.fx.Node, Any] = {}
        self.steps: list[ir.Step] = []
        self.inputs: list[ir.Input] = []
        self.layouts: dict[str, ir.Layout] = {}  # every buffer's own layout (offset 0)
        self.meta_offsets: dict[str, sympy.Expr] = {}
        # realized values by (body, dtype, layout, meta offset) -> buffer and whether an output took it
        self.realized: dict[tuple, tuple[str, bool]] = {}
        self.shared: set[str] = set()  # buffers ``realize`` handed to more than one value
        self.realized_from: dict[str, list[tuple]] = {}  # a buffer -> the keys of values realized reading it
        self.view_bases: dict[str, str] = {}  # each view ``materialize`` made -> the buffer it views
        self.origins: dict[torch.fx.Node, tuple[str, ...]] = {}
        self.names: set[str] = {n.name for n in gm.graph.nodes}
        self.used_names: set[str] = set()
        self.described: dict[str, ir.Described] = {}
        self.fallbacks: list[tuple[str, str]] = []
        self.device_scalars: list[str] = []  # inputs ``device_scalars.moved`` put on the device
        self.gemm = gemm or gemm_choice.GemmPlan.of(gm, "keep")  # timed GEMM forms (gemm_choice)
        self.ctx = LowerCtx(config.interpret, self, config.unfuse_addmm)
        self._current_origins: tuple[str, ...] = ()

    # ------------------------------------------------------------------------------------ entry
    def run(self) -> ir.Program:
        for node in self.gm.graph.nodes:
            self.described[node.name] = describe(node)
            try:
                self.NODE_KINDS[node.op](self, node)
            except KeyError as exc:  # its message would show quoted
                raise RuntimeError(_in_node(exc, node, self.described[node.name])) from exc
            except Exception as exc:
                exc.args = (_in_node(exc, node, self.described[node.name]), *exc.args[1:])
                raise
        program = ir.Program(tuple(self.inputs), tuple(self.steps), self.outputs, self.device(),
                             self.symbol_bindings(), tuple(self.described.items()), tuple(self.device_scalars))
        self._check_bound(program)
        return program

    def _check_bound(self, program: ir.Program) -> None:
        """Every size symbol the program uses must be readable from an input or an aten call."""
        bound = {s for s, _ in program.symbols} | {st.name for st in program.steps if isinstance(st, ir.Extern)}
        used: set[sympy.Symbol] = set()

        def collect(v: Any) -> None:
            if isinstance(v, sympy.Expr):
                used.update(v.free_symbols)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    collect(x)

        for st in program.steps:
            if isinstance(st, ir.Compute):
                collect([*st.ranges, *st.layout.size, *st.layout.stride, st.layout.offset])
            elif isinstance(st, ir.Alias) and st.layout is not None:
                collect([*st.layout.size, *st.layout.stride, st.layout.offset])
            elif isinstance(st, ir.Extern):
                collect([st.args, [v for _, v in st.kwargs]])
        collect(list(program.outputs))
        missing = sorted(s.name for s in used if s.name not in bound)
        if missing:
            raise NotImplementedError(f"sizes depend on values we cannot read back ({', '.join(missing)})")

    # ----------------------------------------------------------------------------- node kinds
    def _placeholder(self, node: torch.fx.Node) -> None:
        val = node.meta.get("val")
        name = self._claim(node.name)
        if isinstance(val, torch.Tensor):
            layout = meta_layout(val)
            if node.meta.get(device_scalars.MARK):
                self.device_scalars.append(name)
            self.inputs.append(ir.Input(name, "tensor", layout, val.dtype))
            self.layouts[name] = layout
            self.meta_offsets[name] = sym(val.storage_offset())
            self.env[node] = load_buffer(name, layout, val.dtype)
        elif isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            self.inputs.append(ir.Input(name, "symint"))
            self.env[node] = val.node.expr
        else:
            self.inputs.append(ir.Input(name, "other"))
            self.env[node] = val

    def _get_attr(self, node: torch.fx.Node) -> None:
        raise NotImplementedError(f"get_attr {node.target}: graph constants are not generated")

    def _call_module(self, node: torch.fx.Node) -> None:
        raise NotImplementedError(f"call_module {node.target}")

    def _call_method(self, node: torch.fx.Node) -> None:
        raise NotImplementedError(f"call_method {node.target}")

    def _call_function(self, node: torch.fx.Node) -> None:
        if node.target is operator.getitem and isinstance(self.env.get(node.args[0]), (tuple, list, ExternTuple)):
            self.env[node] = self._getitem(node)
            return
        if not isinstance(node.target, torch._ops.OpOverload):
            self.env[node] = self._python_scalar(node)
            return
        if node.target is aten.copy_.default and node.args[0].op == "placeholder":
            self.env[node] = self._copy_into_input(node)
            return
        reason = why_not_lowered(node, self.ctx)
        if reason is None:
            try:
                self.env[node] = self._lower(node)
                return
            except CannotLower as exc:
                reason = str(exc)
            except Exception as exc:  # noqa: BLE001  (a bug in one lowering must not sink the graph)
                reason = f"lowering failed: {type(exc).__name__}: {exc}"
        self.env[node] = self._fallback(node, reason)

    def _output(self, node: torch.fx.Node) -> None:
        outs = []
        results = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
        bases: set[str] = set()
        for arg in results:
            if isinstance(arg, torch.fx.Node) and isinstance(self.env.get(arg), TensorValue):
                outs.append(self._own_output(arg, bases))
            elif isinstance(arg, torch.fx.Node):
                outs.append(self.env[arg])
            else:
                outs.append(arg)
        self.outputs = tuple(outs)

    def _own_output(self, node: torch.fx.Node, bases: set[str]) -> str:
        """``node``'s buffer as an output; a copy where an earlier output has the buffer it views only
        because ``realize`` shared it (values equal, tensors distinct: writing one must not change
        the other)."""
        name = self.materialize(node)
        if not self.shared:
            return name
        base = self.view_bases.get(name, name)
        if base in self.shared and base in bases:
            value = self.env[node]
            self.env[node] = self.realize(TensorValue(value.size, value.dtype, value.body), node, share=False)
            return self.materialize(node)
        bases.add(base)
        return name

    NODE_KINDS: dict[str, Callable[["GraphLowerer", torch.fx.Node], None]] = {
        "placeholder": _placeholder, "get_attr": _get_attr, "call_module": _call_module,
        "call_method": _call_method, "call_function": _call_function, "output": _output,
    }

    # ------------------------------------------------------------------------------------ lowering
    def _lower(self, node: torch.fx.Node) -> Any:
        self.ctx.node = node
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: self.env[n])
        lazy_origins = [self.origins.get(n, ()) for n in node.all_input_nodes
                        if self._is_lazy(n) and reads_values(node, n)]  # not a ``copy``'s unread destination
        self._current_origins = tuple(dict.fromkeys([o for group in lazy_origins for o in group] + [node.name]))
        steps_before = len(self.steps)
        try:
            result = LOWERINGS[node.target].fn(self.ctx, *args, **kwargs)
            for value in result if isinstance(result, tuple) else (result,):
                self._check_templates(value)
        except Exception:
            del self.steps[steps_before:]  # drop half-built steps of a lowering that gave up
            raise
        self.origins[node] = self._current_origins
        if isinstance(result, TensorValue) and self._should_realize(node, result):
            result = self.realize(result, node)
        return result

    def _is_lazy(self, node: torch.fx.Node) -> bool:
        value = self.env.get(node)
        return isinstance(value, TensorValue) and value.view is None

    def _should_realize(self, node: torch.fx.Node, value: TensorValue) -> bool:
        if value.view is not None or isinstance(value.body, (ir.Load, ir.Const)):
            return False
        if any(user.op == "output" for user in node.users):
            return True  # realize outputs where they are computed, so they fuse with their producers
        readers = sum(reads_values(user, node) for user in node.users)  # not ``copy``'s destination
        if readers > 1 and (_reads_nothing_along_rows(value) or _widens(value)):
            readers = 1  # recomputed by each reader at no memory cost (a loss's one-hot times a row's scale)
        return readers > 1 or ir.size_of(value.body) > INLINE_LIMIT

    def _check_templates(self, value: Any) -> None:
        if not isinstance(value, TensorValue):
            return

        def walk(e: ir.Expr) -> None:
            if isinstance(e, ir.Op):
                if ops.template(e.name, self.interpret) is None:
                    raise CannotLower(f"op {e.name!r} has no {'interpreter' if self.interpret else 'Triton'} form")
                for a in e.args:
                    walk(a)

        walk(value.body)

    # ------------------------------------------------------------------------------ buffers
    def _claim(self, base: str) -> str:
        name, i = base, 0
        while name in self.used_names or (name != base and name in self.names):
            i += 1
            name = f"{base}_{i}"
        self.used_names.add(name)
        return name

    def realize_input(self, value: TensorValue, node: torch.fx.Node) -> TensorValue:
        """Materialize an argument of ``node``, under the name of the node that produced it."""
        for arg in node.all_input_nodes:
            if self.env.get(arg) is value:
                self.env[arg] = self.realize(value, arg)
                return self.env[arg]
        return self.realize(value, node, suffix="_src")

    def realize(self, value: TensorValue, node: torch.fx.Node, suffix: str = "", share: bool = True) -> TensorValue:
        """Write ``value`` (the value of ``node``, or of one of its inputs) into a new buffer; or, where
        ``share``, the buffer an earlier realization of the same value in the same layout wrote (a
        softmax's result saved for the backward and its expand read by a bmm: one store, not two).
        Two graph outputs never share one: a caller may write into either."""
        if value.view is not None:
            return value
        meta = node.meta.get("val")
        if suffix == "" and isinstance(meta, torch.Tensor) and tuple(sym(s) for s in meta.shape) == value.size:
            layout, offset = meta_layout(meta), sym(meta.storage_offset())
        else:
            layout, offset = ir.Layout(value.size, ir.contiguous_strides(value.size)), sympy.Integer(0)
        output = suffix == "" and any(u.op == "output" for u in node.users)
        key = (value.body, value.dtype, layout, offset)
        if share and key in self.realized and not (output and self.realized[key][1]):
            name, taken = self.realized[key]
            self.realized[key] = (name, taken or output)
            self.shared.add(name)
            return load_buffer(name, layout, value.dtype)
        name = self._claim(node.name + suffix)
        origins = self.origins.get(node, self._current_origins) if suffix == "" else self._current_origins
        self.steps.append(ir.Compute(name, layout, value.dtype, value.size, value.body, origins=origins))
        self.layouts[name] = layout
        self.meta_offsets[name] = offset
        if share:
            self.realized[key] = (name, output)
            for buf in {load.buf for load in ir.loads(value.body)}:
                self.realized_from.setdefault(buf, []).append(key)
        return load_buffer(name, layout, value.dtype)

    def add_reduction(self, name: str, layout: ir.Layout, dtype: torch.dtype, ranges: tuple, reduced: tuple,
                      kind: ir.Reduce, body: ir.Expr, node: torch.fx.Node) -> TensorValue:
        name = self._claim(name)
        self.steps.append(ir.Compute(name, layout, dtype, ranges, body, tuple(reduced), kind,
                                     origins=self._current_origins))
        self.layouts[name] = layout
        self.meta_offsets[name] = sympy.Integer(0)
        return load_buffer(name, layout, dtype)

    def add_empty(self, node: torch.fx.Node, layout: ir.Layout, dtype: torch.dtype,
                  device: torch.device) -> TensorValue:
        """A buffer allocated in ``call`` and filled by nobody (``empty_strided``): no kernel."""
        name = self._claim(node.name)
        self.steps.append(ir.Extern(name, "torch.empty_strided", (list(layout.size), list(layout.stride)),
                                    (("dtype", dtype), ("device", device)), origins=(node.name,)))
        self.layouts[name] = layout
        self.meta_offsets[name] = sympy.Integer(0)
        return load_buffer(name, layout, dtype)

    def add_scatter(self, name: str, dtype: torch.dtype, ranges: tuple, body: ir.Expr, where: ir.Scatter) -> None:
        """A step writing into buffer ``name``, which an earlier step filled (its layout is kept)."""
        self._written(name)
        self.steps.append(ir.Compute(name, self.layouts[name], dtype, ranges, body, origins=self._current_origins,
                                     writes_input=True, scatter=where))

    def _written(self, name: str) -> None:
        """Buffer ``name`` is written now: a value realized from its old contents is not one computed
        from its new ones, however alike their bodies (``realize`` shares no buffer between them)."""
        for key in self.realized_from.pop(name, ()):
            self.realized.pop(key, None)

    def materialize(self, node: torch.fx.Node) -> str:
        """The name of a tensor holding ``node``'s value (realizing it, or aliasing a view)."""
        value = self.env[node]
        if value.view is None:
            value = self.realize(value, node)
            self.env[node] = value
        buf, layout = value.view
        if layout == self.layouts[buf]:
            return buf
        name = self._claim(node.name + "_view") if node.name in self.used_names else self._claim(node.name)
        self.steps.append(ir.Alias(name, buf, layout))
        self.view_bases[name] = self.view_bases.get(buf, buf)
        self.layouts[name] = ir.Layout(layout.size, layout.stride)
        self.meta_offsets[name] = self.meta_offsets[buf] + layout.offset
        self.env[node] = load_buffer(name, self.layouts[name], value.dtype)
        return name

    # ------------------------------------------------------------------------------ special nodes
    def _getitem(self, node: torch.fx.Node) -> Any:
        source, index = self.env[node.args[0]], node.args[1]
        if not isinstance(source, ExternTuple):
            value = source[index]
            self.origins[node] = self.origins.get(node.args[0], ())
            if isinstance(value, TensorValue) and self._should_realize(node, value):
                value = self.realize(value, node)
            return value
        val = node.meta.get("val")
        name = self._claim(node.name)
        layout = meta_layout(val) if isinstance(val, torch.Tensor) else None
        self.steps.append(ir.Alias(name, source.name, layout, item=index))
        if layout is None:
            return None
        self.layouts[name] = layout
        self.meta_offsets[name] = sym(val.storage_offset())
        return load_buffer(name, layout, val.dtype)

    def _python_scalar(self, node: torch.fx.Node) -> Any:
        """``operator.mul`` on SymInts and friends: their meta value is already the expression."""
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return val.node.expr
        if isinstance(val, (int, float, bool)):
            return val
        raise NotImplementedError(f"call_function {node.target} with value {type(val).__name__}")

    def in_place_target(self, node: torch.fx.Node) -> TensorValue | None:
        """``node``'s first argument, when ``node`` (a write at indices: ``index_put``, ``scatter``)
        may write into it in place: a graph input that the graph copies ``node``'s result back
        into (``aten.copy_(input, node)``: an in-place op of the program, which AOTAutograd
        functionalised) and that nothing else reads. Its old value then has no other reader, and
        the copy back becomes a no-op (``_copy_into_input``): a KV-cache update writes its new
        rows, not a copy of the cache and a copy back. Else None."""
        base = node.args[0] if node.args else None
        if not isinstance(base, torch.fx.Node) or base.op != "placeholder":
            return None
        back = [u for u in base.users if u.target is aten.copy_.default and u.args[0] is base and u.args[1] is node]
        if len(back) != 1 or set(base.users) != {node, back[0]}:
            return None
        others: list[torch.fx.Node] = []
        torch.fx.node.map_arg((node.args[1:], node.kwargs), others.append)
        if base in others or any(u.op == "output" for u in node.users):
            return None  # the node reads the input again, or returns its result as a new tensor
        value = self.env.get(base)
        if not isinstance(value, TensorValue) or value.view is None or value.dtype != node.meta["val"].dtype:
            return None
        return value

    def _copy_into_input(self, node: torch.fx.Node) -> TensorValue:
        """``aten.copy_(input, value)``: the graph mutates an input; write the value into it."""
        dst_node, src_node = node.args[0], node.args[1]
        dst = self.env[dst_node]
        if isinstance(src_node, torch.fx.Node) and self.env.get(src_node) is dst:
            return dst  # written in place already (``in_place_target``)
        name = dst.view[0]
        src = self.env[src_node] if isinstance(src_node, torch.fx.Node) else src_node
        self.ctx.node = node
        self._current_origins = (*self.origins.get(src_node, ()), node.name) if self._is_lazy(src_node) \
            else (node.name,)
        from cgtrees.codegen.lowering import broadcast
        body = broadcast(src, dst.size, dst.dtype)
        if any(ld.buf == name and ld.index != dst.body.index for ld in ir.loads(body)):
            src = self.realize(src, src_node)  # reads the input elsewhere: compute it fully first
            body = broadcast(src, dst.size, dst.dtype)
        self._written(name)
        self.steps.append(ir.Compute(name, self.layouts[name], dst.dtype, dst.size, body,
                                     origins=self._current_origins, writes_input=True))
        return dst

    def _fallback(self, node: torch.fx.Node, reason: str) -> Any:
        if node.target in (aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                           aten.sym_storage_offset.default):
            return self._python_scalar(node)
        counters.bump("aten_fallbacks")
        if not is_library_op(node.target):
            counters.bump_gap(str(node.target))  # an op a kernel could have done: a fusion boundary we left
        self.fallbacks.append((node.name, reason))
        source = self.described[node.name].source
        log_once(log, f"fallback:{node.target}:{reason}", "cgtrees codegen: %s runs through aten (%s)%s",
                 node.target, reason, f"; {node.name} from {source}" if source else "", level=logging.INFO)
        return self._extern(node, node.target, node.args, node.kwargs, node.meta.get("val"), node.name)

    def library_call(self, node: torch.fx.Node, target: torch._ops.OpOverload, args: tuple,
                     val: torch.Tensor, name: str) -> TensorValue:
        """A library op (``aten.mm``) that a lowering of ``node`` calls: an aten call in ``call``,
        counted as one; ``args`` may hold FX nodes, ``val`` is its result's meta."""
        assert is_library_op(target), target
        counters.bump("aten_fallbacks")
        return self._extern(node, target, args, {}, val, name)

    def _extern(self, node: torch.fx.Node, target: torch._ops.OpOverload, node_args: Any, node_kwargs: dict,
                val: Any, base: str) -> Any:
        """``base = target(*args, **kwargs)`` through aten (FX nodes in the arguments become buffers)."""

        def arg(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                value = self.env[a]
                if isinstance(value, TensorValue):
                    return ir.BufRef(self.materialize(a))
                return value
            return a

        args = tuple(_map(arg, node_args))
        kwargs = tuple((k, _map(arg, v)) for k, v in node_kwargs.items())
        unbacked = isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) and \
            isinstance(val.node.expr, sympy.Symbol)
        # a data-dependent scalar (``.item()``) is bound to its own symbol, which later sizes use
        name = self._claim(str(val.node.expr) if unbacked else base)
        view = any(r.alias_info is not None for r in target._schema.returns)
        layout = meta_layout(val) if isinstance(val, torch.Tensor) else None
        check = not extern_strides.trusted(target)  # aten may return other strides than traced
        dtype = val.dtype if isinstance(val, torch.Tensor) else None
        self.steps.append(ir.Extern(name, _target_name(target), args, kwargs, (node.name,), view, layout, check, dtype))
        if isinstance(val, torch.Tensor):
            self.layouts[name] = layout
            self.meta_offsets[name] = sym(val.storage_offset())
            return load_buffer(name, self.layouts[name], val.dtype)
        if isinstance(val, (tuple, list)):
            return ExternTuple(name)
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return val.node.expr
        return val

    # ---------------------------------------------------------------------------- program facts
    def device(self) -> str:
        for node in self.gm.graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                return str(val.device)
        return "cpu"

    def symbol_bindings(self) -> tuple[tuple[str, str], ...]:
        """How each size symbol is read from the inputs in ``call``: ``s0 = arg0_1.size(0)``."""
        bound: dict[str, str] = {}
        for inp in self.inputs:
            node = next(n for n in self.gm.graph.nodes if n.op == "placeholder" and n.name == inp.name)
            if inp.kind == "symint" and isinstance(self.env[node], sympy.Symbol):
                bound.setdefault(str(self.env[node]), inp.name)
        for inp in self.inputs:
            if inp.kind != "tensor":
                continue
            for kind, exprs in (("size", inp.layout.size), ("stride", inp.layout.stride)):
                for d, e in enumerate(exprs):
                    if isinstance(e, sympy.Symbol):
                        bound.setdefault(str(e), f"{inp.name}.{kind}({d})")
        return tuple(bound.items())


def _reads_nothing_along_rows(value: TensorValue) -> bool:
    """Whether every load of ``value`` reads one element per row (its index is free of the last
    dimension's symbol): written to memory, such a value would cost a write and a read of its whole
    size, where each reader recomputes it from a row's data (one-hots, masks, per-row scales)."""
    if not value.size or value.size[-1] == 1:
        return False
    return not any(_along_rows(load, value) for load in ir.loads(value.body))


def _along_rows(load: ir.Load, value: TensorValue) -> bool:
    """Whether ``load`` reads a different element along ``value``'s last dimension (not one per row)."""
    return ir.index_symbol(len(value.size) - 1) in sympy.sympify(load.index).free_symbols


CHEAP_OPS = 8  # expression nodes of a value that each reader recomputes rather than reads
# Arithmetic, comparisons and casts; no math function: RoPE's cos and sin of a (positions, dims) table,
# read by every layer's q and k, would be evaluated per element of each (1 ms a step more on a 1.1B Llama)
_RECOMPUTED_OPS = frozenset({"cast", "to_bf16", "add", "sub", "mul", "truediv", "neg", "abs", "reciprocal", "square",
                             "fmax", "fmin", "imax", "imin", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
                             "xor", "invert", "not", "where", "isnan"})


def _widens(value: TensorValue) -> bool:
    """Whether ``value`` is a few casts, arithmetic or comparisons on loads that read no more bytes
    per element than it has (a bf16 tensor cast to float32): written to memory, it would cost a write
    and a wider read by each reader, where each reader can read the narrow inputs and compute it again."""
    if not value.size or ir.size_of(value.body) > CHEAP_OPS:
        return False
    if any(isinstance(e, ir.Op) and e.name not in _RECOMPUTED_OPS for e in ir.walk(value.body)):
        return False
    loads = ir.loads(value.body)
    if any(load.indirect for load in loads):
        return False
    return sum(load.dtype.itemsize for load in loads if _along_rows(load, value)) <= value.dtype.itemsize


def _in_node(exc: Exception, node: torch.fx.Node, described: ir.Described) -> str:
    """``exc``'s message with the node being lowered (its aten op) and the user's source line, as
    torch.fx's interpreter re-raises an error with the node and its stack trace."""
    what = described.text if node.op == "call_function" else f"{node.name} = {node.op} {node.target}"
    where = f"While lowering {what}" + (f"\n  from {described.source}" if described.source else "")
    return f"{exc.args[0]}\n\n{where}" if exc.args else where


def _map(fn: Any, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (list if isinstance(value, list) else tuple)(_map(fn, v) for v in value)
    return fn(value)
