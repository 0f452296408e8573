"""Softmax, log-softmax and cross-entropy over long rows (issue 44, "Real sizes, part 1", item 2).

A row longer than a block (a language model's 50257 or 30522 logits) is walked in a loop. Its max
and its sum of exponentials are one loop (``codegen/online_softmax.py``), so a softmax reads its
row twice (statistics, then the output), not three times, and is never split over the row's
chunks. A cross-entropy's forward is that loop with the mean over the rows as the kernel's tail, the
target's logit read once per row (``codegen/one_hot.py``, ``aot/decompositions.nll_loss_picks``); its backward is one
kernel that writes ``grad_logits`` from the logits and the row statistics, walking [rows, columns]
blocks (``scheduler._by_rows``).

Kernel counts and loops are read off the modules our partition and codegen make; values and
gradients go through ``torch.compile(..., backend="cgtrees")`` against eager (rows with ``-inf``
entries, of ``-inf`` only, of values whose exponentials overflow without the max, tiny values;
ignored targets, every target ignored, weights, label smoothing, each reduction). On CPU the kernels
run in Triton's interpreter, so rows are few.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, compile_fn

DEVICE = "cpu" if INTERPRET else "cuda"
# On the GPU machine these run compiled in tests/gpu/test_long_rows_gpu.py: a pytest-xdist worker there
# may have turned Triton's interpreter on for the process (interp.enable) in an earlier CPU test
pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")
LONG = (50257, 30522)
HALF = (torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------ helpers
def trained(fn, x: torch.Tensor, *rest: torch.Tensor) -> tuple[Compiler, torch.Tensor, torch.Tensor]:
    """One forward and backward of ``fn`` (our partition, our codegen; graphs kept): the output and
    the input's gradient, for the cotangent ``ones`` (a scalar loss) or a fixed random one."""
    comp = Compiler()
    xc = x.detach().clone().requires_grad_()
    out = torch.compile(fn, backend=comp.with_our_partition)(xc, *rest)
    out.backward(_cotangent(out))
    comp.check()
    return comp, out, xc.grad


