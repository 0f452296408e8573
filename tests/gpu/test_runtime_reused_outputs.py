"""A forward's saved activations are handed out as the same tensors on every replay (node.py,
liveness.py): what a program can still reach is never reused, and training stays eager's.

Each test compares values and gradients with eager on a copy of the model, step by step.
"""

from __future__ import annotations

import copy
import re
import weakref

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import cgtrees.runtime as runtime

DEV = "cuda"
pytestmark = pytest.mark.usefixtures("kernel_modules")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 8)).to(DEV)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=max(1e-5 * scale, 1e-6), msg=lambda m: f"{what}: {m}")


def grads_close(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.grad, q.grad, f"{what}: gradient of {name}")


def activations(out: torch.Tensor, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The activations the compiled forward saved for its backward (AOTAutograd's autograd node
    holds them): the saved tensors over memory of neither a parameter nor the input."""
    theirs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x]}
    return [t for t in out.grad_fn.saved_tensors if t.untyped_storage().data_ptr() not in theirs]


def reused_counts() -> list[int]:
    return [int(n) for n in re.findall(r"reused=(\d+)", runtime.describe())]


def pair() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    model = mlp()
    ref = copy.deepcopy(model)
    return (model, ref, torch.optim.SGD(model.parameters(), lr=0.05),
            torch.optim.SGD(ref.parameters(), lr=0.05))


def train_step(loss: torch.Tensor, want: torch.Tensor, pair_: tuple, what: str) -> None:
    """Both backwards, their gradients compared, both optimizers' steps, gradients set to None."""
    model, ref, opt, ref_opt = pair_
    loss.backward()
    want.backward()
    grads_close(model, ref, what)
    opt.step(), ref_opt.step()
    opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)


def test_training_reuses_saved_activations_and_matches_eager():
    """A plain loop: from the second replay on, the forward hands out last step's saved tensors
    (the same objects), and every step's loss and gradients are eager's."""
    trained = model, ref, opt, ref_opt = pair()
    f = torch.compile(model, backend="cgtrees")
    previous: list[weakref.ref] = []
    same = []
    for step in range(10):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        close(out, want, f"step {step} output")
        now = activations(out, model, x)
        same.append(sum(any(t is r() for r in previous) for t in now))
        previous = [weakref.ref(t) for t in now]
        del now
        train_step(out.square().mean(), want.square().mean(), trained, f"step {step}")
    reused = max(reused_counts())
    assert reused >= 2, runtime.describe()  # our partition saves two activations of this MLP
    # steps 0-2: warm-up, recording, first replay (builds the kept tensors); then reused
    assert same[:3] == [0, 0, 0] and min(same[3:]) == reused, same


def test_saved_activations_the_program_keeps_are_invalidated_not_reused():
    """A program that keeps the saved tensors (or only a storage of one) across steps holds live
    outputs: the next step's forward does not hand them out again, and they raise our error
    instead of showing the next step's values."""
    trained = model, ref, opt, ref_opt = pair()
    f = torch.compile(model, backend="cgtrees")
    for step in range(8):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        close(out, want, f"step {step} output")
        if step in (4, 6):
            kept = activations(out, model, x)
            kept_storage = kept[0].untyped_storage()
            assert kept, "the forward saved no activation"
        train_step(out.square().mean(), want.square().mean(), trained, f"step {step}")
        if step in (5, 7):  # kept across the generation that ended in this step's forward
            with pytest.raises(RuntimeError, match=r"cgtrees: this tensor is output"):
                print(kept[0] + 1)
            with pytest.raises(RuntimeError, match=r"cgtrees: this tensor is output"):
                torch.empty(0, device=DEV).set_(kept_storage).sum()
            del kept, kept_storage


def test_two_forwards_before_one_backward():
    """Gradient accumulation over two forwards before one backward: the second forward runs while
    the first one's saved tensors are live (a branch of its own), never over them."""
    trained = model, ref, opt, ref_opt = pair()
    f = torch.compile(model, backend="cgtrees")
    for step in range(8):
        a, b = torch.randn(16, 32, device=DEV), torch.randn(16, 32, device=DEV)
        loss = f(a).square().mean() + f(b).abs().mean()
        want = ref(a).square().mean() + ref(b).abs().mean()
        close(loss, want, f"step {step} loss")
        train_step(loss, want, trained, f"step {step}")
    assert max(reused_counts()) >= 2, runtime.describe()


def test_forward_without_backward_then_training():
    """Forwards whose graphs are dropped without a backward (an evaluation under grad mode, an
    exception) leave idle saved tensors: reusing them is safe, and training goes on as eager."""
    trained = model, ref, opt, ref_opt = pair()
    f = torch.compile(model, backend="cgtrees")
    for step in range(10):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        close(out, want, f"step {step} output")
        if step % 3 == 1:
            continue  # graph dropped with out
        train_step(out.mean(), want.mean(), trained, f"step {step}")


def test_retain_graph_keeps_saved_tensors_right():
    """With ``retain_graph`` the saved tensors stay held after the first backward: the second
    backward reads them unchanged, and the next forward builds new ones."""
    model, ref, _, _ = pair()
    f = torch.compile(model, backend="cgtrees")
    for step in range(6):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        out.sum().backward(retain_graph=True)
        want.sum().backward(retain_graph=True)
        out.square().sum().backward()
        want.square().sum().backward()
        grads_close(model, ref, f"step {step}")
        for m in (model, ref):
            m.zero_grad(set_to_none=True)


def _manager():
    (manager,) = runtime._managers.all()
    return manager


def test_steady_loop_sweeps_live_outputs_at_the_forward_only():
    """A backward right after its forward is not swept (manager.begin_call): the forward's output,
    dropped before the backward, is dead and passed over, so no step after the recordings records
    again. What the backward consumed leaves the live list when it replays, so the list does not
    grow over the steps, and every step's gradients are eager's."""
    trained = model, ref, opt, ref_opt = pair()
    f = torch.compile(model, backend="cgtrees")
    sizes = []
    for step in range(10):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        close(out, want, f"step {step} output")
        loss = out.mean()  # saves no tensor: ``out`` dies below, before the backward
        del out
        train_step(loss, want.mean(), trained, f"step {step}")
        manager = _manager()
        sizes.append(len(manager.live))
        if step >= 2:  # warm-up, recordings, then replays
            consumed = {key for node in manager.alive_nodes() for key in node.consumed}
            assert consumed, runtime.describe()
            left = [e for e in manager.live if e.key in consumed and e.origin.kind == "forward"]
            assert not left, runtime.describe()
    assert counters["cgtrees"]["cudagraph_recorded"] == 2, runtime.describe()
    assert len(set(sizes[3:])) == 1, sizes


def test_repeated_retained_backwards_keep_the_live_list_short():
    """Backwards with ``retain_graph`` one after another (no forward between them) are swept from
    the second on: the live list does not grow with each one, and the gradients they accumulate
    are eager's."""
    model, ref, _, _ = pair()
    f = torch.compile(model, backend="cgtrees")
    for step in range(3):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        sizes = []
        for _ in range(12):
            out.square().sum().backward(retain_graph=True)
            want.square().sum().backward(retain_graph=True)
            sizes.append(len(_manager().live))
        grads_close(model, ref, f"step {step}")
        assert len(set(sizes[3:])) == 1, sizes
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
