"""Triton's interpreter, made usable after ``triton`` was imported.

Triton decides interpreted or compiled when a function is decorated with ``@triton.jit``. Our
generated kernels are decorated when their module is imported (after ``TRITON_INTERPRET=1`` is
set), but Triton's own library functions (``tl.sum``, ``tl.max``, ``tl.sigmoid``, ...) were
decorated when ``triton`` was first imported, usually by ``torch._dynamo``, long before: called
from an interpreted kernel they fail ("Cannot call @triton.jit'd outside of the scope of a
kernel"). ``enable()`` sets the variable and re-wraps those library functions as interpreted ones
(the same replacement object everywhere, so the interpreter's fast paths, which compare combine
functions by identity, still apply). It also turns the interpreter's ``tl.device_assert`` on (our
kernels assert that indices read from data are in range; the interpreter ignores asserts unless
its builder runs in debug mode), leaving its integer-overflow checks off as they are in compiled
kernels. Never mix interpreted and compiled kernels in one process.
"""

from __future__ import annotations

import dataclasses
import os

_done = False


def active() -> bool:
    """Whether this process runs Triton kernels interpreted: a launcher's question, where the
    interpreter computes a form wrongly (a bfloat16 ``tl.dot``, a bfloat16 cast that truncates)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def enable() -> None:
    global _done
    os.environ["TRITON_INTERPRET"] = "1"
    if _done:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    converted: dict[int, object] = {}
    modules = [tl, tl.standard, tl.core, tl.math]
    for module in modules:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                new = converted.get(id(obj))
                if new is None:
                    new = converted[id(obj)] = InterpretedFunction(obj.fn)
                setattr(module, name, new)
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, debug=True, sanitize_overflow=False)
    _done = True
