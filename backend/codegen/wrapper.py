"""Write the kernel module: header, kernels (each under the aten nodes it came from), and
``call(args)`` that allocates, launches, calls aten and frees every buffer at its last use (reusing
the memory of dead buffers of the same size). ``aten_call`` writes the same graph straight through
aten: the loaded module's fallback when a kernel fails to compile, kept beside the module's text
(``CompiledGraph.fallback``), not in it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx

from cgtrees.codegen import extern_strides, ir, library_calls, printer
from cgtrees.codegen.kernel import HELPERS, KernelCode, write_kernel
from cgtrees.codegen.naming import kernel_name, origin_comment
from cgtrees.codegen.scheduler import Item, Kernel, reads
from cgtrees.codegen.tail import TAIL_BLOCK
from cgtrees.compiled import KernelLaunch

# our own library ops, and the module a generated module imports to register each
OUR_OPS = {"torch.ops.cgtrees.grouped_mm": "cgtrees.codegen.grouped_gemv",
           "torch.ops.cgtrees.mm_silu_mul": "cgtrees.codegen.gemv_silu_mul",
           "torch.ops.cgtrees.add_rmsnorm_grouped_mm": "cgtrees.codegen.gemv_add_rmsnorm",
           "torch.ops.cgtrees.add_rmsnorm_mm_silu_mul": "cgtrees.codegen.gemv_add_rmsnorm",
           "torch.ops.cgtrees.decode_attention": "cgtrees.codegen.decode_attention"}


def _callee(target: str) -> str:
    """What ``call`` calls for an extern: for one of our ops, its Python (``<op>_direct``, what the
    op runs), without the dispatcher, the op's autograd layer and the wrapper that keeps Dynamo out
    of its kernel (15 us a call against 3 on a CPU, paid by every eager call and every recording:
    a 1.1B Llama's decode step makes 111); any other op as traced."""
    op, _, overload = target.rpartition(".")
    if op in OUR_OPS and overload == "default":
        return f"{OUR_OPS[op]}.{op.rpartition('.')[2]}_direct"
    return target


# ------------------------------------------------------------------------------------------ module
@dataclass(frozen=True)
class ModuleText:
    """The module's source and what is known of it without reading it back."""

    source: str
    kernels: tuple[str, ...]
    launches: int
    precompile: tuple[KernelLaunch, ...]
    library_calls: tuple[str, ...]


def module_source(header: list[str], program: ir.Program, items: list[Item], interpret: bool) -> ModuleText:
    """The whole module text, its kernels, launches per call, and the library calls of ``call``."""
    described = dict(program.described)
    codes: list[tuple[Kernel, KernelCode]] = []
    for item in items:
        if isinstance(item, Kernel):
            codes.append((item, write_kernel(item, kernel_name(item, described, len(codes)), interpret)))
    libdevice = any(c.libdevice for _, c in codes)
    helpers = sorted(set().union(*(c.helpers for _, c in codes)) if codes else set())
    checks = _stride_checks(program, items)
    out = [*header, *(["import logging"] if checks else []), "import math", "import operator", "", "import torch",
           "import triton", "import triton.language as tl"]
    if libdevice:
        out.append("from triton.language.extra import libdevice")
    externs = [s.target for s in program.steps if isinstance(s, ir.Extern)]
    ours = [op for op in OUR_OPS if any(t.startswith(op + ".") for t in externs)]
    out += ["", *(f"import {OUR_OPS[op]}  # noqa: F401 - registers {op}" for op in ours)] if ours else []
    out += ["", "aten = torch.ops.aten", f"DEVICE = torch.device({program.device!r})", ""]
    if checks:
        out += ["", extern_strides.HELPER]
    for h in helpers:
        out += ["", HELPERS[h]]
    for kernel, code in codes:
        out += ["", *origin_comment(kernel, described), code.source]
    out += ["", *_call(program, items, dict((id(k), c) for k, c in codes), checks), "",
            "def run(*args):", '    """Call the graph with positional arguments (for experiments)."""',
            "    return call(list(args))", ""]
    kernel_codes = [c for _, c in codes]
    return ModuleText("\n".join(out), tuple(c.name for c in kernel_codes), launches(items, kernel_codes),
                      () if interpret else _precompile_list(kernel_codes), library_calls.specs(program))


def _precompile_list(codes: list[KernelCode]) -> tuple[KernelLaunch, ...]:
    """Each kernel with the argument types of its launch (dtypes for pointers, the sizes as ints), for
    ``precompile`` to compile them all at once before the first call. A kernel whose sizes are
    symbolic or zero is left to compile at its launch."""
    out = []
    for code in codes:
        sizes = [sympy.sympify(a) if not a.isidentifier() else None for a in code.args[len(code.ptr_dtypes):]]
        if any(n is None or not n.is_number for n in sizes) or int(sympy.sympify(code.xnumel)) == 0:
            continue
        meta = [("XBLOCK", code.config.xblock), *([("RBLOCK", code.config.rblock)] if code.rnumel is not None else []),
                *([("PBLOCK", TAIL_BLOCK)] if code.workspace else []), ("num_warps", code.config.num_warps)]
        out.append(KernelLaunch(code.name, tuple(str(d).removeprefix("torch.") for d in code.ptr_dtypes),
                                tuple(int(n) for n in sizes), tuple(meta)))
    return tuple(out)


def _stride_checks(program: ir.Program, items: list[Item]) -> dict[str, ir.Layout]:
    """The buffers that ``call`` gives their traced strides as aten returns them (extern_strides):
    every tensor an aten call that is not trusted returns, itself or as an item of a tuple. Where a
    traced stride names a size that ``call`` cannot read (no such case is known), the value goes
    unchecked."""
    bound = {s for s, _ in program.symbols} | {item.name for item in items if isinstance(item, ir.Extern)}
    untrusted = {item.name for item in items if isinstance(item, ir.Extern) and item.check_strides}
    checks = {}
    for item in items:
        if isinstance(item, ir.Extern):
            source = item.name
        elif isinstance(item, ir.Alias) and item.item is not None:
            source = item.base  # an item of the tuple an aten call returned
        else:
            continue
        if source not in untrusted or item.layout is None:
            continue
        names = {s.name for st in item.layout.stride for s in sympy.sympify(st).free_symbols}
        if names <= bound:
            checks[item.name] = item.layout
    return checks


def launches(items: list[Item], codes: list[KernelCode]) -> int:
    """The kernels (with work to do: a zero-size one is a comment) and aten calls of one call."""
    return (sum(1 for c in codes if sympy.sympify(c.xnumel) != 0 or c.workspace)  # a tail runs over no rows too
            + sum(1 for item in items if isinstance(item, ir.Extern)))


def _call(program: ir.Program, items: list[Item], codes: dict[int, KernelCode],
          checks: dict[str, ir.Layout]) -> list[str]:
    lines = ["def call(args):"]
    names = [inp.name for inp in program.inputs]
    if names:
        lines.append(f"    {', '.join(names)}, = args")
    lines.append("    args.clear()")
    lines += [f"    {name} = {name}.to(DEVICE)  # the caller's CPU scalar (codegen.device_scalars)"
              for name in program.device_scalars]
    lines += [f"    {s} = {src}" for s, src in program.symbols]
    outputs = {o for o in program.outputs if isinstance(o, str)}
    last = _last_uses(items)
    pinned = set(outputs) | {inp.name for inp in program.inputs} | _viewed(items)
    reuse = _plan_reuse(items, last, pinned, outputs)  # new buffer -> dead buffer whose memory it takes
    for i, item in enumerate(items):
        if isinstance(item, Kernel):
            lines += _launch(item, codes[id(item)], reuse)
        elif isinstance(item, ir.Extern):
            args = ", ".join([_arg(a) for a in item.args] + [f"{k}={_arg(v)}" for k, v in item.kwargs])
            lines.append(f"    {item.name} = {_callee(item.target)}({args})")
        elif item.item is not None:
            lines.append(f"    {item.name} = {item.base}[{item.item}]")
        else:
            lay = item.layout
            lines.append(f"    {item.name} = torch.as_strided({item.base}, {_tuple(lay.size)}, {_tuple(lay.stride)}, "
                         f"{_offset(item.base, lay.offset)})")
        if not isinstance(item, Kernel) and item.name in checks:
            lines.append(extern_strides.check_line(item.name, _tuple(checks[item.name].stride)))
        dead = sorted(n for n, at in last.items() if at == i and n not in outputs and n not in reuse.values())
        if dead:
            lines.append(f"    del {', '.join(dead)}")
    rendered = [o if isinstance(o, str) else _arg(o) for o in program.outputs]
    lines.append(f"    return ({rendered[0]},)" if len(rendered) == 1 else f"    return ({', '.join(rendered)})")
    return lines


def _launch(kernel: Kernel, code: KernelCode, reuse: dict[str, str]) -> list[str]:
    lines = []
    for m in kernel.members:
        if m.name in kernel.stored and not m.step.writes_input:
            lines += _allocate(m.step, reuse.get(m.name))
    cfg = code.config
    grid = sympy.sympify(code.xnumel)
    if code.workspace:  # a tail: launched over no rows too, its program count the kernel's last argument
        return lines + _workspace(code) + [f"    {code.name}[({code.args[-1]},)]({', '.join(code.args)}, "
                                           f"{_blocks(code)}, num_warps={cfg.num_warps})"]
    if grid.is_number:
        if int(grid) == 0:
            return lines + [f"    # {code.name}: nothing to compute (zero-size)"]
        grid_text = str(-(-int(grid) // cfg.xblock))
    else:
        grid_text = f"triton.cdiv({printer.expr(grid)}, {cfg.xblock})"
    launch = f"{code.name}[({grid_text},)]({', '.join(code.args)}, {_blocks(code)}, num_warps={cfg.num_warps})"
    if grid.is_number:
        return lines + [f"    {launch}"]
    return lines + [f"    if {printer.expr(grid)} > 0:", f"        {launch}"]


def _blocks(code: KernelCode) -> str:
    cfg = code.config
    blocks = f"XBLOCK={cfg.xblock}" + (f", RBLOCK={cfg.rblock}" if code.rnumel is not None else "")
    return blocks + (f", PBLOCK={TAIL_BLOCK}" if code.workspace else "")


def _workspace(code: KernelCode) -> list[str]:
    """A tail's slots, one per program for each sum, and its ticket counter at 0 (``tail.emit``): the
    launch's own, so launches at once on two streams never share them."""
    return [f"    {slots} = torch.empty(({code.args[-1]},), dtype={dtype}, device=DEVICE)"
            for slots, dtype in code.workspace] + \
        [f"    {code.ticket} = torch.zeros((1,), dtype=torch.int32, device=DEVICE)  # the last program adds the slots"]


def _allocate(step: ir.Compute, old: str | None) -> list[str]:
    lay = step.layout
    if old is not None:
        return [f"    {step.name} = torch.as_strided({old}, {_tuple(lay.size)}, {_tuple(lay.stride)})  # reuses {old}",
                f"    del {old}"]
    return [f"    {step.name} = torch.empty_strided({_tuple(lay.size)}, {_tuple(lay.stride)}, dtype={step.dtype}, "
            "device=DEVICE)"]


def _offset(base: str, offset: sympy.Expr) -> str:
    """``base``'s storage offset plus ``offset`` (``x.storage_offset()``, not ``... + 0``)."""
    offset = sympy.sympify(offset)
    if offset == 0:
        return f"{base}.storage_offset()"
    if offset.is_number and offset < 0:
        return f"{base}.storage_offset() - {printer.expr(-offset)}"
    return f"{base}.storage_offset() + {printer.expr(offset)}"


def _plan_reuse(items: list[Item], last: dict[str, int], pinned: set[str], outputs: set[str]) -> dict[str, str]:
    """Give a new buffer the memory of a dead one of the same dtype and storage size."""
    pool: dict[tuple, list[str]] = {}
    owned: dict[str, tuple] = {}
    reuse: dict[str, str] = {}
    for i, item in enumerate(items):
        if isinstance(item, Kernel):
            for m in item.members:
                if m.name not in item.stored or m.step.writes_input:
                    continue
                key = (m.step.dtype, sympy.expand(_storage_numel(m.step.layout)))
                if pool.get(key) and m.name not in pinned:
                    reuse[m.name] = pool[key].pop()
                owned[m.name] = key
        for name, at in last.items():
            if at == i and name in owned and name not in pinned and name not in outputs:
                pool.setdefault(owned.pop(name), []).append(name)
    return reuse


def _storage_numel(layout: ir.Layout) -> sympy.Expr:
    return sympy.Integer(1) + sum(((n - 1) * s for n, s in zip(layout.size, layout.stride)), sympy.Integer(0))


_ITEM = "aten._local_scalar_dense.default"  # ``u0 = aten._local_scalar_dense(t)``: a tensor's ``.item()``


def _last_uses(items: list[Item]) -> dict[str, int]:
    """Where each buffer is read last, so ``call`` deletes it there. A data-dependent scalar (``u0 =
    aten._local_scalar_dense(...)``, a tensor's ``.item()``) is read by name in sizes, kernel
    arguments and checks that ``reads`` does not see: it stays to the end (a Python number)."""
    last: dict[str, int] = {}
    for i, item in enumerate(items):
        for name in reads(item) | _written_inputs(item):
            last[name] = i
        for name in _defines(item):
            if not (isinstance(item, ir.Extern) and item.target == _ITEM):
                last.setdefault(name, i)
    return last


def _written_inputs(item: Item) -> set[str]:
    """Graph inputs a kernel stores into (``aten.copy_`` back into a mutated input): a use, too."""
    if not isinstance(item, Kernel):
        return set()
    return {m.name for m in item.members if m.step.writes_input}


def _defines(item: Item) -> list[str]:
    if isinstance(item, Kernel):
        return [m.name for m in item.members if m.name in item.stored]
    return [item.name]


def _viewed(items: list[Item]) -> set[str]:
    """Buffers whose memory something else may still see (aliases, aten views): never reused."""
    out: set[str] = set()
    for item in items:
        if isinstance(item, ir.Alias):
            out.add(item.base)
        elif isinstance(item, ir.Extern) and item.returns_view:
            out |= reads(item)
    return out


def _tuple(values: tuple) -> str:
    items = [printer.expr(v) for v in values]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _arg(v: Any) -> str:
    if isinstance(v, ir.BufRef):
        return v.name
    if isinstance(v, (list, tuple)):
        inner = [_arg(x) for x in v]
        return "[" + ", ".join(inner) + "]" if isinstance(v, list) else "(" + "".join(x + ", " for x in inner) + ")"
    return printer.value(v)


# -------------------------------------------------------------------------------------- aten path
def aten_call(gm: torch.fx.GraphModule, name: str = "call_aten") -> list[str]:
    """The graph as straight-line aten calls, freeing values at their last use."""
    nodes = list(gm.graph.nodes)
    last: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            last[inp] = node
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    lines = [f"def {name}(args):"]
    if placeholders:
        lines.append(f"    {', '.join(placeholders)}, = args")
    lines.append("    args.clear()")
    for node in nodes:
        if node.op == "call_function":
            lines.append(f"    {node.name} = {_aten_expr(node)}")
        elif node.op == "output":
            results = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            lines.append(f"    return {_render(tuple(results))}")
        elif node.op != "placeholder":
            raise NotImplementedError(f"{node.op} nodes are not written into kernel modules")
        dead = [n.name for n in node.all_input_nodes if last.get(n) is node and node.op != "output"]
        dead += [node.name] if node.op == "call_function" and not node.users else []
        if dead:
            lines.append(f"    del {', '.join(dict.fromkeys(dead))}")
    return lines


def _aten_expr(node: torch.fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return f"{node.args[0].name}[{_render(node.args[1])}]"
    args = [_render(a) for a in node.args] + [f"{k}={_render(v)}" for k, v in node.kwargs.items()]
    return f"{_callable(target)}({', '.join(args)})"


def _callable(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = "aten" if target.namespace == "aten" else f"torch.ops.{target.namespace}"
        return f"{ns}.{target.__name__}"
    module = {"_operator": "operator", "builtins": "", "math": "math"}.get(target.__module__, None)
    if module is None and target.__module__.startswith("torch") and getattr(torch, target.__name__, None) is target:
        module = "torch"
    if module is None:
        raise NotImplementedError(f"cannot write a call to {target}")
    return f"{module}.{target.__name__}" if module else target.__name__


def _render(v: Any) -> str:
    if isinstance(v, torch.fx.Node):
        return v.name
    if isinstance(v, (list, tuple)):
        inner = [_render(x) for x in v]
        return "[" + ", ".join(inner) + "]" if isinstance(v, list) else "(" + "".join(x + ", " for x in inner) + ")"
    return printer.value(v)
