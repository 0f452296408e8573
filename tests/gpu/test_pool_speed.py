"""Speed of our pooling kernels on channels-last activations (issue 18), against Inductor.

resnet18's stem at batch 32: max_pool2d 3x3 stride 2 padding 1 of a 32x64x112x112 channels-last
float32 tensor, fused after a batch-norm-style scale and shift and a ReLU; inference (forward) and
training (forward and backward, the gradient of the input). Both backends replay CUDA graphs
(ours by default, Inductor with ``mode="reduce-overhead"``), so the figures are the kernels'. Per
call: the median over windows of CUDA-event timings. Bound: ours at most 1.5x Inductor's.

Measured before the unrolled kernels (H100): our window-reduction kernel took 497 us per forward
(Inductor's 49 us) and our max pool backward 945 us a step.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from speed_helpers import compiled, forward_step, medians_us, training_step  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BOUND = 1.5
SHAPE = (32, 64, 112, 112)


def stem_pool(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(torch.relu(x * scale + shift), 3, 2, 1)


def inputs(requires_grad: bool) -> tuple[torch.Tensor, ...]:
    """Multiples of 1/32 and small: ``x * scale + shift`` is exact in float32 whether or not it
    compiles to a fused multiply-add, so the pooled maxima, and which element of a window is the
    first one equal to the max (many windows tie), are eager's exactly. (With random floats a
    rounding difference of one ulp moved a gradient between two near-equal window elements.)"""
    torch.manual_seed(0)
    x = (torch.randint(-64, 65, SHAPE, device="cuda") / 16).to(memory_format=torch.channels_last)
    scale = torch.randint(1, 5, (1, SHAPE[1], 1, 1), device="cuda") / 2
    shift = torch.randint(-32, 33, (1, SHAPE[1], 1, 1), device="cuda") / 16
    return x.requires_grad_(requires_grad), scale, shift


def check_values(fn, args, grad=None) -> None:
    """Our values (and gradient) are eager's before any figure counts: exactly, the inputs make
    every value exact."""
    torch.compiler.cudagraph_mark_step_begin()
    out, expected = fn(*args), stem_pool(*args)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out.stride() == expected.stride(), (out.stride(), expected.stride())
    if grad is not None:
        (ours,), (theirs,) = torch.autograd.grad(out, args[0], grad), torch.autograd.grad(expected, args[0], grad)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert ours.stride() == theirs.stride(), (ours.stride(), theirs.stride())


def test_channels_last_max_pool_forward_within_bound():
    args = inputs(requires_grad=False)
    steps = {}
    for backend in ("cgtrees", "inductor"):
        fn = compiled(stem_pool, backend)
        if backend == "cgtrees":
            with torch.no_grad():
                check_values(fn, args)
        steps[backend] = forward_step(fn, args)
    times = medians_us(steps)
    print(f"\nmax_pool2d forward {SHAPE} channels-last: cgtrees {times['cgtrees']:.1f} us, "
          f"inductor {times['inductor']:.1f} us ({times['cgtrees'] / times['inductor']:.2f}x)")
    assert times["cgtrees"] <= BOUND * times["inductor"], times


def test_channels_last_max_pool_training_within_bound():
    args = inputs(requires_grad=True)
    # multiples of 1/16 too: the sums over overlapping windows are exact in any order
    grad = (torch.randint(-64, 65, stem_pool(*args).shape, device="cuda") / 16).to(memory_format=torch.channels_last)
    steps = {}
    for backend in ("cgtrees", "inductor"):
        fn = compiled(stem_pool, backend)
        if backend == "cgtrees":
            check_values(fn, args, grad)
        steps[backend] = training_step(fn, args, args[0], grad)
    times = medians_us(steps)
    print(f"\nmax_pool2d forward+backward {SHAPE} channels-last: cgtrees {times['cgtrees']:.1f} us, "
          f"inductor {times['inductor']:.1f} us ({times['cgtrees'] / times['inductor']:.2f}x)")
    assert times["cgtrees"] <= BOUND * times["inductor"], times
