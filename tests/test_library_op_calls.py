"""Generated modules call our library ops' Python (``<op>_direct``), not the ops through torch's
dispatcher (``codegen.wrapper._callee``): the ops stay registered for tracing."""

from __future__ import annotations

import importlib

import torch

from cgtrees.codegen import wrapper


def test_each_library_op_has_the_function_generated_modules_call():
    """A generated module calls our ops' Python (``<op>_direct`` in the op's module, what the op
    itself runs), not the op through the dispatcher: each op has one."""
    for op, module_name in wrapper.OUR_OPS.items():
        module = importlib.import_module(module_name)
        name = op.rpartition(".")[2]
        direct = getattr(module, f"{name}_direct")
        assert callable(direct), op
        assert wrapper._callee(f"{op}.default") == f"{module_name}.{name}_direct"
        assert getattr(torch.ops.cgtrees, name).default is not None  # the op stays, for tracing
    assert wrapper._callee("aten.mm.default") == "aten.mm.default"
