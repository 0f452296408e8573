"""``max_copy_mb_per_launch`` on a GPU: a graph of few kernels over large fresh inputs runs without
CUDA graphs (each replay would copy its inputs, which costs the GPU more than the launches cost
the host), stays right against eager, and records again with the option at 0; a graph of many
launches over small inputs records as before."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import cgtrees.runtime as runtime

DEV = "cuda"


class NormAct(nn.Module):
    """The benchmark's bandwidth-bound workload: two layer norms and activations, a few kernels."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.norm1(x)) * torch.sigmoid(x) + x
        return torch.softmax(self.norm2(y), dim=-1) * 2 + torch.tanh(y)


def _train(options: dict, steps: int = 4) -> None:
    """``steps`` training steps on fresh 32 MiB inputs, outputs and every gradient against eager's."""
    torch.manual_seed(0)
    model = NormAct(2048).to(DEV)
    eager = copy.deepcopy(model)
    f = torch.compile(model, backend="cgtrees", options={"cache": False, **options})
    batches = []  # each step's input and gradient stay alive (a loader's queue): a new address each step,
    for _ in range(steps):  # so the replays would copy them (one at the same address is read in place)
        x = torch.randn(4096, 2048, device=DEV)
        dy = torch.randn(4096, 2048, device=DEV)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, want = f(xa), eager(xb)
        out.backward(dy)
        want.backward(dy)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), eager.parameters()):  # sums over 4096 rows: atol scaled
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * max(1.0, q.grad.abs().max().item()))
            p.grad = q.grad = None
        batches.append((xa.detach(), dy))
        del out, xa  # as a training loop drops them: a kept output would force a new recording


def test_large_copies_over_few_launches_run_without_graphs(no_tf32):
    _train({})
    text = runtime.describe()
    assert counters["cgtrees"]["cudagraph_recorded"] == 0, text
    assert counters["cgtrees"]["cudagraph_skips"] == 2, text  # the forward and the backward
    assert text.count("max_copy_mb_per_launch=8") == 2, text


def test_option_at_zero_records_them(no_tf32):
    """The first recordings read the 32 MiB inputs where they are; at the next call they moved, so
    the forward and the backward record once more, copying them from then on, and replay."""
    _train({"max_copy_mb_per_launch": 0}, steps=5)
    assert counters["cgtrees"]["cudagraph_recorded"] == 4, runtime.describe()
    assert "copied after they moved" in runtime.describe(), runtime.describe()
    assert counters["cgtrees"]["cudagraph_replayed"] >= 4, runtime.describe()
    assert counters["cgtrees"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("batch", [64, 4096])
def test_many_launches_over_small_inputs_still_record(batch):
    """An MLP's forward and backward: a few MiB of inputs at most over a dozen launches."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())]).to(DEV)
    f = torch.compile(model, backend="cgtrees", options={"cache": False})
    for _ in range(4):
        f(torch.randn(batch, 256, device=DEV)).sum().backward()
    assert counters["cgtrees"]["cudagraph_skips"] == 0, runtime.describe()
    assert counters["cgtrees"]["cudagraph_recorded"] == 2, runtime.describe()
