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
import weakref

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
    _patch_once_a_launch(interpreter)
    _done = True


def _patch_once_a_launch(interpreter) -> None:
    """A launch patches ``triton.language`` for its kernel, and Triton's interpreter patches it again
    at every device-function call inside it (each ``tl.sum``, each helper of ours): about 0.4 ms a
    call, more than half of an interpreted tiny Llama's decode (``_patch_lang``, 11562 times in one
    test). Inside a launch, a call whose language modules the launch (or an earlier call in it: the
    library's functions read ``tl.core``, kernels ``tl``) patched runs without patching again;
    anywhere else, as Triton does it."""
    grid_call, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    patched: list[frozenset[int]] = [frozenset()]  # the language modules the running launch patched
    wanted = (id(interpreter.tl), id(interpreter.tl.core))
    known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a function's language modules

    def langs(fn) -> frozenset[int]:
        found = known.get(fn)
        if found is None:
            found = known[fn] = frozenset(id(v) for v in fn.__globals__.values() if id(v) in wanted)
        return found

    def launch(self, *args, **kwargs):
        patched[0] = langs(self.fn)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched[0] = frozenset()

    def call(self, *args, **kwargs):
        needs = langs(self.fn)
        if not patched[0] or not needs <= patched[0]:
            if patched[0]:
                patched[0] |= needs  # patched by this call for the rest of the launch (Triton never restores it)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own device call reports it
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__ = launch, call
