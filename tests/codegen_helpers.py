"""Helpers for the codegen tests: trace a function to aten graphs, compile them with
``cgtrees.codegen.compile_graph`` (no driver involved), and compare with eager."""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees.aot.decompositions import decomposition_table
from cgtrees.config import Config
from cgtrees.context import GraphContext

# Interpreted (CPU) and compiled (CUDA) kernels never mix in one process: on a CUDA machine the CPU
# codegen tests are skipped unless CGTREES_INTERPRET=1 asks for them, and tests/gpu runs instead.
INTERPRET = not torch.cuda.is_available() or os.environ.get("CGTREES_INTERPRET") == "1"

# Tolerances of half-precision results computed in another order than eager's.
HALF_TOL = {torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def _call_body(module: Any) -> str:
    return module.source.split("\ndef call(")[1].split("\ndef call_aten(")[0]


def aten_calls(module: Any) -> list[str]:
    """Every aten op a generated module's ``call`` names (its library calls and fallbacks)."""
    return re.findall(r"\baten\.[\w.]+", _call_body(module))


def aten_call_targets(module: Any) -> list[str]:
    """The aten ops the generated ``call`` runs, in order (the targets of its assignments)."""
    return re.findall(r"= (aten\.[\w.]+)\(", _call_body(module))


def sum_tolerance(expected: torch.Tensor, terms: int) -> dict:
    """Sums taken in another order than eager's (atomic adds, window sums): rounding that grows
    with the summed magnitudes."""
    if not expected.is_floating_point():
        return dict(atol=0, rtol=0)
    if expected.dtype in HALF_TOL:
        return HALF_TOL[expected.dtype]
    eps = torch.finfo(expected.dtype).eps
    return dict(rtol=4 * eps, atol=4 * eps * terms * max(expected.abs().max().item(), 1.0))


def config(**kw: Any) -> Config:
    """A config for codegen tests; ``CGTREES_GEMM_DECISIONS`` (a test file's fixture) picks the GEMM forms."""
    kw.setdefault("gemm_decisions", os.environ.get("CGTREES_GEMM_DECISIONS") or "measure")
    return Config(interpret=kw.pop("interpret", INTERPRET), **kw)


def trace(fn: Callable, *inputs: Any, dynamic: bool = False) -> torch.fx.GraphModule:
    """One aten graph (core decompositions plus ours), with shapes in each node's meta."""
    return make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="symbolic" if dynamic else "fake")(
        *inputs)


def compile_fn(fn: Callable, *inputs: Any, name: str = "test", cfg: Config | None = None, dynamic: bool = False):
    """Trace ``fn`` and compile its graph; returns the kernel module."""
    from cgtrees import codegen

    gm = trace(fn, *inputs, dynamic=dynamic)
    try:
        return codegen.compile_graph(gm, list(inputs), context(gm, cfg or config(), "inference", name))
    except NotImplementedError:  # a graph codegen does not generate on purpose: the driver runs it through aten
        return codegen.AtenModule(gm)


def context(gm: torch.fx.GraphModule, cfg: Config, kind: str, name: str) -> GraphContext:
    """What the driver tells codegen of a graph (its mutated inputs by the driver's own rule)."""
    from cgtrees.aot.driver import mutated_inputs

    return GraphContext(cfg, kind, name, mutated_input_indices=mutated_inputs(gm))


def run(module: Any, *inputs: Any) -> Any:
    """Call a compiled module; fail if it was not generated or fell back to its aten path."""
    check(module)
    out = module.call(list(inputs))
    check(module)
    return out


def check(module: Any) -> None:
    from cgtrees.codegen import KernelModule

    assert isinstance(module, KernelModule), "the graph was not generated (see the cgtrees.codegen log)"
    assert module.failure is None, f"the generated module failed: {module.failure}\n{module.path}"


class Compiler:
    """A boxed compiler for ``aot_module_simplified`` that keeps every module it made."""

    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg or config()
        self.modules: list[Any] = []

    def __call__(self, kind: str):
        from cgtrees import codegen

        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            ctx = context(gm, self.cfg, kind, f"g_{kind}_{len(self.modules)}")
            module = codegen.compile_graph(gm, example_inputs, ctx)
            self.modules.append(module)

            def call(args: list) -> Any:
                return module.call(args)

            call._boxed_call = True
            return call

        return compile_graph

    def check(self) -> None:
        assert self.modules
        for module in self.modules:
            check(module)

    def with_our_partition(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """A ``torch.compile`` backend: AOTAutograd with our partitioner, graphs compiled here."""
        from cgtrees.aot import compat
        from cgtrees.aot.partition import partition

        return compat.aot_module_simplified(gm, example_inputs, fw_compiler=self("forward"),
                                            bw_compiler=self("backward"), partition_fn=partition,
                                            decompositions=decomposition_table(),
                                            keep_inference_input_mutations=True)  # as backend/aot/driver.py

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._functorch.aot_autograd import aot_module_simplified

        return aot_module_simplified(gm, example_inputs, fw_compiler=self("forward"), bw_compiler=self("backward"),
                                     inference_compiler=self("inference"), decompositions=decomposition_table(),
                                     keep_inference_input_mutations=True)


def kernel_count(module: Any) -> int:
    return module.source.count("@triton.jit") - sum(module.source.count(f"def {h}(") for h in
                                                   ("_max_nan", "_min_nan", "_prod"))


def trained_against_eager(model: torch.nn.Module, x: torch.Tensor, x2: torch.Tensor | None = None) -> tuple:
    """One compiled step on ``x`` (AOTAutograd with our codegen) and one eager step on ``x2`` (``x``
    by default) with the loss (out * out).sum(): the compiler (its modules, checked), both outputs
    and the compiled step's parameter gradients (the model's ``.grad`` then holds eager's)."""
    comp = Compiler()
    out = torch.compile(model, backend=comp.backend)(x)
    (out * out).sum().backward()
    comp.check()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x if x2 is None else x2)
    (ref * ref).sum().backward()
    return comp, out, ref, grads


class TimedPlan:
    """A ``GemmPlan`` stand-in that "times" each form as ``us`` says (the time of the first key its
    name starts with), as a GPU's would; every form it is given runs (on the CPU, through the
    interpreter)."""

    device = torch.device("cpu")

    def __init__(self, us: dict[str, float]) -> None:
        self.us, self.notes, self.alone = us, [], []

    def other_choice(self):
        return "time", ""

    def time_forms(self, forms, alone=False):
        self.alone.append(alone)  # how each choice asked for its forms to be timed
        for _, build, _ in forms.values():
            build()()
        return {name: next(t for start, t in self.us.items() if name.startswith(start)) for name in forms}

    def note(self, *line, why="timed"):
        self.notes.append(line)
