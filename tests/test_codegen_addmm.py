"""addmm as mm plus a bias added in its consumer's kernel (``backend/codegen/lower_addmm.py``),
through Triton's interpreter on CPU: where it happens (the generated ``call`` runs mm, the bias is
loaded by the consumer's kernel), where it does not, and values and gradients against eager and
float64, in float32 and bfloat16 (which keeps addmm: the product would round before the add)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, aten_call_targets, compile_fn, config, kernel_count, run
from torch.testing._internal.common_methods_invocations import op_db

from cgtrees.codegen.ir import index_symbols
from cgtrees.codegen.lower_views import split_remap

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")


@pytest.fixture(autouse=True)
def rewritten_gemms(monkeypatch):
    """mm plus the bias in the consumer wherever it applies: on CPU nothing is timed, and GEMMs stay as traced
    (``test_cpu_default_keeps_addmm_and_says_why``)."""
    monkeypatch.setenv("CGTREES_GEMM_DECISIONS", "unfuse")


# ------------------------------------------------------------------------------------------ helpers


def kernel_texts(module) -> list[str]:
    """Each kernel with the comment above it (the aten nodes it came from)."""
    head = module.source.split("\ndef call(")[0]
    return [k for k in re.split(r"\n\n\n(?=# )", head) if re.search(r"\ndef (pw|red)_", k)]


def assert_scaled_close(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
    """``got`` within a few roundings of eager at the scale of the values, and no further from
    the float64 result than twice eager's error, give or take a few roundings (our kernels' math
    functions are not eager's, so even a float64 graph differs from eager in the last bits)."""
    assert got.dtype == eager.dtype and got.shape == eager.shape
    eps = torch.finfo(eager.dtype).eps
    scale = exact.abs().max().item()
    ours = (got.double() - exact).abs().max().item()
    theirs = (eager.double() - exact).abs().max().item()
    assert ours <= 2 * theirs + 4 * eps * scale, (ours, theirs, scale)
    torch.testing.assert_close(got, eager, atol=4 * eps * scale, rtol=0)


class MLP(torch.nn.Module):
    """Linear -> GELU -> Linear, plus the input (a residual add) when ``residual``."""

    def __init__(self, d: int, hidden: int, residual: bool) -> None:
        super().__init__()
        self.fc, self.proj, self.residual = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(F.gelu(self.fc(x)))
        return y + x if self.residual else y


def mlp(dtype: torch.dtype, residual: bool, exact: bool = False) -> MLP:
    """The same weights for every call; ``exact``: those of ``dtype``, held in float64."""
    torch.manual_seed(0)
    model = MLP(48, 80, residual)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5)  # biases as large as the products: a lost bias add shows
    return model.to(dtype).to(torch.float64 if exact else dtype)


# ------------------------------------------------------------------------------------- where it happens
def test_mlp_runs_mm_and_adds_the_bias_in_the_gelu_kernel():
    model = mlp(torch.float32, residual=True)
    x = torch.randn(3, 7, 48)
    params = [p.detach() for p in model.parameters()]
    f = lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) + x
    m = compile_fn(f, x, *params)
    assert aten_call_targets(m) == ["aten.mm.default", "aten.mm.default"], m.source
    assert kernel_count(m) == 2, m.source  # bias + GELU, and bias + residual: no kernel for a bias alone
    gelu, residual = kernel_texts(m)
    assert "aten.erf" in gelu and "aten.addmm.default(b1_1, " in gelu and "b1_1_ptr" in gelu, gelu
    assert "aten.addmm.default(b2_1, " in residual and "b2_1_ptr" in residual, residual
    out = run(m, x, *params)[0]
    assert_scaled_close(out, f(x, *params), f(x.double(), *[p.double() for p in params]))


def test_dynamic_shapes_run_mm_too():
    """Symbolic token counts: the split view after the GEMM is ``[s0*s1, N] -> [s0, s1, N]``, and its
    ``sym_size`` users read no values."""
    model = mlp(torch.float32, residual=True)
    params = [p.detach() for p in model.parameters()]
    f = lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2) + x
    m = compile_fn(f, torch.randn(3, 7, 48), *params, dynamic=True)
    assert aten_call_targets(m) == ["aten.mm.default", "aten.mm.default"], m.source
    for x in (torch.randn(3, 7, 48), torch.randn(2, 11, 48)):
        assert_scaled_close(run(m, x, *params)[0], f(x, *params), f(x.double(), *[p.double() for p in params]))


