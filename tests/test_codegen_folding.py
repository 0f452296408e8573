"""Generated code is folded and says where it came from (issue 43, "Generated code").

- Constant arithmetic is computed and identities dropped where that is exact to the bit
  (``simplify.fold``): ``64.0 - 0.0`` and ``storage_offset() + 0`` never reach a module, while
  ``x + 0.0`` (not ``x`` for ``x = -0.0``) and folds that would round differently stay.
- No ``tmpA = tmpB`` and no right-hand side computed twice in one scope of a kernel.
- Kernel names list the fused ops (``red_fused_layernorm_gelu_0``); above each kernel, its aten
  nodes and the user's source lines they were traced from.
- An error while lowering a node names the node and the user's source line.

Real graphs (a layer norm with a GELU, a softmax, a transformer block forward and backward) are
checked line by line, and their values and gradients against eager: through Triton's interpreter
on CPU, compiled on a CUDA machine (where ``CGTREES_INTERPRET=1`` does not ask for the interpreter).
"""

from __future__ import annotations

import inspect
import math
import re
import struct

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, compile_fn, kernel_count, run
from models import GPTBlock

from cgtrees.codegen import ir, naming
from cgtrees.codegen.simplify import fold

DEVICE = "cpu" if INTERPRET else "cuda"
f32, f64, i64 = torch.float32, torch.float64, torch.int64
X = ir.Load("x", ir.index_symbol(0), f32)


class LayerNormGelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.lin = torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.ln(x))
        return torch.softmax(self.lin(y) * 0.125, -1) + x[:, :64].sum(-1, keepdim=True)


# ------------------------------------------------------------------------------ reading a module
def kernels(source: str) -> dict[str, str]:
    """Each kernel's name -> its body (not the helpers a compiled module defines, ``_max_nan``)."""
    return dict(re.findall(r"@triton\.jit\ndef ((?:pw|red)_\w+)\(.*?\):\n(.*?)(?=\n\n|\Z)", source, re.S))


def comments(source: str) -> dict[str, str]:
    """Each kernel's name -> the comment above it."""
    return {name: comment for comment, name in re.findall(r"((?:^#.*\n)+)@triton\.jit\ndef (\w+)\(", source, re.M)}


def unfolded(source: str) -> list[str]:
    """The lines of a module that a fold would have changed, and the repeats within a kernel's scope."""
    bad = [line for line in source.splitlines() if re.search(r"storage_offset\(\) \+ 0\b", line)]
    for name, body in kernels(source).items():
        scopes: dict[int, dict[str, str]] = {}  # indentation -> right-hand sides seen in the open block there
        for line in body.splitlines():
            indent, text = len(line) - len(line.lstrip()), line.strip()
            if text.startswith("for "):
                scopes = {k: v for k, v in scopes.items() if k <= indent}
            m = re.fullmatch(r"(tmp\d+) = (.*)", text)
            if m is None:
                continue
            lhs, rhs = m.groups()
            if re.fullmatch(r"[A-Za-z_]\w*", rhs):
                bad.append(f"{name}: an alias: {text}")
            if re.fullmatch(r"-?[\d.]+(e-?\d+)? [-+*/] -?[\d.]+(e-?\d+)?", rhs) or \
                    re.match(r"tl\.(maximum|minimum)\(-?[\d.]+, -?[\d.]+", rhs):
                bad.append(f"{name}: constant arithmetic: {text}")
            if re.search(r" - 0\.0\b| \+ -0\.0\b| \* 1\.0\b| / 1\.0\b|\b1\.0 \* ", rhs):
                bad.append(f"{name}: an identity: {text}")
            seen = next((s[rhs] for k, s in scopes.items() if k <= indent and rhs in s), None)
            if seen is not None:
                bad.append(f"{name}: {lhs} repeats {seen}: {text}")
            scopes.setdefault(indent, {})[rhs] = lhs
    return bad


def trained(model: torch.nn.Module, x: torch.Tensor) -> tuple[Compiler, torch.Tensor]:
    """One compiled forward and backward (Dynamo, so nodes carry stack traces; our partition, so a
    layer norm's backward recomputes its statistics), checked against
    eager's output and gradients; the compiler keeps the generated modules."""
    comp = Compiler()
    x2 = x.detach().clone().requires_grad_()
    out = torch.compile(model, backend=comp.with_our_partition)(x)
    out.sum().backward()
    comp.check()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x2)
    ref.sum().backward()
    tol = 1e-5 if INTERPRET else 1e-4  # compiled kernels sum in other orders than the interpreter's numpy
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, atol=1e-4, rtol=1e-4)
    return comp, out


