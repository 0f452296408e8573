"""Training a conv net compiled by cgtrees against eager and float64, for the channels-last tests
on the CPU (tests/test_layout.py) and on CUDA (tests/gpu/test_layout_gpu.py)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, truth: torch.Tensor | None = None) -> None:
    """float32 against eager's float32: atol scaled to the largest value (batch norm's decomposition
    reassociates sums), and at least 3x eager's own error against ``truth`` (float64) where given:
    a batch-norm weight's gradient is a sum of terms 10^4 times larger than itself, where eager's
    float32 is off by 7e-6 too."""
    atol = 1e-5 * max(1.0, expected.abs().max().item())
    if truth is not None:
        atol = max(atol, 3 * (expected.double() - truth).abs().max().item())
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def same(actual: torch.Tensor, expected: torch.Tensor, what: str, truth: torch.Tensor | None = None) -> None:
    """``close``, and eager's strides."""
    close(actual, expected, what, truth)
    assert actual.stride() == expected.stride(), f"{what}: strides {actual.stride()}, eager's {expected.stride()}"


class _Kinks(torch.overrides.TorchFunctionMode):
    """Records the smallest distance of a ReLU's, ReLU6's or hardtanh's input from its kinks."""

    def __init__(self) -> None:
        super().__init__()
        self.least = float("inf")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kinks = {F.relu: (0.0,), torch.relu: (0.0,), F.relu6: (0.0, 6.0)}.get(func)
        if func is F.hardtanh:  # nn.ReLU6 is a hardtanh
            bounds = {"min_val": -1.0, "max_val": 1.0, **dict(zip(("min_val", "max_val"), args[1:3])), **kwargs}
            kinks = (bounds["min_val"], bounds["max_val"])
        if kinks:
            x = args[0].detach()
            self.least = min([self.least, *((x - k).abs().min().item() for k in kinks)])
        return func(*args, **kwargs)


def kink_distance(model: nn.Module, x: torch.Tensor) -> float:
    """How close eager's forward comes to a ReLU's kink. Within float32 rounding of it (an input one
    ulp from 0), eager and a compiled forward that sums in another order may take opposite sides,
    and the gradients then differ by a whole element's gradient, spread by batch norm's backward to
    every element: right on both sides, and no test of gradients against eager's can hold."""
    with _Kinks() as kinks:
        copy.deepcopy(model)(x)
    return kinks.least


def train_against_eager(model: nn.Module, x: torch.Tensor, options: dict, steps: int,
                        buffers_against_float64: bool) -> None:
    """``steps`` training steps of ``model`` compiled with ``options`` beside eager and a float64
    copy: outputs, input and parameter gradients (values and strides) and buffers after each step.
    Buffers are held to 3x eager's float64 error too where ``buffers_against_float64``."""
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = torch.compile(model, backend="cgtrees", options=options)
    for step in range(steps):
        x_ours, x_eager, x_exact = (x.clone().requires_grad_(), x.clone().requires_grad_(),
                                    x.double().requires_grad_())
        out, expected, truth = compiled(x_ours), eager(x_eager), exact(x_exact)
        cotangent = torch.randn_like(expected)
        for y, dy in ((out, cotangent), (expected, cotangent), (truth, cotangent.double())):
            y.backward(dy)
        same(out, expected, f"step {step}: output", truth)
        same(x_ours.grad, x_eager.grad, f"step {step}: grad of the input", x_exact.grad)
        for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
            same(p.grad, q.grad, f"step {step}: grad of {name}", r.grad)
            p.grad, q.grad, r.grad = None, None, None
        for (name, b), c, d in zip(model.named_buffers(), eager.buffers(), exact.buffers()):
            close(b, c, f"step {step}: buffer {name}", d if buffers_against_float64 else None)
