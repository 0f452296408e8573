"""The gradient sweep's machinery: one OpInfo sample through our AOT pipeline, compared with eager.

    case(op, dtype)      -> Case: the sample, its tensors, which of them get gradients
    eager(case)          -> Result: the outputs and the gradient of every differentiable input
    Pipeline(case)       AOTAutograd with OUR decomposition table and OUR partitioner, traced once;
      .run(mode)         -> Result, the forward and backward graphs run as plain aten ("aten") or
                            through our codegen under Triton's interpreter ("interpret")
    compare(a, b, ...)   assert_close with a tolerance scaled by the reference's magnitude

The cotangents are random (seeded), so a gradient that is right only for a loss of ``sum()`` fails.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

MODES = ("aten", "interpret")


def op_id(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


@dataclass
class Case:
    name: str
    fn: Callable[..., tuple[torch.Tensor, ...]]  # tensors -> the op's tensor outputs, flattened
    tensors: list[torch.Tensor]
    grad_positions: list[int]  # tensors that get gradients (floating, requires_grad in the sample)


@dataclass
class Result:
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    cotangents: list[torch.Tensor]  # one per differentiable output


# What torch says about an op the sweep calls on purpose (deprecated ops such as torch.qr and the
# upsample_* functions, beta or experimental ones, stft without a window): about the op, not about
# our compiler, so silenced where the sweep calls an op; any other warning still shows.
TORCH_OP_NOTICES = r".*(is deprecated|is in beta|support is experimental|A window was not provided)"


@contextlib.contextmanager
def torch_op_notices_quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCH_OP_NOTICES, category=UserWarning)
        yield


class NoSample(Exception):
    """The op has no sample this sweep can use (the reason says why)."""


def case(op: Any, dtype: torch.dtype, index: int = 1, overrides: dict | None = None) -> Case:
    torch.manual_seed(0)
    # The generator itself: ``op.sample_inputs`` wraps it in a tracker that inspects the stack on
    # every call (a third of the sweep's time).
    with torch_op_notices_quiet():
        samples = list(itertools.islice(op.sample_inputs_func(op, "cpu", dtype, True), index + 1))
    if not samples:
        raise NoSample("no sample")
    sample = samples[-1]  # the first is often a 0-d tensor; the second is more typical
    if overrides:
        sample.kwargs = {**sample.kwargs, **overrides}
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i].detach().clone() for i in positions]
    grad_positions = [j for j, i in enumerate(positions)
                      if leaves[i].requires_grad and leaves[i].is_floating_point()]
    if not grad_positions:
        raise NoSample("no differentiable tensor input")
    process = sample.output_process_fn_grad

    def fn(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(leaves)
        for i, t in zip(positions, ts):
            values[i] = t
        inp, args, kwargs = pytree.tree_unflatten(values, spec)
        out = process(op.op(inp, *args, **kwargs))
        return tuple(x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor))

    return Case(op_id(op), fn, tensors, grad_positions)


def _run(case: Case, fn: Callable[..., tuple[torch.Tensor, ...]]) -> Result:
    inputs = [t.clone().requires_grad_(j in case.grad_positions) for j, t in enumerate(case.tensors)]
    with torch_op_notices_quiet():
        outputs = fn(*inputs)
    diff = [o for o in outputs if o.requires_grad and o.is_floating_point()]
    grads: list[torch.Tensor | None] = [None] * len(case.grad_positions)
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff]
    if diff:
        wrt = [inputs[j] for j in case.grad_positions]
        grads = list(torch.autograd.grad(diff, wrt, cotangents, allow_unused=True))
    return Result([o.detach() for o in outputs], grads, cotangents)


def eager(case: Case) -> Result:
    return _run(case, case.fn)


class Pipeline:
    """``case.fn`` through AOTAutograd with our decomposition table and our partitioner, traced
    once (at the first ``run``); each aten graph it hands over is then compiled by our codegen for
    the mode asked: "aten" is what the driver makes of a CPU graph (a module of aten calls),
    "interpret" generates its Triton kernels and runs them through Triton's interpreter."""

    def __init__(self, case: Case) -> None:
        from torch._functorch.aot_autograd import aot_function

        from cgtrees.aot.partition import partition

        self.case = case
        self.mode = "aten"
        self.graphs: dict[str, tuple[torch.fx.GraphModule, list]] = {}  # kind -> graph, example inputs
        self.modules: dict[tuple[str, str], Any] = {}  # (mode, kind) -> kernel module
        self.not_generated: dict[tuple[str, str], str] = {}  # (mode, kind) -> why codegen gave it to aten
        self.decomposed: set[torch._ops.OpOverload] = set()  # entries of our table that fired
        self.compiled = aot_function(case.fn, fw_compiler=self._compiler("forward"),
                                     bw_compiler=self._compiler("backward"),
                                     inference_compiler=self._compiler("inference"),
                                     partition_fn=partition, decompositions=recording_table(),
                                     keep_inference_input_mutations=True)

    def lowered_ops(self) -> set[str]:
        """The ops in its graphs that codegen has a lowering for."""
        from cgtrees.codegen.graph import LOWERINGS

        return {str(n.target) for gm, _ in self.graphs.values() for n in gm.graph.nodes
                if n.op == "call_function" and n.target in LOWERINGS}

    def random_ops(self) -> set[str]:
        """The random ops in its graphs (eager draws other numbers: no reference)."""
        return {str(n.target) for gm, _ in self.graphs.values() for n in gm.graph.nodes
                if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags}

    def run(self, mode: str) -> Result:
        """Outputs and gradients with every graph run in ``mode``; ``gaps(mode)`` then says which
        graphs codegen gave to aten, and why."""
        self.mode = mode
        _Fired.into = self.decomposed  # the first run traces
        result = _run(self.case, self.compiled)
        for kind, module in self.modules.items():
            if kind[0] == mode and getattr(module, "failure", None):
                self.not_generated[kind] = f"its generated code failed: {module.failure}"
        return result

    def gaps(self, mode: str) -> dict[str, str]:
        return {kind: why for (m, kind), why in self.not_generated.items() if m == mode}

    def aten_calls(self, mode: str) -> set[str]:
        """The aten ops that the generated modules of ``mode`` still call (their fallbacks), in
        graphs without complex values (codegen writes no complex code: those ops go to aten)."""
        calls: set[str] = set()
        for (m, kind), module in self.modules.items():
            source = module.graph.source
            if m == mode and source and not _has_complex(self.graphs[kind][0]):
                body = source.split("\ndef call(")[1].split("\ndef call_aten(")[0]
                calls |= set(re.findall(r"\baten\.[\w.]+", body))
        return calls

    def _compiler(self, kind: str) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            from cgtrees.aot import constants

            consts = constants.lift(gm)  # as the driver does: get_attr tensors become trailing inputs
            self.graphs[kind] = (gm, [*example_inputs, *consts.tensors])

            def call(args: list) -> Any:
                args.extend(consts.tensors)
                return self._module(kind).call(args)

            call._boxed_call = True
            return call

        return compile_graph

    def _module(self, kind: str) -> Any:
        """What ``codegen.compile_graph`` makes of the graph, with the reason kept when codegen
        hands the graph to aten."""
        if (self.mode, kind) not in self.modules:
            from cgtrees import codegen
            from cgtrees.config import Config
            from cgtrees.context import GraphContext

            gm, examples = self.graphs[kind]
            ctx = GraphContext(Config(interpret=self.mode == "interpret", cache=False), kind,
                               f"{self.case.name}_{kind}")
            try:
                module = codegen.load(codegen.generate(gm, examples, ctx), ctx)
            except Exception as exc:  # noqa: BLE001  (compile_graph's fallback, with the reason kept)
                self.not_generated[self.mode, kind] = f"{type(exc).__name__}: {exc}"
                module = codegen.AtenModule(gm)
            self.modules[self.mode, kind] = module
        return self.modules[self.mode, kind]


