"""A kernel's tail (``scheduler``: a loss's sum over every row, and its mean), written at its end: each
program writes its rows' share of each sum to its slot of a workspace (``<name>_parts``, one slot a
program), then takes a ticket (an atomic add on a counter); the program whose ticket is the last adds
the slots in program order (the same sum on every run, unlike atomic float adds), computes the final
members and stores them. The ticket's acquire-release orders the slots' writes before the last
program's reads, which are volatile (past L1), as in CUDA's threadfence reduction. The workspace and
the counter are the launch's own, made by ``call`` (the counter zeroed: one memset): two launches of
the same kernel at once, on two streams or in two threads' CUDA graphs, never share them
(``tests/gpu/test_loss_tail_gpu.py`` checks the ordering over many programs and replays on a GPU).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from cgtrees.codegen import kernel_facts as facts
from cgtrees.codegen import printer
from cgtrees.codegen.kernel_text import Scope, bf16_literal, cast_text, is_literal, operand, plus
from cgtrees.codegen.scheduler import Member

TAIL_BLOCK = 1024  # slots of a tail's workspace the last program adds at a time

# ``writer`` below is the kernel's ``kernel.KernelWriter`` (not imported: kernel.py imports this module)


def emit(writer: Any, scope: Scope, bodies: dict, stores: dict) -> None:
    """Each tail sum's share of this program's rows into its slot; the last program to take a
    ticket adds the slots in order and writes the sums and the final members (the module's docstring)."""
    tails = [m for m in writer.kernel.members if m.role == "tail"]
    if not tails:
        return
    for m in tails:
        value = writer.value(bodies[m.name], scope)
        if is_literal(value) or not facts.spans_block(writer.two_d, bodies[m.name], full=False):
            value = writer._var(scope, f"tl.broadcast_to({_block(writer, value, bodies[m.name].dtype)}, [XBLOCK, 1])")
        share = writer._var(scope, f"tl.sum(tl.where(xmask, {value}, 0), 0)")
        slots = writer._ptr(f"{m.name}_parts", m.step.body.dtype)
        writer.workspace[f"{m.name}_parts"] = m.step.body.dtype
        scope.lines.append(f"tl.store({slots} + tl.program_id(0) + tl.zeros([1], tl.int32), {share})")
    ticket = writer._ptr(f"{writer.name}_ticket", torch.int32)
    scope.lines += ["tl.debug_barrier()  # every thread's share is written before the ticket releases them",
                    f'ticket = tl.atomic_add({ticket}, 1, sem="acq_rel")', "if ticket == programs - 1:"]
    last = Scope(scope, scope.indent + "    ")
    for m in tails:
        acc = writer._var(last, f"tl.zeros([PBLOCK], {printer.TRITON_DTYPES[m.step.body.dtype]})", prefix="acc")
        last.lines += ["for poffset in range(0, programs, PBLOCK):", "    pindex = poffset + tl.arange(0, PBLOCK)",
                       f"    {acc} = {acc} + tl.load({writer.ptrs[f'{m.name}_parts']} + pindex, pindex < programs, "
                       "other=0, volatile=True)"]
        total = writer._var(last, f"tl.sum({acc}, 0, keep_dims=True)")
        writer.row_vars[m.name] = writer._var(last, cast_text(total, m.step.body.dtype, m.step.dtype))
        _store_one(writer, m, writer.row_vars[m.name], stores, last)
    for m in writer.kernel.members:
        if m.role == "final":
            value = _block(writer, writer.value(bodies[m.name], last), bodies[m.name].dtype)
            writer.row_vars[m.name] = writer._var(last, cast_text(value, bodies[m.name].dtype, m.step.dtype))
            _store_one(writer, m, writer.row_vars[m.name], stores, last)
    scope.lines += [last.indent[len(scope.indent):] + line for line in last.lines]


def _block(writer: Any, value: str, dtype: torch.dtype) -> str:
    """``value`` as a block: a literal becomes a one-element tensor of ``dtype``."""
    if not is_literal(value):
        return value
    if writer.interpret and dtype == torch.bfloat16:
        return f"tl.full([1], {bf16_literal(value)}, tl.float32).to(tl.bfloat16)"
    return f"tl.full([1], {value}, {printer.TRITON_DTYPES[dtype]})"


def _store_one(writer: Any, m: Member, value: str, stores: dict, scope: Scope) -> None:
    """Store a tail's one-element value (shape ``[1]``) where ``m`` keeps it, if anything reads it."""
    if m.name not in stores:
        return
    offset = plus(printer.expr(stores[m.name], triton=True), "tl.zeros([1], tl.int32)")
    scope.lines.append(f"tl.store({writer._ptr(m.name, m.step.dtype)} + ({offset}), {value})")


def programs(xnumel: sympy.Expr, xblock: int) -> str:
    """A kernel with a tail's program count as its launch writes it (``wrapper._launch`` takes it
    for the grid): one at least, so that over no rows at all the tail still writes its sums (0) and
    what follows from them (a mean of nothing: NaN, as eager's)."""
    n = sympy.sympify(xnumel)
    return str(max(1, -(-int(n) // xblock))) if n.is_number else f"max(1, -(-{operand(n)} // {xblock}))"