def test_training_forward_keeps_addmm_whose_sum_is_saved_and_gradients_match():
    """The first layer's sum is GELU's input, saved for the backward: addmm writes it once (mm
    and a fused add would write the product and then the sum). The second layer's sum feeds only
    the residual add: mm, the bias in that kernel."""
    models = [mlp(torch.float32, True), mlp(torch.float32, True), mlp(torch.float32, True, exact=True)]
    comp = Compiler()
    runs = [torch.compile(models[0], backend=comp.backend), models[1], models[2]]
    x = torch.randn(4, 9, 48)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()]
    outs = [model(xi) for model, xi in zip(runs, xs)]
    for out in outs:
        (out * out).sum().backward()
    comp.check()
    forward = comp.modules[0]
    calls = aten_call_targets(forward)
    assert calls == ["aten.addmm.default", "aten.mm.default"], forward.source
    gelu = next(k for k in kernel_texts(forward) if "aten.erf" in k)
    assert gelu.count("tl.store(") == 1, gelu  # the GELU, which the backward's product reads
    assert_scaled_close(outs[0], outs[1], outs[2].detach())
    assert_scaled_close(xs[0].grad, xs[1].grad, xs[2].grad)
    for ours, eager, exact in zip(*(m.parameters() for m in models)):
        assert_scaled_close(ours.grad, eager.grad, exact.grad)


@pytest.mark.parametrize("bias_shape", [(5,), (1, 5), (6, 5), (6, 1), ()], ids=str)
@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1), (0, -1.5)])
def test_bias_shapes_beta_alpha(bias_shape, beta, alpha):
    a, b = torch.randn(6, 4), torch.randn(4, 5)
    bias = torch.randn(bias_shape)
    if beta == 0:
        bias = torch.full(bias_shape, float("nan"))  # beta=0 ignores the bias, NaN included, as eager does
    f = lambda bias, a, b: torch.relu(torch.addmm(bias, a, b, beta=beta, alpha=alpha)) * 3
    m = compile_fn(f, bias, a, b)
    assert aten_call_targets(m) == ["aten.mm.default"], m.source
    assert kernel_count(m) == 1, m.source
    out = run(m, bias, a, b)[0]
    assert not out.isnan().any()
    assert_scaled_close(out, f(bias, a, b), f(bias.double(), a.double(), b.double()))


def test_baddbmm_runs_bmm_and_adds_in_the_consumer():
    bias, a, b = torch.randn(7), torch.randn(3, 6, 4), torch.randn(3, 4, 7)
    f = lambda bias, a, b: torch.tanh(torch.baddbmm(bias, a, b, beta=0.5))
    m = compile_fn(f, bias, a, b)
    assert aten_call_targets(m) == ["aten.bmm.default"], m.source
    out = run(m, bias, a, b)[0]
    assert_scaled_close(out, f(bias, a, b), f(bias.double(), a.double(), b.double()))


# --------------------------------------------------------------------------------- where it does not
def _linear_then(consumer):
    return lambda x, w, b: consumer(F.linear(x, w, b))


KEPT = {
    "graph output only": _linear_then(lambda y: y),
    "output and a pointwise op": lambda x, w, b: (lambda y: (y, torch.relu(y)))(F.linear(x, w, b)),
    "softmax (a reduction)": _linear_then(lambda y: torch.softmax(y, -1)),
    "another matmul": _linear_then(lambda y: y @ y.transpose(-1, -2)),
    "output and a merged view": lambda x, w, b: (lambda y: (y, torch.relu(y.reshape(-1))))(torch.addmm(b, x, w.t())),
    "alpha=0": lambda x, w, b: torch.relu(torch.addmm(b, x, w.t(), alpha=0)),
}


@pytest.mark.parametrize("name", list(KEPT))
def test_addmm_kept_where_the_bias_add_would_fuse_with_nothing(name):
    f = KEPT[name]
    x, w, b = torch.randn(6, 8), torch.randn(5, 8), torch.randn(5)
    m = compile_fn(f, x, w, b)
    assert "aten.addmm.default" in aten_call_targets(m) and "addmm_mm = " not in m.source, m.source
    outs, want = run(m, x, w, b), f(x, w, b)
    want = want if isinstance(want, tuple) else (want,)
    exact = f(x.double(), w.double(), b.double())
    for got, eager, ex in zip(outs, want, exact if isinstance(exact, tuple) else (exact,)):
        assert_scaled_close(got, eager, ex)