def _has_complex(gm: torch.fx.GraphModule) -> bool:
    vals = [v for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta.get("val"))]
    return any(isinstance(v, torch.Tensor) and v.is_complex() for v in vals)


class _Fired:
    """Where the recording table notes the entries that run: the set of the pipeline tracing now."""

    into: set = set()


@functools.lru_cache(maxsize=1)  # 970 entries: made once, not per trace
def recording_table() -> dict:
    """Our decomposition table, each entry noting in ``_Fired.into`` that it ran (nothing else changes)."""
    from cgtrees.aot.decompositions import decomposition_table

    def record(op: torch._ops.OpOverload, fn: Callable) -> Callable:
        def decomposition(*args: Any, **kwargs: Any) -> Any:
            _Fired.into.add(op)
            return fn(*args, **kwargs)

        return decomposition

    return {op: record(op, fn) for op, fn in decomposition_table().items()}


def tolerance(ref: torch.Tensor) -> dict:
    """rtol per dtype, atol a small multiple of the reference's largest finite magnitude."""
    rtol, scale = {torch.float64: (1e-7, 1e-9), torch.float32: (1e-4, 1e-5)}.get(ref.dtype, (1e-2, 1e-3))
    finite = ref[torch.isfinite(ref)] if ref.is_floating_point() else ref
    magnitude = finite.abs().max().item() if finite.numel() else 0.0
    return dict(rtol=rtol, atol=scale * max(magnitude, 1e-3))


def compare(actual: Result, expected: Result, what: str) -> None:
    assert len(actual.outputs) == len(expected.outputs), f"{what}: {len(actual.outputs)} outputs, eager has " \
        f"{len(expected.outputs)}"
    for i, (a, e) in enumerate(zip(actual.outputs, expected.outputs)):
        torch.testing.assert_close(a, e, equal_nan=True, check_stride=False, **tolerance(e),
                                   msg=lambda m, i=i: f"{what}: output {i}: {m}")
    for i, (a, e) in enumerate(zip(actual.grads, expected.grads)):
        if e is None or a is None:
            assert (a is None) == (e is None) or _all_zero(a if e is None else e), \
                f"{what}: gradient of input {i} is {'None' if a is None else 'set'}, eager's is the other"
            continue
        torch.testing.assert_close(a, e, equal_nan=True, check_stride=False, **tolerance(e),
                                   msg=lambda m, i=i: f"{what}: gradient of input {i}: {m}")


def _all_zero(t: torch.Tensor) -> bool:
    return bool((t == 0).all())