def source_of(fn, text: str) -> str:
    """``file.py:N in name: <the line>`` for the line of ``fn`` that holds ``text``."""
    lines, start = inspect.getsourcelines(fn)
    at = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn).rsplit('/', 1)[-1]}:{start + at} in {fn.__name__}: {lines[at].strip()}"


# ----------------------------------------------------------------------------------- real graphs
def test_layernorm_gelu_softmax_is_folded_named_and_traced():
    torch.manual_seed(0)
    comp, _ = trained(LayerNormGelu().to(DEVICE), torch.randn(37, 64, device=DEVICE, requires_grad=True))
    forward, backward = (m.source for m in comp.modules)
    for source in (forward, backward):
        assert not unfolded(source), "\n".join(unfolded(source))
    names = list(kernels(forward))
    # the row sum of x joins the layer norm's kernel, which reads x too (the linear waits for the kernel
    # without cutting it: ``scheduler._fill``), else the softmax's
    assert re.fullmatch(r"red_fused_layernorm_gelu_(sum_)?0", names[0]), names
    assert re.fullmatch(r"red_fused_(addmm_)?softmax_(sum_)?1", names[1]), names  # with the linear's bias, if here
    assert names[0].endswith("sum_0") != names[1].endswith("sum_1"), names
    body = kernels(forward)[names[0]]
    assert re.search(r"= tmp\d+ / 64\.0\n", body), body  # the variance's divisor, max(64.0 - 0.0, 0.0)
    assert "storage_offset()" in forward  # the weight's transpose, with no ``+ 0``
    gelu = source_of(LayerNormGelu.forward, "y = F.gelu(self.ln(x))")
    softmax = source_of(LayerNormGelu.forward, "return torch.softmax(")
    above = comments(forward)
    assert f"# traced from:\n#   {gelu}\n" in above[names[0]], above
    assert above[names[1]].endswith(f"# traced from:\n#   {softmax}\n"), above
    assert re.search(r"^#   var_mean = aten\.var_mean\.correction\(", above[names[0]], re.M)
    # the backward's kernels come from the same lines: a layer norm's and GELU's gradients from the first
    traced = {name: comment.split("# traced from:\n")[-1] for name, comment in comments(backward).items()}
    assert any(gelu in t and "layernorm" in name and "gelu" in name for name, t in traced.items()), traced


def test_softmax_alone_is_named_and_folded():
    x = torch.randn(1823, 781, device=DEVICE)
    m = compile_fn(lambda x: torch.softmax(x, -1), x)
    assert list(kernels(m.source)) == ["red_fused_softmax_0"], m.source
    assert not unfolded(m.source), "\n".join(unfolded(m.source))
    torch.testing.assert_close(run(m, x)[0], torch.softmax(x, -1))


def test_transformer_block_forward_and_backward_are_folded():
    """A GPT block: layer norms, a causal softmax, a tanh GELU, residual adds; its backward reads
    a layer norm's statistics back in the kernels of their gradients, where a row's mean once was
    computed twice (``tmp18 = tmp0 - tmp10`` beside ``tmp5 = tmp0 - tmp4``, ``tmp10 = tmp4``)."""
    torch.manual_seed(0)
    comp, _ = trained(GPTBlock().to(DEVICE), torch.randn(2, 9, 64, device=DEVICE, requires_grad=True))
    for m in comp.modules:
        assert not unfolded(m.source), "\n".join(unfolded(m.source))
    forward, backward = (m.source for m in comp.modules)
    names = list(kernels(forward))
    assert names[0] == "red_fused_layernorm_0", names
    assert len([n for n in names if re.fullmatch(r"red_fused_softmax_\d+", n)]) == 1, names  # its mask is glue
    assert len([n for n in names if "layernorm" in n]) == 2, names
    assert all(re.fullmatch(r"(pw|red)_fused_[a-z0-9_]+_\d+", n) and n.count("_") <= 7 for n in names), names
    assert len([n for n in kernels(backward) if "layernorm" in n]) == 2, list(kernels(backward))
    ln1 = source_of(GPTBlock.forward, "q, k, v = self.qkv(self.ln1(x))")
    assert f"#   {ln1}\n" in comments(forward)["red_fused_layernorm_0"]


