"""Write one scheduled ``Kernel`` as a ``@triton.jit`` function.

Every kernel reads: program id -> offsets -> masks -> loads -> compute -> store (the Triton
tutorials' shape). Pointwise kernels are 1-D over ``xnumel`` elements. Reduction kernels are 2-D
blocks ``[XBLOCK rows, RBLOCK columns]``; a persistent one holds its whole row in registers, a looped
one walks the row in one loop per dependent reduction, a softmax's max and sum of exponentials in
one (``online_softmax``; the output is written in a last loop).

Which way a warp's lanes walk a 2-D block is Triton's choice, per load: its coalescing pass puts
them along the dimension whose contiguity its axis analysis proves. A load contiguous along a kept
dimension (ViT's first LayerNorm reads the convolution output with stride 1 along the tokens,
``r0*196 + x0*37632 + x1 - 1``) proves nothing when that dimension is cut out of ``xindex`` by
``% 197``; with nothing proved either way Triton 3.6 puts the lanes along dimension 0 (the rows),
which is the coalesced way for such a load, and joins it to the row-contiguous values through
shared memory (tests/test_codegen_reduction_layout.py reads this off the sm_90 TTGIR).

A kernel with a tail (a loss's sum over every row, and its mean) ends with it: ``tail.py``.

Kernels of one step of their own: a scan holds its whole row in a block (``tl.cumsum`` along the
columns); a scatter computes its values pointwise and writes each at the place its indices say
(``tl.store``, or ``tl.atomic_add`` where writes accumulate), masked where an index is out of range.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from cgtrees.codegen import heuristics, ir, online_softmax, ops, printer, tail
from cgtrees.codegen import kernel_facts as facts
from cgtrees.codegen.kernel_loads import LoadWriter
from cgtrees.codegen.kernel_text import Scope, bf16_literal, cast_text, is_literal, is_number, operand, plus
from cgtrees.codegen.scheduler import LATE, Kernel, Member
from cgtrees.codegen.simplify import fold, merge_dims

INT32_LIMIT = 2**31 - 1


_ARG = (ir.Reduce.ARGMAX, ir.Reduce.ARGMIN)  # reductions to an index


@dataclass(frozen=True)
class KernelCode:
    name: str
    source: str
    args: tuple[str, ...]  # call-site argument expressions, in parameter order
    ptr_dtypes: tuple[torch.dtype, ...]  # the element types of the pointer arguments (the first args)
    xnumel: sympy.Expr
    rnumel: sympy.Expr | None
    config: heuristics.Config
    helpers: frozenset[str]
    libdevice: bool
    workspace: tuple[tuple[str, torch.dtype], ...] = ()  # a tail's slots (one per program) per sum
    ticket: str | None = None  # the launch's counter of a kernel with a tail (``tail.emit``)


HELPERS = {
    "_max_nan": "@triton.jit\ndef _max_nan(a, b):\n    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)\n",
    "_min_nan": "@triton.jit\ndef _min_nan(a, b):\n    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)\n",
    "_prod": "@triton.jit\ndef _prod(a, b):\n    return a * b\n",
}


class KernelWriter(LoadWriter):
    def __init__(self, kernel: Kernel, name: str, interpret: bool) -> None:
        self.kernel = kernel
        self.ranges = kernel.ranges  # the kernel's dimensions, outermost first (``_follow_layout``)
        self.name = name
        self.interpret = interpret
        self.members = {m.name: m for m in kernel.members}
        self.tmp = 0
        self.ptrs: dict[str, str] = {}
        self.ptr_dtypes: dict[str, torch.dtype] = {}
        self.row_vars: dict[str, str] = {}
        self.helpers: set[str] = set()
        self.libdevice = False
        self.two_d = kernel.two_d
        self.targets: dict[str, tuple[ir.Indirect, ...]] = {}  # a scatter's indices, as its body sees them
        self.workspace: dict[str, torch.dtype] = {}  # a tail's slots, by buffer name

    # -------------------------------------------------------------------------------------- entry
    def write(self) -> KernelCode:
        bodies, stores = self._resolve()  # member loads -> registers / inlined expressions
        bodies, stores = self._follow_layout(bodies, stores)  # pointwise: walk the output in memory order
        bodies, stores, dims = self._simplify(bodies, stores)  # merge dims, name x*/r* symbols
        bodies, self.targets = self._fold(bodies)  # constants computed, identities dropped
        self.dims = dims
        xnumel = sympy.Mul(*[n for _, n, red in dims if not red])
        rnumel = sympy.Mul(*[n for _, n, red in dims if red]) if self.two_d else None
        inner = facts.reduces_innermost(bodies, dims)
        if any(m.step.alone and m.step.is_reduction for m in self.kernel.members):
            cfg = heuristics.scan(xnumel, rnumel, self.interpret)
        elif self.two_d:
            cfg = heuristics.reduction(xnumel, rnumel, inner, self.interpret)
        else:
            cfg = heuristics.pointwise(xnumel, self.interpret, len({x for b in bodies.values() for x in ir.loads(b)}))
        self.cfg = cfg
        self.int64 = self._needs_int64(bodies, stores, dims)
        outer = Scope(None, "    ")
        self._prologue(outer)
        if not self.two_d or cfg.persistent:
            self._emit_flat(outer, bodies, stores)
        else:
            self._emit_looped(outer, bodies, stores)
        tail.emit(self, outer, bodies, stores)  # sums over every row, finished by the last program
        return self._finish(outer, xnumel, rnumel)

    # ------------------------------------------------------------------------------- preparation
    def _resolve(self) -> tuple[dict[str, ir.Expr], dict[str, sympy.Expr]]:
        resolved: dict[str, ir.Expr] = {}
        bodies: dict[str, ir.Expr] = {}
        seen: set[str] = set()
        for m in self.kernel.members:
            body = self._replace(m.body(), seen, resolved)
            bodies[m.name] = body
            if m.role == "full":
                resolved[m.name] = _cast(body, m.step.dtype)
            if m.step.scatter is not None:
                self.targets[m.name] = tuple(self._replace(ir.map_indices(i, dict(m.subs)), seen, resolved)
                                             for i in m.step.scatter.indirect)
            seen.add(m.name)
        stores = {m.name: m.store_index() for m in self.kernel.members if m.name in self.kernel.stored}
        return bodies, stores

    def _replace(self, e: ir.Expr, seen: set[str], resolved: dict[str, ir.Expr]) -> ir.Expr:
        if isinstance(e, ir.Load) and e.buf in seen:
            member = self.members[e.buf]
            return resolved[e.buf] if member.role == "full" else ir.Ref(e.buf, member.step.dtype)
        return ir.map_children(e, lambda a: self._replace(a, seen, resolved))

    def _follow_layout(self, bodies: dict, stores: dict) -> tuple[dict, dict]:
        """A pointwise kernel walks its dimensions in the memory order of the first output it
        stores (a channels-last output: C fastest), so that neighbouring threads write neighbouring
        addresses; dimensions are renumbered outermost first. Reductions keep their order (an
        argmax's index and a scan's direction follow it)."""
        if self.two_d or self.targets or not stores:
            return bodies, stores
        order = facts.memory_order(next(iter(stores.values())), self.ranges)
        if order == list(range(len(self.ranges))):
            return bodies, stores
        subs = {ir.index_symbol(d): ir.index_symbol(i) for i, d in enumerate(order)}
        self.ranges = tuple(self.ranges[d] for d in order)
        return ({k: ir.map_indices(b, subs) for k, b in bodies.items()},
                {k: sympy.expand(sympy.sympify(i).xreplace(subs)) for k, i in stores.items()})

    def _simplify(self, bodies: dict, stores: dict) -> tuple[dict, dict, list]:
        exprs = [*bodies.values(), *(i for t in self.targets.values() for i in t)]
        indices = [ld.index for b in exprs for ld in ir.loads(b)]
        indices += [iv.index for b in exprs for iv in facts.index_values(b)]
        indices += list(stores.values())
        dims, subs = merge_dims(self.ranges, self.kernel.reduced, indices)
        bodies = {k: ir.map_indices(b, subs) for k, b in bodies.items()}
        self.targets = {k: tuple(ir.map_indices(i, subs) for i in t) for k, t in self.targets.items()}
        stores = {k: sympy.expand(sympy.sympify(i).xreplace(subs)) for k, i in stores.items()}
        return bodies, stores, dims

    def _fold(self, bodies: dict) -> tuple[dict, dict]:
        return ({k: fold(b) for k, b in bodies.items()},
                {k: tuple(fold(i) for i in t) for k, t in self.targets.items()})

    def _needs_int64(self, bodies: dict, stores: dict, dims: list) -> bool:
        maxes = {}
        for s, n, _ in dims:
            if not sympy.sympify(n).is_number:
                return True
            maxes[s] = max(int(n) - 1, 0)
        if sympy.Mul(*[n for _, n, _ in dims]) > INT32_LIMIT:
            return True
        exprs = [*bodies.values(), *(i for t in self.targets.values() for i in t)]
        indices = [ld.index for b in exprs for ld in ir.loads(b)] + list(stores.values())
        for index in indices:
            bound = sum(abs(t.xreplace(maxes)) for t in sympy.Add.make_args(sympy.expand(index)))
            if not sympy.sympify(bound).is_number or bound > INT32_LIMIT:
                return True
        return False

    # ---------------------------------------------------------------------------------- prologue
    def _prologue(self, scope: Scope) -> None:
        pid = "tl.program_id(0).to(tl.int64)" if self.int64 else "tl.program_id(0)"
        shape = "[:, None]" if self.two_d else ""
        scope.lines += [f"xoffset = {pid} * XBLOCK", f"xindex = xoffset + tl.arange(0, XBLOCK){shape}",
                        "xmask = xindex < xnumel"]
        scope.lines += self._decompose("x", "xindex")
        if self.two_d and not self.cfg.persistent:  # each step of the row loop adds its offset
            scope.lines.append(f"rbase = {self._rbase()}")

    def _rbase(self) -> str:
        base = "tl.arange(0, RBLOCK)[None, :]"
        return f"{base}.to(tl.int64)" if self.int64 else base

    def _decompose(self, kind: str, flat: str) -> list[str]:
        dims = [(s, n) for s, n, red in self.dims if red == (kind == "r")]
        lines, stride = [], sympy.Integer(1)
        for i, (s, n) in enumerate(reversed(dims)):
            outer = i == len(dims) - 1
            q = flat if stride == 1 else f"({flat} // {operand(stride)})"
            lines.append(f"{s.name} = {q}" if outer else f"{s.name} = {q} % {operand(n)}")
            stride = stride * n
        return list(reversed(lines))

    def _row_loop_header(self, scope: Scope, looped: bool) -> None:
        if looped:
            scope.lines += ["rindex = roffset + rbase"]
        else:
            scope.lines += [f"rindex = {self._rbase()}"]
        scope.lines += ["rmask = rindex < rnumel"] + self._decompose("r", "rindex")

    # ---------------------------------------------------------------------------------- emission
    def _emit_flat(self, scope: Scope, bodies: dict, stores: dict) -> None:
        if self.two_d:
            self._row_loop_header(scope, looped=False)
        for m in self.kernel.members:
            if m.role in LATE:
                continue  # tail.emit's
            if m.step.scatter is not None:
                self._scatter(m, self.value(bodies[m.name], scope), stores[m.name], scope)
            elif m.role == "reduce" and m.step.reduction.is_scan:
                value = self._full_value(bodies[m.name], scope)
                masked = self._var(scope, f"tl.where(xmask & rmask, {value}, {self._identity(m)})")
                scanned = self._var(scope, self._scan_text(m, masked))
                self._store(m, cast_text(scanned, m.step.body.dtype, m.step.dtype), stores[m.name], scope, full=True,
                            spans=True)
            elif m.role == "reduce":
                value = self._full_value(bodies[m.name], scope)
                masked = self._var(scope, f"tl.where(xmask & rmask, {value}, {self._identity(m)})")
                self._finish_reduction(m, self._reduce_text(m, masked), scope, stores)
            elif m.role == "row":
                self._emit_row(m, bodies, stores, scope)
            elif m.name in stores:
                self._store(m, self.value(bodies[m.name], scope), stores[m.name], scope, full=True,
                            spans=facts.spans_block(self.two_d, bodies[m.name], full=True))

    def _emit_looped(self, outer: Scope, bodies: dict, stores: dict) -> None:
        online = online_softmax.pairs(self.kernel.members, bodies)  # {sum of exp: its max}, one loop
        early = tuple(m for m in self.kernel.members if m.role not in LATE)  # the tail is tail.emit's
        loop_of, avail = facts.loop_levels(early, bodies, online)
        loops = max(loop_of.values(), default=0) + 1
        for loop in range(loops):
            for m in self.kernel.members:
                if m.role == "row" and avail[m.name] == loop:
                    self._emit_row(m, bodies, stores, outer)
            accs, where = {}, {}  # where: an argmax's or argmin's index of each lane's best value
            for m in self.kernel.members:
                if m.role == "reduce" and loop_of[m.name] == loop:
                    accs[m.name] = self._var(outer, f"tl.full([XBLOCK, RBLOCK], {self._identity(m)}, "
                                                    f"{printer.TRITON_DTYPES[m.step.body.dtype]})", prefix="acc")
                    if m.step.reduction in _ARG:
                        where[m.name] = self._var(outer, "tl.full([XBLOCK, RBLOCK], 0, tl.int32)", prefix="acc")
            if not accs and not any(loop_of.get(m.name) == loop and m.name in stores for m in self.kernel.members):
                continue  # its members are read in registers only, by members of later loops
            outer.lines.append("for roffset in range(0, rnumel, RBLOCK):")
            inner = Scope(outer, outer.indent + "    ")
            self._row_loop_header(inner, looped=True)
            for m in self.kernel.members:
                if loop_of.get(m.name) != loop or m.name in online:
                    continue
                if m.role == "reduce" and m.name in where:
                    self._arg_step(m, accs[m.name], where[m.name], self._full_value(bodies[m.name], inner), inner)
                elif m.role == "reduce":
                    value = self._full_value(bodies[m.name], inner)
                    acc = accs[m.name]
                    combined = self._combine(m, acc, value)
                    for total in [s for s, top in online.items() if top == m.name]:  # before the max grows
                        combined = self._online_step(acc, accs[total], value, inner)
                    inner.lines.append(f"{acc} = tl.where(xmask & rmask, {combined}, {acc})")
                elif m.name in stores:
                    self._store(m, self.value(bodies[m.name], inner), stores[m.name], inner, full=True,
                                spans=facts.spans_block(self.two_d, bodies[m.name], full=True))
            outer.lines += [inner.indent[len(outer.indent):] + line for line in inner.lines]
            for name, acc in accs.items():
                m = self.members[name]
                if name in online:
                    text = online_softmax.total(accs[online[name]], acc, self._var(outer, online_softmax.shift(
                        self.row_vars[online[name]])))
                else:
                    text = self._arg_text(m, acc, where[name], outer) if name in where else self._reduce_text(m, acc)
                self._finish_reduction(m, text, outer, stores)
        for m in self.kernel.members:
            if m.role == "row" and avail[m.name] == loops:
                self._emit_row(m, bodies, stores, outer)

    def _arg_step(self, m: Member, acc: str, where: str, value: str, scope: Scope) -> None:
        """A looped argmax (argmin) keeps each lane's best value and its index: a strictly better value
        replaces them, so a lane keeps the first of equal ones; a NaN is better than any number, as
        in eager's, and the first NaN stays."""
        op = ">" if m.step.reduction == ir.Reduce.ARGMAX else "<"
        better = f"({value} {op} {acc})"
        if m.step.body.dtype.is_floating_point:
            better = f"({better} | (({value} != {value}) & ({acc} == {acc})))"
        better = self._var(scope, f"xmask & rmask & {better}")
        scope.lines.append(f"{where} = tl.where({better}, rindex, {where})")
        scope.lines.append(f"{acc} = tl.where({better}, {value}, {acc})")

    def _arg_text(self, m: Member, acc: str, where: str, scope: Scope) -> str:
        """The row's index: the first among the lanes whose best value is the row's best (a NaN, where
        a lane holds one)."""
        fn = "tl.max" if m.step.reduction == ir.Reduce.ARGMAX else "tl.min"
        best = self._var(scope, f"{fn}({acc}, 1)[:, None]")
        held = f"{acc} == {best}"
        if m.step.body.dtype.is_floating_point:
            nan = self._var(scope, f"{acc} != {acc}")
            held = f"tl.where(tl.max({nan}.to(tl.int32), 1)[:, None] > 0, {nan}, {held})"
        return f"tl.min(tl.where({held}, {where}, 2147483647), 1)[:, None]"

    def _online_step(self, acc_m: str, acc_s: str, value: str, scope: Scope) -> str:
        """Add ``value`` to a running sum of exponentials (``online_softmax``); the new running max."""
        grown = self._var(scope, online_softmax.grown(acc_m, value))
        shifted = self._var(scope, online_softmax.shift(grown))
        rescaled = online_softmax.rescaled(acc_m, acc_s, value, shifted)
        scope.lines.append(f"{acc_s} = tl.where(xmask & rmask, {rescaled}, {acc_s})")
        return grown

    def _emit_row(self, m: Member, bodies: dict, stores: dict, scope: Scope) -> None:
        value = self.value(bodies[m.name], scope)
        self.row_vars[m.name] = self._var(scope, cast_text(value, bodies[m.name].dtype, m.step.dtype))
        if m.name in stores:
            self._store(m, self.row_vars[m.name], stores[m.name], scope, full=False,
                        spans=facts.spans_block(self.two_d, bodies[m.name], full=False))

    def _finish_reduction(self, m: Member, text: str, scope: Scope, stores: dict) -> None:
        var = self._var(scope, text)
        result_dtype = torch.int32 if m.step.reduction in (ir.Reduce.ARGMAX, ir.Reduce.ARGMIN) else m.step.body.dtype
        self.row_vars[m.name] = self._var(scope, cast_text(var, result_dtype, m.step.dtype)) \
            if result_dtype != m.step.dtype else var
        if m.name in stores:
            self._store(m, self.row_vars[m.name], stores[m.name], scope, full=False, spans=True)  # [XBLOCK, 1]

    def _store(self, m: Member, value: str, index: sympy.Expr, scope: Scope, full: bool, spans: bool) -> None:
        """Store ``value`` (which has the stored block's shape already where ``spans``)."""
        shape = ("[XBLOCK, RBLOCK]" if full else "[XBLOCK, 1]") if self.two_d else "[XBLOCK]"
        mask = "xmask & rmask" if (self.two_d and full) else "xmask"
        dtype = printer.TRITON_DTYPES[m.step.dtype]
        if is_literal(value) and self.interpret and m.step.dtype == torch.bfloat16:
            # the interpreter has no bfloat16 constants: fill float32 with the value eager rounds to
            value = f"tl.full({shape}, {bf16_literal(value)}, tl.float32).to(tl.bfloat16)"
        elif is_literal(value):
            value = f"tl.full({shape}, {value}, {dtype})"
        elif not spans:
            value = f"tl.broadcast_to({value}, {shape})"
        ptr = self._ptr(m.name, m.step.dtype)
        offset = printer.expr(index, triton=True)
        kinds = facts.symbol_kinds(index)
        if "x" not in kinds or (self.two_d and full and "r" not in kinds):  # pointer must span the block
            offset = plus(offset, f"tl.zeros({shape}, tl.int32)")
        scope.lines.append(f"tl.store({ptr} + ({offset}), {value}, {mask})")

    def _scatter(self, m: Member, value: str, index: sympy.Expr, scope: Scope) -> None:
        """Write (or atomically add) each element where its indices say, where they are in range."""
        subs, conds = {}, ["xmask"]
        for k, ind in enumerate(self.targets[m.name]):
            var, ok = self._indirect(ind, scope)
            subs[ir.indirect_symbol(k)] = sympy.Symbol(var, integer=True)
            conds.append(ok)
        offset = printer.expr(sympy.sympify(index).xreplace(subs), triton=True)
        if "x" not in facts.symbol_kinds(index).union(*(facts.kinds(i) for i in self.targets[m.name])):
            offset += " + tl.zeros([XBLOCK], tl.int32)"  # pointers must span the block
        dtype = printer.TRITON_DTYPES[m.step.dtype]
        if is_literal(value) and self.interpret and m.step.dtype == torch.bfloat16:
            value = f"tl.full([XBLOCK], {bf16_literal(value)}, tl.float32).to(tl.bfloat16)"  # no bf16 constants
        elif is_literal(value):
            value = f"tl.full([XBLOCK], {value}, {dtype})"
        else:
            value = f"tl.broadcast_to({cast_text(value, m.step.body.dtype, m.step.dtype)}, [XBLOCK])"
        ptr, mask = self._ptr(m.name, m.step.dtype), " & ".join(conds)
        if m.step.scatter.mode == ir.Write.ADD:
            scope.lines.append(f"tl.atomic_add({ptr} + ({offset}), {value}, {mask}, sem=\"relaxed\")")
        else:
            scope.lines.append(f"tl.store({ptr} + ({offset}), {value}, {mask})")

    def _scan_text(self, m: Member, value: str) -> str:
        if m.step.reduction == ir.Reduce.CUMSUM:
            return f"tl.cumsum({value}, 1)"
        self.helpers.add("_prod")
        return f"tl.associative_scan({value}, 1, _prod)"

    # ----------------------------------------------------------------------------- reductions
    def _full_value(self, body: ir.Expr, scope: Scope) -> str:
        value = self.value(body, scope)
        dtype = printer.TRITON_DTYPES[body.dtype]
        if is_literal(value):
            return self._var(scope, f"tl.full([XBLOCK, RBLOCK], {value}, {dtype})")
        if facts.spans_block(self.two_d, body, full=True):
            return value
        return self._var(scope, f"tl.broadcast_to({value}, [XBLOCK, RBLOCK])")

    def _identity(self, m: Member) -> str:
        dtype = m.step.body.dtype
        kind = m.step.reduction
        if kind in (ir.Reduce.SUM, ir.Reduce.CUMSUM):
            return "0"
        if kind in (ir.Reduce.PROD, ir.Reduce.CUMPROD):
            return "1"
        high = kind in (ir.Reduce.MIN, ir.Reduce.ARGMIN)
        if m.step.dtype == torch.bool:
            return "1" if high else "0"
        if dtype.is_floating_point:
            return 'float("inf")' if high else 'float("-inf")'
        info = torch.iinfo(dtype)
        return str(info.max if high else info.min)

    def _combine(self, m: Member, acc: str, value: str) -> str:
        kind, is_float = m.step.reduction, m.step.body.dtype.is_floating_point
        if kind == ir.Reduce.SUM:
            return f"{acc} + {value}"
        if kind == ir.Reduce.PROD:
            return f"{acc} * {value}"
        fn = "tl.maximum" if kind == ir.Reduce.MAX else "tl.minimum"
        nan = ", propagate_nan=tl.PropagateNan.ALL" if is_float else ""
        return f"{fn}({acc}, {value}{nan})"

    def _reduce_text(self, m: Member, value: str) -> str:
        kind, is_float = m.step.reduction, m.step.body.dtype.is_floating_point
        if kind == ir.Reduce.SUM:
            return f"tl.sum({value}, 1)[:, None]"
        if kind == ir.Reduce.PROD:
            self.helpers.add("_prod")
            return f"tl.reduce({value}, 1, _prod)[:, None]"
        if kind in (ir.Reduce.MAX, ir.Reduce.MIN):
            if is_float and self.interpret:  # custom combine functions are per-element Python there
                fn = "tl.max" if kind == ir.Reduce.MAX else "tl.min"
                nans = f"tl.sum(({value} != {value}).to(tl.int32), 1)[:, None] > 0"
                return f"tl.where({nans}, float(\"nan\"), {fn}({value}, 1)[:, None])"
            if is_float:
                helper = "_max_nan" if kind == ir.Reduce.MAX else "_min_nan"
                self.helpers.add(helper)
                return f"tl.reduce({value}, 1, {helper})[:, None]"
            return f"tl.{'max' if kind == ir.Reduce.MAX else 'min'}({value}, 1)[:, None]"
        fn = "tl.argmax" if kind == ir.Reduce.ARGMAX else "tl.argmin"
        if is_float:  # eager's index is the first NaN's where the row has one (numpy's too)
            nan = f"({value} != {value}).to(tl.int32)"
            return f"tl.where(tl.max({nan}, 1)[:, None] > 0, tl.argmax({nan}, 1)[:, None], {fn}({value}, 1)[:, None])"
        return f"{fn}({value}, 1)[:, None]"

    # ---------------------------------------------------------------------------------- values
    def value(self, e: ir.Expr, scope: Scope) -> str:
        if isinstance(e, ir.Const):
            if isinstance(e.value, sympy.Expr):
                text = printer.expr(e.value, triton=True)
                return text if e.value.is_Atom else f"({text})"  # an operand of the op it is in
            return printer.literal(e.value)
        if isinstance(e, ir.Ref):
            return self.row_vars[e.name]
        if isinstance(e, ir.Indirect):
            return self._indirect(e, scope)[0]
        hit = scope.find(e)
        if hit is not None:
            return hit
        if isinstance(e, ir.Load):
            text = self._load_text(e, scope)
        elif isinstance(e, ir.IndexValue):
            index = printer.expr(e.index, triton=True)
            text = f"({index})" if e.index.free_symbols else f"tl.full([1], {index}, tl.int64)"
            text += f".to({printer.TRITON_DTYPES[e.dtype]})"
        else:
            text = self._op_text(e, scope)
        var = self._var(scope, text)
        scope.cache[e] = var
        return var

    def _op_text(self, e: ir.Op, scope: Scope) -> str:
        args = [self.value(a, scope) for a in e.args]
        if e.name == "cast":
            return cast_text(args[0], e.args[0].dtype, e.dtype)
        text = ops.template(e.name, self.interpret)
        if ops.uses_libdevice(text):
            self.libdevice = True
        return text.format(*args)

    def _var(self, scope: Scope, text: str, prefix: str = "tmp") -> str:
        """A variable holding ``text``: the one that holds it already where this scope or a parent
        computed it, ``text`` itself where it is a name or a literal (no ``tmp5 = tmp4``), else a
        new one. Accumulators (``acc``) are assigned again in their loop: always new."""
        if prefix == "tmp":
            if text.isidentifier() or is_number(text):
                return text
            hit = scope.find_text(text)
            if hit is not None:
                return hit
        name = f"{prefix}{self.tmp}"
        self.tmp += 1
        scope.lines.append(f"{name} = {text}")
        if prefix == "tmp":
            scope.texts[text] = name
        return name

    def _ptr(self, buf: str, dtype: torch.dtype) -> str:
        self.ptr_dtypes.setdefault(buf, dtype)
        return self.ptrs.setdefault(buf, f"{buf}_ptr")

    # ----------------------------------------------------------------------------------- finish
    def _finish(self, body: Scope, xnumel: sympy.Expr, rnumel: sympy.Expr | None) -> KernelCode:
        sizes = sorted({s.name for s in facts.size_symbols(self.kernel, xnumel, rnumel)})
        # The interpreter cannot use a runtime int as a loop bound (numpy 2 refuses ``int()`` of a
        # 1-element array), so there the row length is a constexpr; compiled kernels keep it dynamic.
        rnumel_param = "rnumel: tl.constexpr" if self.interpret else "rnumel"
        params = list(self.ptrs.values()) + sizes + ["xnumel"] + ([rnumel_param] if self.two_d else [])
        programs = ["programs: tl.constexpr" if self.interpret else "programs"] if self.workspace else None
        params += programs or []
        params += ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.two_d else [])
        params += ["PBLOCK: tl.constexpr"] if self.workspace else []
        lines = ["@triton.jit", f"def {self.name}({', '.join(params)}):"]
        lines += [body.indent + line for line in body.lines]
        args = tuple(self.ptrs) + tuple(sizes) + (printer.expr(xnumel),) + \
            ((printer.expr(rnumel),) if self.two_d else ()) + \
            ((tail.programs(xnumel, self.cfg.xblock),) if programs is not None else ())
        return KernelCode(self.name, "\n".join(lines) + "\n", args, tuple(self.ptr_dtypes[b] for b in self.ptrs),
                          xnumel, rnumel, self.cfg, frozenset(self.helpers), self.libdevice,
                          tuple(self.workspace.items()), f"{self.name}_ticket" if self.workspace else None)


def _cast(e: ir.Expr, dtype: torch.dtype) -> ir.Expr:
    return e if e.dtype == dtype else ir.Op("cast", (e,), dtype)


def write_kernel(kernel: Kernel, name: str, interpret: bool) -> KernelCode:
    return KernelWriter(kernel, name, interpret).write()

