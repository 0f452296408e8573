"""Column reductions compiled on CUDA: channels-last batch-norm training (the split statistics of
tests/test_codegen_columns.py, compiled by Triton) against eager and float64, on resnet18's and
mobilenet_v3_small's shapes and a small one; and the stage-1 kernels' time printed against the
time to read their inputs once at the device's copy bandwidth."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from layout_helpers import same  # noqa: E402
from speed_helpers import kernel_times  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

DEV = "cuda"
OPTIONS = {"cudagraphs": False, "cache": False}


def bn(x, w, b):
    return F.batch_norm(x, None, None, w, b, training=True)


@pytest.mark.parametrize("shape", [(32, 64, 56, 56), (32, 16, 112, 112), (32, 512, 7, 7), (32, 576, 7, 7),
                                   (8, 8, 32, 32)])
def test_channels_last_batch_norm_training_matches_eager(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(DEV).to(memory_format=torch.channels_last)
    w, b = (torch.randn(shape[1], generator=gen).to(DEV) for _ in range(2))
    grad = torch.randn(*shape, generator=gen).to(DEV).to(memory_format=torch.channels_last)
    ours, eager = ([t.clone().requires_grad_() for t in (x, w, b)] for _ in range(2))
    exact = [t.double().requires_grad_() for t in (x, w, b)]
    out = torch.compile(bn, backend="cgtrees", options=OPTIONS)(*ours)
    expected, truth = bn(*eager), bn(*exact)
    for y, dy in ((out, grad), (expected, grad), (truth, grad.double())):
        y.backward(dy)
    same(out, expected, "output", truth)
    for name, a, e, t in zip(("x", "weight", "bias"), ours, eager, exact):
        same(a.grad, e.grad, f"grad of {name}", t.grad)


def test_split_statistics_read_near_copy_bandwidth(capsys):
    """Printed, not asserted: the compiled forward and backward of the largest resnet18 batch norm
    (32x64x112x112, 103 MB) in kernel time, against reading the input at copy bandwidth."""
    x = torch.randn(32, 64, 112, 112, device=DEV).to(memory_format=torch.channels_last).requires_grad_()
    w, b = (torch.randn(64, device=DEV, requires_grad=True) for _ in range(2))
    grad = torch.randn_like(x)
    fn = torch.compile(bn, backend="cgtrees", options=OPTIONS)
    for _ in range(2):
        fn(x, w, b).backward(grad)
    copy = torch.empty_like(x)

    def step() -> None:
        fn(x, w, b).backward(grad)
        copy.copy_(x)

    times = kernel_times(step, calls=5)
    copy_us = sum(t for n, t in times.items() if not n.startswith(("pw_", "red_")) and "copy" in n.lower())
    with capsys.disabled():
        print(f"\ncopy of 103 MB (read + write): {copy_us:.1f} us")
        for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
            if name.startswith("red_"):
                print(f"  {name}: {us:.1f} us")
    assert any(n.startswith("red_") for n in times), sorted(times)
