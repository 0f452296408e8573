"""Speed of ViT's first LayerNorm (issue 18), against Inductor.

timm vit_tiny_patch16_224 at batch 32, float32: the patch embedding's output (32x192x14x14, NCHW as
cuDNN returns it) goes through ``flatten(2).transpose(1, 2)``, the cls-token ``cat`` and the
pos-embed add into the first block's LayerNorm. We fuse all of it into one reduction kernel whose
load of the convolution output has stride 1 along the tokens (a kept dimension) and 196 along the
channels (the reduced one). The function starts at the convolution's output: the convolution is
cuDNN's in both backends and would hide the kernel's time. Inference (forward) and training
(forward, then the gradients of every input). Both backends replay CUDA graphs (ours by default,
Inductor with ``mode="reduce-overhead"``). Per call: the median over windows of CUDA-event
timings; each test also prints every kernel's mean device time from the profiler, both backends.
Bound: ours at most 1.5x Inductor's.

Measured in the real-model suite (H100, at aaf1abe): ``red_layernorm_0`` 79 us per call (20 calls
of 10 steps: the forward's and the backward's recomputation together), Inductor's fused kernel
10.5 us (inference).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from speed_helpers import compiled, forward_step, kernel_times, medians_us, training_step  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BOUND = 1.5
BATCH, D, TOKENS = 32, 192, 197


def first_norm(conv: torch.Tensor, cls: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    """The residual stream after the pos-embed add, and the first block's LayerNorm of it."""
    x = torch.cat([cls.expand(conv.shape[0], -1, -1), conv.flatten(2).transpose(1, 2)], 1) + pos
    return x, F.layer_norm(x, (D,), w, b, 1e-6)


def inputs(requires_grad: bool, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = [(BATCH, D, 14, 14), (1, 1, D), (1, TOKENS, D), (D,), (D,)]
    values = [torch.randn(s, device="cuda", dtype=torch.float64) for s in shapes]
    values[3] = 1 + 0.5 * values[3]  # a weight near one, not exactly one
    return [v.to(dtype).requires_grad_(requires_grad) for v in values]


def grads_of_outputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return (torch.randn(BATCH, TOKENS, D, device="cuda"), torch.randn(BATCH, TOKENS, D, device="cuda"))


def assert_near_float64(ours: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """Ours is as close to the float64 result as eager's float32 is (within 2x, plus a few ulps of
    the largest value: sums in another order)."""
    err_ours = (ours.double() - exact).abs().max().item()
    err_eager = (eager.double() - exact).abs().max().item()
    slack = 4 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert err_ours <= 2 * err_eager + slack, (what, err_ours, err_eager)


def check_values(fn, args, grads=None) -> None:
    """Outputs (and every input's gradient) against eager, both measured against float64."""
    exact_args = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
    torch.compiler.cudagraph_mark_step_begin()
    ours, eager, exact = fn(*args), first_norm(*args), first_norm(*exact_args)
    for k in range(2):
        assert ours[k].stride() == eager[k].stride(), (ours[k].stride(), eager[k].stride())
        assert_near_float64(ours[k], eager[k], exact[k], f"output {k}")
    if grads is None:
        return
    names = ("conv", "cls", "pos", "weight", "bias")
    for name, o, e, x in zip(names, torch.autograd.grad(ours, args, grads), torch.autograd.grad(eager, args, grads),
                             torch.autograd.grad(exact, exact_args, [g.double() for g in grads])):
        assert_near_float64(o, e, x, f"gradient of {name}")


def report(what: str, times: dict[str, float], kernels: dict[str, dict[str, float]]) -> None:
    print(f"\n{what} (batch {BATCH}, float32): cgtrees {times['cgtrees']:.1f} us, inductor "
          f"{times['inductor']:.1f} us ({times['cgtrees'] / times['inductor']:.2f}x)")
    for backend, table in kernels.items():
        print(f"  {backend} kernels (us per call): " + ", ".join(f"{k[:60]} {v:.1f}" for k, v in table.items()))


def test_first_layernorm_forward_within_bound():
    args = inputs(requires_grad=False)
    steps, kernels = {}, {}
    for backend in ("cgtrees", "inductor"):
        fn = compiled(first_norm, backend)
        with torch.no_grad():
            check_values(fn, args)
        steps[backend] = forward_step(fn, args)
        kernels[backend] = kernel_times(steps[backend])
    times = medians_us(steps)
    report("ViT first LayerNorm forward", times, kernels)
    assert times["cgtrees"] <= BOUND * times["inductor"], times


def test_first_layernorm_training_within_bound():
    args, grads = inputs(requires_grad=True), grads_of_outputs()
    steps, kernels = {}, {}
    for backend in ("cgtrees", "inductor"):
        fn = compiled(first_norm, backend)
        check_values(fn, args, grads)
        steps[backend] = training_step(fn, args, args, grads)
        kernels[backend] = kernel_times(steps[backend])
    times = medians_us(steps)
    report("ViT first LayerNorm forward+backward", times, kernels)
    assert times["cgtrees"] <= BOUND * times["inductor"], times