def test_batchnorm_statistics_are_named_batchnorm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    comp = Compiler()
    torch.compile(model.to(DEVICE), backend=comp.backend)(torch.randn(2, 3, 9, 9, device=DEVICE))
    comp.check()
    names = list(kernels(comp.modules[0].source))
    assert any(re.fullmatch(r"red_fused_batchnorm(_relu)?_\d+", n) for n in names), names
    assert not any("layernorm" in n for n in names), names


def test_a_kernel_of_glue_is_named_by_its_glue():
    x = torch.randn(16, 8, device=DEVICE)
    m = compile_fn(lambda x: (x * 2 + 1, x.t().contiguous()), x)
    assert kernel_count(m) >= 1
    assert all(re.fullmatch(r"pw_fused_(mul|add|clone)(_(mul|add|clone))*_\d+", n) for n in kernels(m.source)), \
        list(kernels(m.source))


# ------------------------------------------------------------------------------------- the fold
def const(value: float, dtype: torch.dtype = f32) -> ir.Expr:
    return ir.Op("fp64_const", (ir.Const(value, dtype),), dtype) if dtype == f64 else ir.Const(value, dtype)


def op(name: str, *args: ir.Expr, dtype: torch.dtype = f32) -> ir.Op:
    return ir.Op(name, args, dtype)


def same_bits(a: float, b: float) -> bool:
    """Equal as float32 bits (signed zeros told apart), or both NaN."""
    return struct.pack("<f", a) == struct.pack("<f", b) or (math.isnan(a) and math.isnan(b))


def test_a_variance_divisor_folds_to_its_count():
    divisor = op("fmax", op("sub", const(64.0), const(0.0)), const(0))
    assert fold(op("truediv", X, divisor)) == op("truediv", X, ir.Const(64.0, f32))


@pytest.mark.parametrize("name", ["add", "sub", "mul", "truediv", "fmax", "fmin"])
def test_folded_float32_constants_keep_every_bit(name):
    """Every pair of special values (signed zeros, infinities, NaN, a subnormal, the largest float32,
    and 1e-5, which float32 does not hold): a folded constant has the bits of what the kernel computed
    unfolded, which is eager's float32 op where float32 holds both operands (Triton computes two
    literals in double, then rounds once, as ``reference`` does)."""
    values = [0.0, -0.0, 1.0, -1.0, 0.5, 3.0, 64.0, float("inf"), float("-inf"), float("nan"),
              2.0**-149, 3.4028234663852886e38, 1e-5, -2.5]
    eager = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
             "fmax": torch.maximum, "fmin": torch.minimum}[name]
    folds = 0
    for a in values:
        for b in values:
            folded = fold(op(name, const(a), const(b)))
            if not isinstance(folded, ir.Const):
                continue
            folds += 1
            reference = eager(torch.tensor(a, dtype=f64), torch.tensor(b, dtype=f64)).to(f32)
            if float(torch.tensor(a, dtype=f32)) == a and float(torch.tensor(b, dtype=f32)) == b:
                direct = eager(torch.tensor(a, dtype=f32), torch.tensor(b, dtype=f32)).item()
                assert same_bits(direct, reference.item()), (name, a, b)
            got = torch.tensor(folded.value, dtype=f32).item()  # the kernel's literal, as float32
            assert same_bits(got, reference.item()), (name, a, b, got, reference)
    if name in ("fmax", "fmin"):  # the GPU's max of 0.0 and -0.0 is 0.0, numpy's and torch's CPU max either
        assert isinstance(fold(op(name, const(0.0), const(-0.0))), ir.Op)
        assert isinstance(fold(op(name, const(-0.0), const(0.0))), ir.Op)
    assert folds >= 13 * 13 - 2, folds  # all but the pairs with 1e-5 (kept) and signed zeros' max and min


def test_identities_are_dropped_only_where_exact():
    zero, negzero, one = const(0.0), const(-0.0), const(1.0)
    assert fold(op("sub", X, zero)) == X
    assert fold(op("add", X, negzero)) == X and fold(op("add", negzero, X)) == X
    assert fold(op("mul", X, one)) == X and fold(op("mul", one, X)) == X
    assert fold(op("truediv", X, one)) == X
    assert fold(op("neg", op("neg", X))) == X
    assert fold(op("cast", X)) == X
    kept = [op("add", X, zero), op("add", X, ir.Const(0, f32)), op("sub", X, negzero), op("mul", X, zero),
            op("truediv", one, X), op("sub", zero, X), op("fmax", X, zero), op("mul", X, const(1.0 + 2**-23))]
    for e in kept:  # -0.0 + 0.0 is 0.0; x * 0.0 is NaN for inf; 0 - x is not x; max(NaN, 0) is NaN
        assert fold(e) == e, e


