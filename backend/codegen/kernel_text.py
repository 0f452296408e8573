"""The text of a kernel: its scopes (blocks of lines and the values they computed) and the small
rules for writing literals and operands, shared by ``kernel.py`` and ``tail.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from cgtrees.codegen import printer


@dataclass
class Scope:
    """A block of the kernel (its body, or a loop over a row) and what it computed: by IR value
    (``cache``) and by right-hand side (``texts``: two values that render alike, a row's mean and
    the same mean inlined into the next member, are one variable). An inner scope sees its parents'."""

    parent: "Scope | None"
    indent: str
    lines: list[str] = field(default_factory=list)
    cache: dict = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)

    def find(self, key: object) -> str | None:
        return self._up("cache", key)

    def find_text(self, text: str) -> str | None:
        return self._up("texts", text)

    def _up(self, table: str, key: object) -> str | None:
        """``key`` in this scope's ``table`` or the nearest parent's that has it."""
        scope: Scope | None = self
        while scope is not None:
            found = getattr(scope, table).get(key)
            if found is not None:
                return found
            scope = scope.parent
        return None


def cast_text(value: str, src: torch.dtype, dst: torch.dtype) -> str:
    if src == dst:
        return value
    if is_literal(value):
        value = f"tl.full([1], {value}, {printer.TRITON_DTYPES[src]})"
    if dst == torch.bool:
        return f"({value} != 0)"
    return f"{value}.to({printer.TRITON_DTYPES[dst]})"


def bf16_literal(text: str) -> str:
    """A float literal rounded to bfloat16 (exact in float32), as source text."""
    value = float(eval(text, {"float": float}))  # noqa: S307 - our own printer.literal output
    return printer.literal(torch.tensor(value, dtype=torch.bfloat16).item())


def operand(e: sympy.Expr) -> str:
    """A size as the right operand of ``//`` or ``%`` (``x // (s0 + 2)``, not ``x // s0 + 2``)."""
    e = sympy.sympify(e)
    text = printer.expr(e)
    return text if e.is_Atom else f"({text})"


def is_literal(text: str) -> bool:
    return text[:1].isdigit() or text.startswith(("-", "float(", "True", "False"))


def is_number(text: str) -> bool:
    """Whether ``text`` is one literal as ``printer.literal`` writes it (``-1.5``, ``float("inf")``)."""
    return text in ("True", "False", 'float("nan")', 'float("inf")', 'float("-inf")') or \
        text.lstrip("-").replace(".", "", 1).replace("e-", "", 1).replace("e+", "", 1).isdigit()


def plus(offset: str, more: str) -> str:
    """``offset + more``, without a ``0 + `` in front."""
    return more if offset == "0" else f"{offset} + {more}"
