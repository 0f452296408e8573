"""``torch.compiler.cudagraph_mark_step_begin()`` in the wrong place (issue 54, item 5): a mark
between a forward and its backward used to end the step there, and the next calls raised
``IndexError`` in ``runtime/function.py`` (``nodes[-1]`` of an empty list). The step now ends at the
next forward, and training gives eager's values and gradients, mark or not.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

DEV = "cuda"
pytestmark = pytest.mark.usefixtures("kernel_modules")


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=max(1e-5 * scale, 1e-6),
                               msg=lambda m: f"{what}: {m}")


def _models(graph_break: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64))
            self.b = nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if graph_break:
                torch._dynamo.graph_break()  # two graphs: two forwards, two backwards a step
            return self.b(h)

    model = Net().to(DEV)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("graph_break", [False, True])
@pytest.mark.parametrize("misplaced", ["early steps", "every step"])
def test_a_mark_between_forward_and_backward_then_normal_training_gives_eager_gradients(graph_break, misplaced,
                                                                                     caplog):
    model, ref = _models(graph_break)
    f = torch.compile(model, backend="cgtrees")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="cgtrees"):
        for step in range(10):
            x = torch.randn(16, 32, device=DEV)
            out, want = f(x), ref(x)
            close(out, want, f"step {step} output")
            if misplaced == "every step" or step in (0, 1, 2, 4):  # warmup, recording, replays
                torch.compiler.cudagraph_mark_step_begin()
            out.square().mean().backward()  # a mean: summed squares at lr 0.1 diverge (eager too)
            want.square().mean().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                close(p.grad, q.grad, f"step {step}: gradient of {name}")
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
    named = [r.getMessage() for r in caplog.records if "between a forward and its backward" in r.getMessage()]
    assert len(named) == 1, named
    assert torch._dynamo.utils.counters["cgtrees"]["cudagraph_replayed"] > 0