def _cotangent(out: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(out.shape, generator=generator).to(out.device, out.dtype)


def eager(fn, x: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xe = x.detach().clone().requires_grad_()
    out = fn(xe, *rest)
    out.backward(_cotangent(out))
    return out, xe.grad


def through_cgtrees(fn, x: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn``'s output and input gradient through ``backend="cgtrees"`` (the driver), generated."""
    compiled = torch.compile(fn, backend="cgtrees", options={"interpret": INTERPRET, "cache": False})
    xc = x.detach().clone().requires_grad_()
    out = compiled(xc, *rest)
    out.backward(_cotangent(out))
    return out, xc.grad


def modules(comp: Compiler, kind: str) -> list:
    return [m for m in comp.modules if m.name.startswith(f"g_{kind}")]


def kernels(comp: Compiler, kind: str) -> list[str]:
    return [k for m in modules(comp, kind) for k in m.graph.kernels]


def loops(comp: Compiler, kind: str, name: str) -> int:
    """How many loops over the row kernel ``name`` makes."""
    source = next(m.graph.source for m in modules(comp, kind) if name in m.graph.kernels)
    body = re.search(rf"def {name}\(.*?\n(.*?)(?=\n\n|\Z)", source, re.S).group(1)
    return body.count("for roffset in range(")


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within the codegen tests' tolerances, scaled by the largest finite expected value; NaN where
    eager has NaN, infinities where it has them."""
    scale = max(expected.float().nan_to_num(0, 0, 0).abs().max().item(), 1.0)
    tol = dict(atol=1e-2 * scale, rtol=1.6e-2) if expected.dtype in HALF else dict(atol=1e-5 * scale, rtol=1e-4)
    torch.testing.assert_close(actual.float(), expected.float(), equal_nan=True, **tol, msg=lambda m: f"{what}: {m}")


def edge_rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows a long softmax gets wrong without care: masked entries, nothing but ``-inf``, values whose
    exponentials overflow unless the max is taken out first, tiny values, two dominant entries."""
    x = torch.randn(5, n) * 3
    x[0, ::7] = float("-inf")
    x[1] = float("-inf")
    x[2] *= 1e4
    x[3] *= 1e-30
    x[4, 5], x[4, n - 9] = 80.0, 88.0
    return x.to(DEVICE, dtype)


# ------------------------------------------------------------------------------------ softmax alone
@pytest.mark.parametrize("n", LONG)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_long_row_reads_its_row_twice(kind, n):
    """One kernel forward: one loop for the max and the sum together, one that writes the output
    (three loops without the online pass); one kernel backward."""
    fn = getattr(torch, kind)
    x = torch.randn(3, n, device=DEVICE) * 4
    comp, out, grad = trained(lambda x: fn(x, -1), x)
    (forward,) = kernels(comp, "forward")
    assert loops(comp, "forward", forward) == 2, forward
    assert len(kernels(comp, "backward")) == 1, kernels(comp, "backward")
    expected, expected_grad = eager(lambda x: fn(x, -1), x)
    close(out, expected, kind)
    close(grad, expected_grad, f"{kind}'s gradient")


def test_few_long_rows_are_not_split():
    """8 rows of 50257 would split a plain reduction over the row's chunks (6 kernels for a
    log-softmax: max in two stages, ``x - max`` written, sum in two stages, the output); the
    softmax's statistics stay one loop of one kernel."""
    x = torch.randn(8, 50257, device=DEVICE)
    comp, out, _ = trained(lambda x: torch.log_softmax(x, -1), x)
    (forward,) = kernels(comp, "forward")
    assert loops(comp, "forward", forward) == 2
    close(out, torch.log_softmax(x, -1), "log_softmax")


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_long_rows_at_their_edges(kind, dtype):
    """Values and gradients against eager, through the driver, on ``edge_rows``: half inputs
    accumulate in float32 as eager does; a row of ``-inf`` is NaN in both."""
    fn = getattr(torch, kind)
    x = edge_rows(50257, dtype)
    out, grad = through_cgtrees(lambda x: fn(x, -1), x)
    expected, expected_grad = eager(lambda x: fn(x, -1), x)
    assert torch.isnan(out[1]).all()
    close(out, expected, kind)
    close(grad, expected_grad, f"{kind}'s gradient")


# -------------------------------------------------------------------------------------- cross-entropy
def _loss(**kw):
    return lambda x, t: F.cross_entropy(x.float(), t, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", LONG)
def test_cross_entropy_kernels(n, dtype):
    """Forward: one kernel of one loop for the row statistics, the mean over the rows its tail
    (``scheduler``'s ``tail`` role); no buffer of the logits' size. Backward: one kernel, one loop
    over the row."""
    x = (torch.randn(4, n, device=DEVICE) * 3).to(dtype)
    t = torch.tensor([3, -100, n - 1, 17], device=DEVICE)
    comp, out, grad = trained(_loss(), x, t)
    forward, backward = kernels(comp, "forward"), kernels(comp, "backward")
    assert len(forward) == 1 and loops(comp, "forward", forward[0]) == 1, forward
    assert f"empty_strided(({4}, {n})" not in modules(comp, "forward")[0].graph.source
    assert len(backward) == 1 and loops(comp, "backward", backward[0]) == 1, backward
    expected, expected_grad = eager(_loss(), x, t)
    close(out, expected, "loss")
    close(grad, expected_grad, "grad_logits")


CASES = {
    "mean": dict(),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "weights": dict(weight="rand"),
    "label smoothing": dict(label_smoothing=0.1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ignored", ["some", "all"])
@pytest.mark.parametrize("case", list(CASES))
def test_cross_entropy_against_eager(case, ignored, dtype):
    """Loss and gradient through the driver: a row with ``-inf`` logits, an ignored row (or every
    row ignored: a mean of nothing is NaN, its gradient 0), each reduction, weights, smoothing."""
    n = 30522
    kw = dict(CASES[case])
    if kw.get("weight") == "rand":
        kw["weight"] = torch.rand(n, device=DEVICE)
    x = (torch.randn(4, n, device=DEVICE) * 4).to(dtype)
    x[0, ::5] = float("-inf")
    t = torch.tensor([3, -100, n - 1, 17], device=DEVICE)
    if ignored == "all":
        t[:] = -100
    out, grad = through_cgtrees(_loss(**kw), x, t)
    expected, expected_grad = eager(_loss(**kw), x, t)
    close(out, expected, "loss")
    close(grad, expected_grad, "grad_logits")


@pytest.mark.skipif(not INTERPRET, reason="a device assert is seen where the kernel runs in the interpreter")
def test_target_out_of_range_raises_in_the_kernel():
    """The target's logit is read at the one-hot scatter's checked index: a target past the classes
    makes the kernel raise (eager raises too), never a read of another row."""
    x, good, bad = torch.randn(3, 9000), torch.tensor([1, 2, 3]), torch.tensor([1, 9000, 3])
    module = compile_fn(lambda x, t: F.cross_entropy(x, t), x, good)
    with pytest.raises(Exception, match="index out of range"):
        module.module.call([x, bad])


# --------------------------------------------------------------------------------- one-hot sums
def test_one_hot_sums_pick_without_a_reduction():
    """A sum over a one-hot (``where(arange == t, x, 0)``, ``F.one_hot(t) * x``) is the element it
    picks: pointwise over the rows, no loop over 9000 columns; an index out of range picks 0."""
    x, t = torch.randn(6, 9000, device=DEVICE), torch.tensor([0, 8999, 17, -1, 9000, 4], device=DEVICE)

    def fn(x, t):
        cols = torch.arange(9000, device=x.device)
        return (torch.where(cols == t[:, None], x * 2, 0).sum(1),
                (F.one_hot(t.clamp(0, 8999), 9000) * x).sum(-1, keepdim=True))

    module = compile_fn(fn, x, t)
    assert "for roffset" not in module.source and not any(k.startswith("red") for k in module.graph.kernels)
    for got, want in zip(module.call([x, t]), fn(x, t)):
        torch.testing.assert_close(got, want)
