"""Outputs alias as in eager (issue 17): outputs that are views of one another share one storage,
outputs that are views of an input share the input's storage, after replays and once outputs are
copied out of the pool (``max_live_branches_per_function`` reached)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cgtrees.runtime as runtime

DEV = "cuda"
pytestmark = pytest.mark.usefixtures("kernel_modules")
GRAD = pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
MODE = pytest.mark.parametrize("mode", ["pool", "copy_out"])


def cg(fn, mode: str):
    # copy_out: the first branch forced by a kept output switches the function to copy-out
    options = {"max_live_branches_per_function": 1} if mode == "copy_out" else {}
    return torch.compile(fn, backend="cgtrees", options=options)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_mode(mode: str) -> None:
    text = runtime.describe()
    assert ("copy-out" in text) == (mode == "copy_out"), text


@GRAD
@MODE
def test_outputs_alias_each_other(grad, mode):
    """``return y, y, y[3:]``: one tensor twice and a view of it, like eager's."""

    def fn(x):
        y = x * 2
        return y, y, y[3:]

    f = cg(fn, mode)
    kept = []
    for _ in range(6):
        x = torch.randn(8, 4, device=DEV, requires_grad=grad)
        a, b, c = f(x)
        if mode == "copy_out":
            kept.append((a, b, c))  # kept alive: forces the branch that switches to copy-out
        assert b is a or (same_storage(a, b) and a.data_ptr() == b.data_ptr()), runtime.describe()
        assert same_storage(a, c), runtime.describe()
        assert c.data_ptr() == a.data_ptr() + 3 * 4 * a.element_size()
        with torch.no_grad():
            a.add_(1)  # a write through one shows in the others
        expected = x.detach() * 2 + 1
        torch.testing.assert_close(b.detach(), expected)
        torch.testing.assert_close(c.detach(), expected[3:])
    for a, b, c in kept:  # what the user kept stays right and aliased
        assert b is a or same_storage(a, b)
        torch.testing.assert_close(c, a[3:])
    _check_mode(mode)


@MODE
def test_outputs_alias_each_other_after_replays_no_kept(mode):
    """Outputs die between calls (the replay path, not recordings) and still alias each other."""

    def fn(x):
        y = x.sin()
        return y.t(), y.view(-1), y

    f = cg(fn, mode)
    kept = None
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(6, 5, device=DEV)
            t, flat, y = f(x)
            if mode == "copy_out":
                kept = (t, flat, y, kept)  # the first kept one forces copy-out
            assert same_storage(t, y) and same_storage(flat, y), runtime.describe()
            y.mul_(0)
            assert t.abs().sum().item() == 0 and flat.abs().sum().item() == 0
    _check_mode(mode)


@GRAD
@MODE
def test_outputs_alias_their_input(grad, mode):
    """Views of an input share the input's storage (an input with a storage offset, copied into a
    slot for the graph), and a write through the input shows in them."""

    def fn(x):
        return x.view(-1), x[2:], x.t(), x * 2

    f = cg(fn, mode)
    kept = []
    for _ in range(6):
        base = torch.randn(10, 4, device=DEV)
        x = base[1:9]
        if grad:
            x = x.clone().requires_grad_()
        flat, tail, t, doubled = f(x)
        if mode == "copy_out":
            kept.append(doubled)
        for out in (flat, tail, t):
            assert same_storage(out, x), runtime.describe()
        assert tail.data_ptr() == x.data_ptr() + 8 * x.element_size()
        with torch.no_grad():
            x.add_(1)
        torch.testing.assert_close(flat.detach(), x.detach().reshape(-1))
        torch.testing.assert_close(tail.detach(), x.detach()[2:])
        torch.testing.assert_close(t.detach(), x.detach().t())
    _check_mode(mode)


def test_output_aliases_pool_input():
    """An input that is another graph's pool output is read in place; views of it alias it."""
    fa = torch.compile(lambda x: x * 2, backend="cgtrees")
    fb = torch.compile(lambda y: (y.view(-1), y[1:], y + 1), backend="cgtrees")
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 4, device=DEV)
            y = fa(x)
            flat, tail, z = fb(y)
            assert same_storage(flat, y) and same_storage(tail, y), runtime.describe()
            y.add_(1)
            torch.testing.assert_close(flat, (x * 2 + 1).view(-1))
            torch.testing.assert_close(tail, (x * 2 + 1)[1:])
            torch.testing.assert_close(z, x * 2 + 1)


def test_output_aliases_parameter():
    """A view of a parameter (a static input, read in place) shares the parameter's storage."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return self.w.t(), x @ self.w

    torch.manual_seed(0)
    model = M().to(DEV)
    f = torch.compile(model, backend="cgtrees")
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 4, device=DEV)
            wt, out = f(x)
            assert same_storage(wt, model.w), runtime.describe()
            torch.testing.assert_close(out, x @ model.w)
            model.w.add_(1)
            torch.testing.assert_close(wt, model.w.t())