def test_folds_keep_dtypes_and_integer_overflow():
    ints = op("add", ir.Const(2**62, i64), ir.Const(2**62, i64), dtype=i64)
    assert fold(ints) == ints  # wraps in the kernel: not folded into a number int64 cannot hold
    assert fold(op("mul", ir.Const(6, i64), ir.Const(7, i64), dtype=i64)) == ir.Const(42, i64)
    promoted = op("mul", ir.Load("n", ir.index_symbol(0), i64), ir.Const(1.0, f32))
    assert fold(promoted) == promoted  # an int64 times a float32 one is a float32: not the int64 operand
    double = fold(op("sub", const(1.0, f64), const(0.25, f64), dtype=f64))
    assert double == const(0.75, f64)  # a float64 constant stays a float64 value in the kernel
    s0 = ir.Const(ir.sympy.Symbol("s0", integer=True, positive=True), i64)
    assert fold(op("sub", s0, ir.Const(1, i64), dtype=i64)) == ir.Const(s0.value - 1, i64)
    mask = ir.Load("m", ir.index_symbol(0), torch.bool)
    assert fold(op("and", mask, ir.Const(True, torch.bool), dtype=torch.bool)) == mask
    assert fold(op("or", mask, ir.Const(False, torch.bool), dtype=torch.bool)) == mask


def test_constants_equal_only_when_written_alike():
    """A kernel's caches key on IR values: ``x + 0.0`` must not stand for ``x + -0.0``."""
    assert ir.Const(0.0, f32) != ir.Const(-0.0, f32)
    assert ir.Const(1, f32) != ir.Const(1.0, f32) and ir.Const(1, torch.int32) != ir.Const(True, torch.int32)
    assert ir.Const(float("nan"), f32) == ir.Const(float("nan"), f32)
    assert len({op("add", X, const(0.0)), op("add", X, const(-0.0))}) == 2


def test_signed_zeros_survive_a_kernel():
    """``x + 0.0`` and ``x - 0.0`` of -0.0, and ``x * 1.0`` of NaN and inf, as eager gives them."""
    x = torch.tensor([-0.0, 0.0, float("nan"), float("inf"), -1.5] * 7, device=DEVICE)
    fn = lambda x: (x + 0.0, x - 0.0, x * 1.0, x / 1.0, x + -0.0)  # noqa: E731
    m = compile_fn(fn, x)
    for got, want in zip(run(m, x), fn(x)):
        torch.testing.assert_close(got, want, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)


# ---------------------------------------------------------------------------------- names, errors
def test_source_line_is_the_innermost_frame():
    trace = ('  File "/home/u/train.py", line 10, in step\n    loss = model(x)\n'
             '  File "/home/u/model.py", line 42, in forward\n    y = F.gelu(self.ln(x))\n'
             '        ^^^^^^^^^^^^^^^^^^^^^\n')
    assert naming.source_line(trace) == "model.py:42 in forward: y = F.gelu(self.ln(x))"
    assert naming.source_line(None) == "" and naming.source_line("no frames here") == ""


def test_lowering_error_names_the_node_and_the_source_line():
    """As torch.fx's interpreter re-raises: the node, its op and where the user wrote it."""
    from cgtrees.codegen.graph import GraphLowerer
    from cgtrees.config import Config

    class WithSubmodule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    gm = torch.fx.symbolic_trace(WithSubmodule())
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    node.meta["stack_trace"] = '  File "/src/model.py", line 7, in forward\n    return self.lin(x)\n'
    with pytest.raises(NotImplementedError) as info:
        GraphLowerer(gm, Config()).run()
    message = str(info.value)
    assert message.startswith("call_module lin"), message
    assert "While lowering lin = call_module lin\n  from model.py:7 in forward: return self.lin(x)" in message, message
    assert set(GraphLowerer.NODE_KINDS) == {"placeholder", "get_attr", "call_module", "call_method",
                                           "call_function", "output"}