def test_cpu_default_keeps_addmm_and_says_why(monkeypatch):
    """With the default ``gemm_decisions=measure`` and no GPU to time on, the addmm stays one call,
    and the module's header says so."""
    monkeypatch.delenv("CGTREES_GEMM_DECISIONS")
    x, w, b = torch.randn(6, 8), torch.randn(5, 8), torch.randn(5)
    f = _linear_then(torch.relu)
    m = compile_fn(f, x, w, b)
    assert aten_call_targets(m) == ["aten.addmm.default"], m.source
    lines = ("addmm: addmm [6, 8] x [8, 5] float32: as traced (no GPU to time on (cpu))",
             "addmm: addmm [6, 8] x [8, 5] float32: addmm (no GPU to time on (cpu))")
    assert m.graph.gemm_choices == lines
    assert all(f"#   {line}" in m.source for line in lines), m.source


def test_option_off_keeps_addmm():
    x, w, b = torch.randn(6, 8), torch.randn(5, 8), torch.randn(5)
    f = _linear_then(torch.relu)
    assert aten_call_targets(compile_fn(f, x, w, b)) == ["aten.mm.default"]
    m = compile_fn(f, x, w, b, cfg=config(unfuse_addmm=False))
    assert aten_call_targets(m) == ["aten.addmm.default"], m.source
    torch.testing.assert_close(run(m, x, w, b)[0], f(x, w, b), atol=0, rtol=0)


def test_bfloat16_keeps_addmm_and_matches_eager():
    """A half-precision addmm adds its bias before the product rounds (cuBLAS, in its float32
    accumulator); mm + add would round twice (on GPT-2's MLP shape, 1.4x the RMS error against
    float64, 1.9x the largest): kept, as Inductor keeps it."""
    model = mlp(torch.bfloat16, residual=False)
    comp = Compiler()
    compiled = torch.compile(model, backend=comp.backend)
    x = torch.randn(2, 5, 48)
    x0, x1 = x.bfloat16().requires_grad_(), x.bfloat16().requires_grad_()
    eager_model = mlp(torch.bfloat16, residual=False)
    out, want = compiled(x0), eager_model(x1)
    exact_model, xe = mlp(torch.bfloat16, False, exact=True), x.bfloat16().double().requires_grad_()
    exact = exact_model(xe)
    for y in (out, want, exact):
        y.float().pow(2).sum().backward()
    comp.check()
    assert aten_call_targets(comp.modules[0]).count("aten.addmm.default") == 2, comp.modules[0].source
    assert "aten.mm.default" not in aten_call_targets(comp.modules[0])
    assert_scaled_close(out, want, exact.detach())
    assert_scaled_close(x0.grad, x1.grad, xe.grad)
    for got, eager, ex in zip(model.parameters(), eager_model.parameters(), exact_model.parameters()):
        assert_scaled_close(got.grad, eager.grad, ex.grad)


# ---------------------------------------------------------------------- OpInfo samples, with a consumer
def _samples():
    for op in op_db:
        if op.name in ("addmm", "baddbmm") and op.variant_test_name == "":
            for dtype in (torch.float32, torch.float64):
                for i, sample in enumerate(op.sample_inputs("cpu", dtype)):
                    yield pytest.param(op, sample, id=f"{op.name}-{str(dtype)[6:]}-{i}")


@pytest.mark.parametrize("op,sample", list(_samples()))
def test_opinfo_samples_feeding_a_pointwise_op(op, sample):
    """Every OpInfo sample of addmm and baddbmm (broadcast biases, beta and alpha, empty K), its
    product read by a pointwise op: the product runs as mm/bmm, the values are eager's."""
    kwargs = sample.kwargs
    f = lambda bias, a, b: torch.sigmoid(op.op(bias, a, b, **kwargs))
    tensors = [sample.input, *sample.args]
    m = compile_fn(f, *tensors)
    assert aten_call_targets(m) == [{"addmm": "aten.mm.default", "baddbmm": "aten.bmm.default"}[op.name]], m.source
    out = run(m, *tensors)[0]
    assert_scaled_close(out, f(*tensors), f(*[t.double() for t in tensors]))


# ------------------------------------------------------------------------------------------- views
def test_split_remap():
    y = index_symbols(3)
    x0, x1 = index_symbols(2)
    assert split_remap((24, 5), (2, 12, 5)) == {x0: 12 * y[0] + y[1], x1: y[2]}
    assert split_remap((24, 5), (24, 1, 5)) == {x0: y[0], x1: y[2]}
    assert split_remap((2, 12, 5), (24, 5)) is None  # a merge
    assert split_remap((6, 4), (4, 6)) is None


def test_split_reshape_of_a_lazy_value_is_one_kernel():
    f = lambda x: torch.relu((x * 2).view(2, 3, 4) + 1)
    x = torch.randn(6, 4)
    m = compile_fn(f, x)
    assert kernel_count(m) == 1, m.source
    torch.testing.assert_close(run(m, x)[0], f(x), atol=0, rtol=0)
