"""Weight gradients under autocast on the GPU, default path (``backend/codegen/float_gemms.py``): each bf16
GEMM cast to a float32 weight's dtype is timed against cuBLAS writing float32 itself, the choice is a
line of the backward module's header, and the gradients are as close to float64's as eager's are."""

from __future__ import annotations

import os
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2816), torch.nn.GELU(), torch.nn.Linear(2816, 1024))


def _grads(model: torch.nn.Module, x: torch.Tensor, autocast: bool = True) -> list[torch.Tensor]:
    model.zero_grad()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        out = model(x)
    (out.float() ** 2).mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("decisions", ["measure", "rewrite"])
def test_weight_gradients_are_timed_and_as_close_to_float64_as_eagers(decisions, tmp_path):
    import cgtrees  # noqa: F401

    x = torch.randn(4096, 1024, device="cuda")
    model = _mlp().cuda()
    eager = _grads(model, x)
    exact = _grads(model.double(), x.double(), autocast=False)
    model.float()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="cgtrees",
                             options={"gemm_decisions": decisions, "debug_dir": str(tmp_path)})
    ours = _grads(compiled, x)
    (backward,) = [p for p in tmp_path.iterdir() if "_backward_" in p.name]
    header = backward.read_text()
    lines = re.findall(r"^#   \w+: mm .* cast to float32: .*$", header, re.M)
    print("\n".join(lines))
    # the two weight gradients; the hidden layer's gradient, cast to float32 for GELU's, is read by a kernel
    assert sorted(re.findall(r"mm \[\d+, \d+\] x \[\d+, \d+\]", "\n".join(lines))) == [
        "mm [1024, 4096] x [4096, 2816]", "mm [2816, 4096] x [4096, 1024]"], header[:3000]
    if decisions == "measure":
        assert all(" us" in line for line in lines), lines  # both forms were timed
    else:
        assert all("float32 product" in line for line in lines) and "aten.mm.dtype(" in header, lines
    for got, want, ref in zip(ours, eager, exact):
        assert got.dtype == want.dtype and got.stride() == want.stride()
        err, eager_err = ((t.double() - ref).abs().max().item() for t in (got, want))
        scale = ref.abs().max().item()
        assert err <= 1.5 * eager_err + 2 ** -10 * scale, (err, eager_err, scale)
