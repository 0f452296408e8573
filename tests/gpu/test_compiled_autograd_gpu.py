"""Compiled autograd on the GPU (issue 20): the backward graph compiled autograd captures goes
through cgtrees and runs in CUDA graphs, in the tree of its forward.

Each test trains a model on CUDA with its backward captured by compiled autograd and compiled by
cgtrees (``torch._dynamo.compiled_autograd._enable`` around ``backward()``, or
``torch._dynamo.config.compiled_autograd`` with the training step compiled), against eager on a
copy: every parameter's gradient and value after every step. Beyond eager's values they check that
the backward graph replays (``cudagraph_replayed``, and the replays of its nodes in
``cgtrees.runtime.describe()``), that it shares its forward's tree (one tree manager), that no
graph falls back and none runs without CUDA graphs, and R4: gradients accumulated over several
backward calls without ``zero_grad``, across generation ends, stay eager's.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

DEV = "cuda"
LR = 0.05
pytestmark = pytest.mark.usefixtures("kernel_modules")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to(DEV)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    # ``/ 3.0`` in eager code: autograd saves the scalar as a 0-dim CPU tensor, an input of the
    # backward graph that must not keep it out of CUDA graphs
    return (out / 3.0).square().mean()


def close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Within float32 reassociation error, scaled with the tensor's own largest entry."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=max(1e-5 * scale, 1e-6),
                               msg=lambda m: f"{what}: {m}")


def same_training_state(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: gradient of {name}"
        if q.grad is not None:
            close(p.grad, q.grad, f"{what}: gradient of {name}")
        close(p.detach(), q.detach(), f"{what}: parameter {name}")


class Trainer:
    """Forward, loss, backward: eagerly (``enable=None``) or with compiled autograd compiled by
    cgtrees, enabled by the context manager or by ``torch._dynamo.config.compiled_autograd``."""

    def __init__(self, model: nn.Module, enable: str | None) -> None:
        self.model, self.enable = model, enable
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)
        if enable == "context":
            self.forward = torch.compile(model, backend="cgtrees")
        elif enable == "config":  # read when torch.compile wraps the function
            with torch._dynamo.config.patch(compiled_autograd=True):
                self.compiled_step = torch.compile(self._plain_step, backend="cgtrees")

    def _plain_step(self, x: torch.Tensor) -> torch.Tensor:
        loss = loss_of(self.model(x))
        loss.backward()
        return loss.detach()

    def backward_step(self, x: torch.Tensor) -> torch.Tensor:
        if self.enable is None:
            return self._plain_step(x)
        if self.enable == "config":
            return self.compiled_step(x)
        loss = loss_of(self.forward(x))
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="cgtrees")):
            loss.backward()
        return loss.detach()

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def backward_replays() -> int:
    """Replays of the nodes of backward functions (under compiled autograd, only its graphs run as
    backward functions: AOTAutograd's own backward of the forward never runs)."""
    from cgtrees import runtime

    return sum(int(m.group(1)) for m in re.finditer(r"node \d+ g\d+_backward\S* .*?replays=(\d+)", runtime.describe()))


def trees() -> int:
    from cgtrees import runtime

    return sum(1 for line in runtime.describe().splitlines() if line.startswith("tree cuda:"))


def assert_all_in_cuda_graphs() -> None:
    seen = dict(counters["cgtrees"])
    assert seen.get("graph_fallbacks", 0) == 0, seen
    assert seen.get("compiled_autograd_graphs", 0) >= 1, seen
    assert seen.get("cudagraph_skips", 0) == 0, seen
    assert trees() == 1, "the backward must run in its forward's tree"


@pytest.mark.parametrize("enable", ["context", "config"])
def test_backward_replays_in_the_forward_tree_and_matches_eager(enable):
    model = mlp()
    ref = copy.deepcopy(model)
    ours, eager = Trainer(model, enable), Trainer(ref, None)
    replays_before = None
    for step in range(10):
        x = torch.randn(16, 32, device=DEV)
        if step == 5:
            replays_before = backward_replays()
        close(ours.backward_step(x), eager.backward_step(x), f"step {step} loss")
        same_training_state(model, ref, f"step {step} gradients")
        ours.update()
        eager.update()
        same_training_state(model, ref, f"step {step} after the update")
    assert_all_in_cuda_graphs()
    assert backward_replays() - replays_before >= 5, "the backward graph must replay every step once recorded"
    assert counters["cgtrees"]["cudagraph_replayed"] >= 10
    # One capture serves every step: a replayed forward hands the backward the parameters it saved
    # themselves, as eager does, not new views of them that compiled autograd would capture anew
    assert counters["cgtrees"]["compiled_autograd_graphs"] == 1, dict(counters["cgtrees"])


@pytest.mark.parametrize("mark_steps", [False, True])
def test_gradients_accumulated_without_zero_grad_survive_generations(mark_steps):
    """R4: three backward calls into the same ``.grad`` (a generation ends at each forward after a
    backward, or at ``cudagraph_mark_step_begin``), then an update; twice over, then once more with
    the recorded graphs replaying. Each ``.grad`` is read after every backward."""
    model = mlp(1)
    ref = copy.deepcopy(model)
    ours, eager = Trainer(model, "context"), Trainer(ref, None)
    kept = []
    for round_ in range(4):
        for micro in range(3):
            if mark_steps:
                torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(16, 32, device=DEV)
            close(ours.backward_step(x), eager.backward_step(x), f"round {round_}.{micro} loss")
            same_training_state(model, ref, f"round {round_}.{micro} accumulated gradients")
            kept.append(model[0].weight.grad)
        for got in kept:  # accumulated in place, as eager does: each holds the last value
            close(got, ref[0].weight.grad, f"round {round_}: a .grad kept across generations")
        kept.clear()
        ours.update()
        eager.update()
        same_training_state(model, ref, f"round {round_} after the update")
    assert_all_in_cuda_graphs()
    assert backward_replays() > 0


def test_tensor_and_post_accumulate_grad_hooks_match_eager():
    """``register_hook`` rescales a gradient before it is accumulated; post-accumulate-grad hooks
    change the accumulated ``.grad`` in place. Both are traced into the backward graph."""
    model = mlp(2)
    ref = copy.deepcopy(model)

    def halve(p: torch.Tensor) -> None:
        p.grad.mul_(0.5)

    for m in (model, ref):
        m[0].weight.register_hook(lambda g: g * 2.0)
        m[3].bias.register_hook(lambda g: g - 0.25)
        for p in (m[2].weight, m[3].weight):
            p.register_post_accumulate_grad_hook(halve)
    ours, eager = Trainer(model, "context"), Trainer(ref, None)
    for step in range(8):
        x = torch.randn(16, 32, device=DEV)
        close(ours.backward_step(x), eager.backward_step(x), f"step {step} loss")
        same_training_state(model, ref, f"step {step} gradients")
        if step % 2:  # every other step accumulates: the hooks see accumulated gradients too
            ours.update()
            eager.update()
    assert_all_in_cuda_graphs()
    assert backward_replays() > 0


def test_optimizer_in_backward_hook_matches_eager():
    """A post-accumulate-grad hook that updates its parameter in place (optimizer in backward):
    the backward graph writes into a static input; the next forward must read the new values."""
    model = mlp(3)
    ref = copy.deepcopy(model)

    def sgd_in_backward(p: torch.Tensor) -> None:
        with torch.no_grad():
            p.add_(p.grad, alpha=-LR)

    for m in (model, ref):
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(sgd_in_backward)
    ours, eager = Trainer(model, "context"), Trainer(ref, None)
    for step in range(8):
        x = torch.randn(16, 32, device=DEV)
        close(ours.backward_step(x), eager.backward_step(x), f"step {step} loss")
        same_training_state(model, ref, f"step {step}")
        for m in (model, ref):
            for p in m.parameters():
                p.grad = None
    assert_all_in_cuda_graphs()
    assert backward_replays() > 0
