"""Kernel names, and the comment above each kernel: what it computes, in words a reader knows.

A kernel is named ``<kind>_fused_<parts>_<i>``: ``pw`` (pointwise) or ``red`` (reduction), what its
aten nodes compute, and its number in the module (``red_fused_layernorm_gelu_0``). The parts:

1. A recognised pattern names the nodes it takes (``PATTERNS``, tried in order, each as often as it
   matches): a ``var_mean`` with an ``rsqrt`` is a ``layernorm`` (a ``batchnorm`` where the kernel
   reduces over dimension 0 of several: the batch), ``amax, exp, sum, div`` a ``softmax``, an
   ``erf`` a ``gelu`` (as is GPT-2's ``pow`` with a ``tanh``). A pattern takes one node of each op
   it needs, so a second ``sum`` fused beside a softmax is a part of its own.
2. Every other node is a part under its op's name, except glue (``GLUE``: arithmetic, comparisons
   and selections, views, casts, copies, fills), which tells a reader nothing; a kernel of glue only
   is named by its glue.
3. Parts are ordered by their first node in the graph, each once (``_to_copy`` as ``to_copy``), at
   most ``MAX_PARTS`` of them.

The comment above a kernel lists its aten nodes, then the user's source lines they were traced
from (each node's ``stack_trace``, its innermost frame), each line once.
"""

from __future__ import annotations

import os
import re

from cgtrees.codegen import ir, printer
from cgtrees.codegen.scheduler import Kernel

PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("log_softmax", ("amax", "exp", "sum", "log")),
    ("softmax", ("amax", "exp", "sum", "div")),
    ("layernorm", ("var_mean", "rsqrt")),
    ("rmsnorm", ("pow", "mean", "rsqrt")),  # Llama's: x * rsqrt(x.pow(2).mean(-1) + eps)
    ("rmsnorm", ("mean", "rsqrt")),
    ("gelu_backward", ("erf", "exp")),  # the derivative of x * Phi(x) holds the normal density
    ("gelu", ("erf",)),
    ("gelu", ("pow", "tanh")),  # the tanh approximation as GPT-2 writes it, with x.pow(3)
    ("max_pool2d_backward", ("max_pool2d_with_indices_backward",)),
    ("max_pool2d", ("max_pool2d_with_indices",)),
)
GLUE = frozenset({
    "add", "sub", "mul", "div", "neg", "rsub",
    "eq", "ne", "lt", "le", "gt", "ge", "where", "arange", "iota",  # masks: a causal softmax is a softmax
    "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not",
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "squeeze", "unsqueeze",
    "slice", "select", "alias", "as_strided", "clone", "contiguous", "detach",
    "_to_copy", "convert_element_type", "copy", "copy_", "lift_fresh_copy",
    "full", "full_like", "scalar_tensor", "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like",
})
MAX_PARTS = 4
_OP = re.compile(r"\w+ = (?:aten|torch\.ops\.\w+)\.(\w+)\.")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)\n([^\n]*)', re.M)
_CODE_WIDTH = 100  # characters of a user's source line in a comment


def kernel_name(kernel: Kernel, described: dict[str, ir.Described], i: int) -> str:
    kind = "red" if kernel.is_reduction else "pw"
    return f"{kind}_fused_{'_'.join(parts(kernel, described))}_{i}"


def parts(kernel: Kernel, described: dict[str, ir.Described]) -> list[str]:
    """What the kernel computes, as the parts of its name (the module docstring's rule)."""
    nodes = [(o, op) for o in _origins(kernel, described) if (op := _op(described.get(o))) is not None]
    left = dict(enumerate(op for _, op in nodes))  # position in the graph -> op, not yet named
    named: list[tuple[int, str]] = []
    for pattern, needs in PATTERNS:
        while set(needs) <= set(left.values()):
            taken = [min(at for at, op in left.items() if op == need) for need in needs]
            for at in taken:
                del left[at]
            named.append((min(taken), _norm(pattern, kernel)))
    others = [(at, op) for at, op in left.items() if op not in GLUE]
    chosen = sorted(named + others) or sorted(left.items())
    return list(dict.fromkeys(name.lstrip("_") for _, name in chosen))[:MAX_PARTS] or ["kernel"]


def _norm(pattern: str, kernel: Kernel) -> str:
    """A batch norm's statistics are a layer norm's ops over the batch (dimension 0) instead of a row."""
    if pattern == "layernorm" and 0 in kernel.reduced and len(kernel.ranges) > 1:
        return "batchnorm"
    return pattern


def origin_comment(kernel: Kernel, described: dict[str, ir.Described]) -> list[str]:
    """The comment above a kernel: its index space, its aten nodes, their source lines."""
    origins = _origins(kernel, described)
    shape = ", ".join(printer.expr(n) for n in kernel.ranges)
    kind = f"reduction over dims {list(kernel.reduced)} of ({shape})" if kernel.is_reduction else f"pointwise ({shape})"
    lines = [f"# {kind}; from:"] + [f"#   {described[o].text if o in described else o}" for o in origins]
    sources = list(dict.fromkeys(described[o].source for o in origins if o in described and described[o].source))
    if sources:
        lines += ["# traced from:"] + [f"#   {s}" for s in sources]
    return lines


def source_line(stack_trace: str | None) -> str:
    """``model.py:42 in forward: y = F.gelu(self.ln(x))``: the innermost frame of an FX node's
    ``stack_trace`` (where the user's code called the op), or "" where there is none."""
    frames = _FRAME.findall(stack_trace or "")
    if not frames:
        return ""
    path, line, fn, code = frames[-1]
    code = code.strip()
    if len(code) > _CODE_WIDTH:
        code = code[:_CODE_WIDTH - 3] + "..."
    return f"{os.path.basename(path)}:{line} in {fn}" + (f": {code}" if code else "")


def _origins(kernel: Kernel, described: dict[str, ir.Described]) -> list[str]:
    """The kernel's aten nodes, each once, in graph order."""
    origins = list(dict.fromkeys(o for m in kernel.members for o in m.step.origins))
    order = {name: i for i, name in enumerate(described)}
    return sorted(origins, key=lambda o: order.get(o, 0))


def _op(node: ir.Described | None) -> str | None:
    """``mul`` for ``mul_3 = aten.mul.Tensor(...)``; None for what is not an op call."""
    match = _OP.match(node.text) if node is not None else None
    return match.group(1) if match else None
