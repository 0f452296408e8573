"""addmm as mm plus a bias fused into its consumer (``backend/codegen/lower_addmm.py``) on CUDA:
a GPT-2 MLP block (8 x 128 tokens, 512 -> 2048 -> 512, GELU (tanh), residual) compiled with
``backend="cgtrees"`` (CUDA graphs replayed) gives eager's outputs and gradients, float32 and
bfloat16, judged against float64: mm and addmm are different cuBLAS kernels that sum in different
orders, so ours may differ from eager by what each differs from the exact result. The float32
training forward calls mm for proj (its bias added in the residual kernel) and keeps addmm for fc,
whose sum the backward reads (the GEMM writes it once); bfloat16 keeps addmm for both. The
per-call times with the option on and off are printed (not asserted)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

DEV = "cuda"


@pytest.fixture(autouse=True)
def unfused(monkeypatch):
    """The rewritten form wherever it applies (``gemm_decisions=unfuse``): by default the two forms
    are timed and either may win (``test_gemm_choice_gpu.py``); here the rewrite's values are tested."""
    monkeypatch.setenv("CGTREES_GEMM_DECISIONS", "unfuse")
TOKENS, D, HIDDEN = (8, 128), 512, 2048


class Block(torch.nn.Module):
    """GPT-2's MLP with its layer norm and residual: x + proj(gelu_tanh(fc(ln(x))))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.proj = torch.nn.LayerNorm(D), torch.nn.Linear(D, HIDDEN), torch.nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x)), approximate="tanh"))


def block(dtype: torch.dtype, exact: bool = False) -> Block:
    """The same weights for every call; ``exact``: those of ``dtype``, held in float64."""
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():
        model.fc.bias.uniform_(-1, 1)  # biases as large as the products: a lost or doubled add shows
        model.proj.bias.uniform_(-1, 1)
    return model.to(DEV, dtype).to(torch.float64 if exact else dtype)


@pytest.fixture(autouse=True)
def _no_tf32(monkeypatch):
    monkeypatch.setenv("CGTREES_CACHE", "0")
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs in float32, eager's and ours
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def assert_near_exact(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
    """No further from the float64 result than twice eager's error, plus a few roundings of the
    values' scale."""
    assert got.dtype == eager.dtype and got.shape == eager.shape
    eps, scale = torch.finfo(eager.dtype).eps, exact.abs().max().item()
    ours = (got.double() - exact).abs().max().item()
    theirs = (eager.double() - exact).abs().max().item()
    assert ours <= 2 * theirs + 4 * eps * scale, (ours, theirs, scale)


def _aten_calls(module) -> list[str]:
    import re

    body = module.source.split("\ndef call(")[1].split("\ndef call_aten(")[0]
    return re.findall(r"= (aten\.[\w.]+)\(", body)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_forward_runs_mm_where_the_sum_is_not_saved_and_addmm_in_bfloat16(dtype):
    from codegen_helpers import Compiler

    comp = Compiler()
    x = torch.randn(*TOKENS, D, device=DEV, dtype=dtype, requires_grad=True)
    torch.compile(block(dtype), backend=comp.backend)(x).sum().backward()
    comp.check()
    calls = _aten_calls(comp.modules[0])
    if dtype == torch.float32:
        assert calls == ["aten.addmm.default", "aten.mm.default"], comp.modules[0].source
    else:
        assert calls.count("aten.addmm.default") == 2 and "aten.mm.default" not in calls, comp.modules[0].source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inference_matches_eager(dtype):
    model, exact_model = block(dtype), block(dtype, exact=True)
    compiled = torch.compile(model, backend="cgtrees")
    x = torch.randn(*TOKENS, D, device=DEV).to(dtype)
    with torch.no_grad():
        want, exact = model(x), exact_model(x.double())
        for _ in range(4):  # warmup, record, replays
            got = compiled(x).clone()
            assert_near_exact(got, want, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_matches_eager(dtype):
    models = [block(dtype), block(dtype), block(dtype, exact=True)]
    compiled = torch.compile(models[0], backend="cgtrees")
    x = torch.randn(*TOKENS, D, device=DEV)
    for _ in range(3):  # warmup, record, replay
        for m in models:
            m.zero_grad(set_to_none=True)
        # three leaves of their own (in float32, ``x.to(dtype)`` is ``x`` itself)
        xs = [x.to(dtype).clone().requires_grad_(), x.to(dtype).clone().requires_grad_(),
              x.to(dtype).double().requires_grad_()]
        outs = [compiled(xs[0]), models[1](xs[1]), models[2](xs[2])]
        for out in outs:
            out.float().pow(2).mean().backward()
        assert_near_exact(outs[0].detach(), outs[1].detach(), outs[2].detach())
        assert_near_exact(xs[0].grad, xs[1].grad, xs[2].grad)
        for ours, eager, exact in zip(*(m.parameters() for m in models)):
            assert_near_exact(ours.grad, eager.grad, exact.grad)


def test_per_call_time_with_and_without_unfusing_is_printed():
    """Inference per call (CUDA events, median of 5 windows of 50 calls), the option on and off."""
    x = torch.randn(*TOKENS, D, device=DEV)
    times = {}
    for unfuse in (True, False):
        torch._dynamo.reset()
        compiled = torch.compile(block(torch.float32), backend="cgtrees", options={"unfuse_addmm": unfuse})
        with torch.no_grad():
            for _ in range(5):
                compiled(x)
            windows = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    compiled(x)
                end.record()
                torch.cuda.synchronize()
                windows.append(start.elapsed_time(end) / 50 * 1000)
            want = block(torch.float32)(x)
            assert_near_exact(compiled(x).clone(), want, block(torch.float32, exact=True)(x.double()))
        times[unfuse] = sorted(windows)[2]
    print(f"\nGPT-2 MLP block, float32 inference, {torch.cuda.get_device_name()}: "
          f"unfuse_addmm on {times[True]:.1f} us/call, off {times[False]:.1f} us/call")
