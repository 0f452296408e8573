"""``torch.compiler.cudagraph_mark_step_begin()`` without importing Inductor.

torch's mark only moves a counter in ``torch._inductor.cudagraph_trees``, but its first call imports
that module, and Inductor's compiler with it: 2.2 of the 7.5 s a warm start of the 1.1B Llama's
decode loop took to its 8th token on an H200's host, its largest part after Dynamo's trace
(``benchmarks/results/warm/``). Every loop written as torch documents it (a mark before each
training step) pays that before its first step.

Importing cgtrees (which Dynamo does at ``torch.compile(..., backend="cgtrees")``) puts
``mark_step_begin`` in torch's place. It counts the mark here, and moves Inductor's counter as well
wherever Inductor's module is loaded, so Inductor's trees see every mark; where it is not loaded, no
tree of Inductor's exists to see one. The runtime reads both counts
(``counter``), so a caller that kept torch's own function is seen too. This module is the one
place that touches Inductor's mark counter.
"""

from __future__ import annotations

import sys

import torch

_marks = 0


def mark_step_begin() -> None:
    """A new training or inference step begins: what earlier steps returned from CUDA graphs may be
    overwritten (torch's ``cudagraph_mark_step_begin``, which cgtrees puts in torch's place)."""
    global _marks
    _marks += 1
    module = sys.modules.get("torch._inductor.cudagraph_trees")
    if module is not None:
        module.mark_step_begin()


def counter() -> int:
    """A number that moves at each mark, ours or torch's own (0 before any): Inductor's counter,
    which counts down, where its module is loaded (never importing it: about a second), less the
    marks made through ``mark_step_begin``."""
    module = sys.modules.get("torch._inductor.cudagraph_trees")
    theirs = module.MarkStepBox.mark_step_counter if module is not None else 0
    return theirs - _marks


def install() -> None:
    """``torch.compiler.cudagraph_mark_step_begin`` is ``mark_step_begin`` from now on."""
    torch.compiler.cudagraph_mark_step_begin = mark_step_begin
