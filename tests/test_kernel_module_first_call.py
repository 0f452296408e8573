"""A kernel module's first call (backend/codegen/module.py, ``KernelModule``): it reruns through
aten if the generated code fails, and holds its inputs only as long as that may need them. With
every kernel compiled beforehand (``kernels_ready``) it holds them weakly, so the call frees each
at its last use (a training step's first backward peaks no higher than the next); otherwise it
keeps them for the whole call. Plain Python stand-ins for a generated module: what is tested is the
guard around it."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch

from cgtrees.codegen.module import KernelModule
from cgtrees.compiled import CompiledGraph, GraphFacts


class FakeGenerated:
    """``call`` frees its inputs as generated code does (``args.clear()``, then its locals go),
    records whether the first input outlived that, and fails if told to."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.input_alive_after_clear: list[bool] = []

    def call(self, args):
        first = weakref.ref(args[0])
        total = args[0].sum() + args[1]
        args.clear()
        self.input_alive_after_clear.append(first() is not None)
        if self.fail:
            raise ValueError("a bug in the generated code")
        return (total,)


# the graph's aten path (``CompiledGraph.fallback``), run in the module's namespace when it fails
FALLBACK = "def call_aten(args):\n    return (args[0].sum() + args[1],)\n"


def kernel_module(fail: bool, ready: bool) -> tuple[KernelModule, FakeGenerated]:
    fake = FakeGenerated(fail)
    graph = CompiledGraph("", GraphFacts(), fallback=FALLBACK)
    return KernelModule(graph, SimpleNamespace(call=fake.call), "fake.py", "g0_backward", kernels_ready=ready), fake


@pytest.mark.parametrize("ready", [True, False])
def test_first_call_frees_inputs_only_when_kernels_are_ready(ready):
    km, fake = kernel_module(fail=False, ready=ready)
    out = km.call([torch.ones(4), 2.0])  # nothing else holds the tensor
    assert out[0].item() == 6.0
    assert fake.input_alive_after_clear == [not ready]


def test_ready_module_reruns_through_aten_when_the_caller_holds_the_inputs():
    km, fake = kernel_module(fail=True, ready=True)
    x = torch.arange(4.0)
    out = km.call([x, 1.0])
    assert out[0].item() == 7.0 and "a bug in the generated code" in km.failure
    assert km.call([x, 0.0])[0].item() == 6.0  # aten from now on
    assert fake.input_alive_after_clear == [True]


def test_ready_module_says_why_it_cannot_rerun_once_its_inputs_are_gone():
    km, _ = kernel_module(fail=True, ready=True)
    with pytest.raises(RuntimeError, match="cannot rerun through aten"):
        km.call([torch.ones(4), 2.0])


def test_module_with_kernels_to_compile_reruns_on_inputs_it_kept():
    km, fake = kernel_module(fail=True, ready=False)
    out = km.call([torch.ones(4), 2.0])
    assert out[0].item() == 6.0 and km.failure
    assert fake.input_alive_after_clear == [True]
