"""Hazards of real training and serving loops, one named test each (issue 17): an exception in the
middle of a step, outputs fed back as inputs (an RNN loop, a KV cache written in place), two models
interleaved, ``retain_graph``, ``torch.autograd.grad``, ``torch.inference_mode`` and a long soak.

Every value is compared with eager on a copy of the model; gradients too.
"""

from __future__ import annotations

import copy
import random
import re

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import cgtrees.runtime as runtime

DEV = "cuda"
pytestmark = pytest.mark.usefixtures("kernel_modules")


def cg(fn, **kw):
    return torch.compile(fn, backend="cgtrees", **kw)


def mlp(seed: int = 0, width: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, 8)).to(DEV)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Within float32 reassociation error, scaled with the tensor's own largest entry."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=max(1e-5 * scale, 1e-6), msg=lambda m: f"{what}: {m}")


def grads_close(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {name}"
        if q.grad is not None:
            close(p.grad, q.grad, f"{what}: gradient of {name}")


def test_exception_mid_step_then_training_goes_on():
    """A step that raises between forward and backward (a bad batch, a user assertion) leaves
    the trees usable: the next steps replay or re-record and give eager's values and gradients."""
    model, ref = mlp(), mlp()
    f = cg(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(8):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        close(out, want, f"step {step} output")
        if step in (3, 5):
            try:
                raise ValueError("the user's own check failed")
            except ValueError:
                pass  # the forward's graph and its outputs are abandoned: no backward this step
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            continue
        out.square().mean().backward()
        want.square().mean().backward()
        grads_close(model, ref, f"step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)


def test_exception_inside_compiled_function_then_goes_on():
    """An exception raised inside the compiled region (here a shape error on a bad input) reaches
    the user as eager's error, and the next good calls are right."""
    model = mlp()
    f = cg(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 32, device=DEV)
            close(f(x), model(x))
        with pytest.raises(RuntimeError):
            f(torch.randn(16, 31, device=DEV))
        for _ in range(3):
            x = torch.randn(16, 32, device=DEV)
            close(f(x), model(x))


def test_rnn_loop_feeds_outputs_back():
    """The hidden state a call returns is the next call's input (a pool tensor as input): every
    step equals eager, in inference and in training through the whole unrolled loop."""
    torch.manual_seed(0)
    cell = nn.RNNCell(16, 32).to(DEV)
    ref = copy.deepcopy(cell)
    f = cg(cell)
    xs = torch.randn(12, 4, 16, device=DEV)
    with torch.no_grad():
        h, h_ref = torch.zeros(4, 32, device=DEV), torch.zeros(4, 32, device=DEV)
        for t in range(12):
            h, h_ref = f(xs[t], h), ref(xs[t], h_ref)
            close(h, h_ref, f"inference step {t}")
    for rep in range(3):
        h, h_ref = torch.zeros(4, 32, device=DEV), torch.zeros(4, 32, device=DEV)
        for t in range(6):
            h, h_ref = f(xs[t], h), ref(xs[t], h_ref)
        close(h, h_ref, f"training rep {rep}")
        h.square().sum().backward()
        h_ref.square().sum().backward()
        grads_close(cell, ref, f"training rep {rep}")
        cell.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_kv_cache_written_in_place():
    """A decode loop that writes each step's key into a preallocated cache (index_copy_ on an
    input) and attends over it: the cache and every output equal eager's."""
    torch.manual_seed(0)
    proj = nn.Linear(16, 16).to(DEV)

    def step(x, cache, pos):
        k = proj(x)
        cache.index_copy_(1, pos, k.unsqueeze(1))
        scores = torch.einsum("bd,btd->bt", k, cache)
        return scores.softmax(-1)

    f = cg(step)
    cache, ref_cache = torch.zeros(2, 10, 16, device=DEV), torch.zeros(2, 10, 16, device=DEV)
    with torch.no_grad():
        for t in range(10):
            x = torch.randn(2, 16, device=DEV)
            pos = torch.tensor([t], device=DEV)
            out, want = f(x, cache, pos), step(x, ref_cache, pos)
            close(out, want, f"decode step {t}")
            close(cache, ref_cache, f"cache after step {t}")


def test_two_models_interleaved_forwards_and_backwards():
    """Forward A, forward B, backward A, backward B (and the other orders): both models' gradients
    equal eager's every step."""
    a, b = mlp(0), mlp(1, width=48)
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)
    fa, fb = cg(a), cg(b)
    orders = [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a"), ("a", "b"), ("a", "b")]
    for step, (first, second) in enumerate(orders):
        x = torch.randn(8, 32, device=DEV)
        outs = {"a": fa(x), "b": fb(x)}
        refs = {"a": ra(x), "b": rb(x)}
        for name in (first, second):
            close(outs[name], refs[name], f"step {step} {name}")
            outs[name].square().mean().backward()
            refs[name].square().mean().backward()
        grads_close(a, ra, f"step {step} a")
        grads_close(b, rb, f"step {step} b")
        for m in (a, b, ra, rb):
            m.zero_grad(set_to_none=True)


def test_backward_twice_with_retain_graph():
    """``backward(retain_graph=True)`` then a second backward: gradients accumulate as in eager."""
    model = mlp()
    ref = copy.deepcopy(model)
    f = cg(model)
    for step in range(5):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        loss, ref_loss = out.square().mean(), want.square().mean()
        loss.backward(retain_graph=True)
        ref_loss.backward(retain_graph=True)
        (2 * loss).backward()
        (2 * ref_loss).backward()
        grads_close(model, ref, f"step {step}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_retain_graph_after_plain_backwards():
    """Plain backwards first (their graph may reuse the memory of the activations it reads: nothing
    reads them again), then ``backward(retain_graph=True)`` and a second backward: the second reads
    what the first left, as in eager, so the first must not run the graph that reuses it.
    AOTAutograd's own donated buffers forbid this order (its error names the setting to turn off)."""
    model = mlp()
    ref = copy.deepcopy(model)
    f = cg(model)
    with torch._functorch.config.patch(donated_buffer=False):
        _plain_then_retained(f, model, ref)


def _plain_then_retained(f, model, ref):
    for step in range(7):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), ref(x)
        loss, ref_loss = out.square().mean(), want.square().mean()
        if step < 4:
            loss.backward()
            ref_loss.backward()
        else:
            loss.backward(retain_graph=True)
            ref_loss.backward(retain_graph=True)
            (2 * loss).backward()
            (2 * ref_loss).backward()
        grads_close(model, ref, f"step {step}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_output_the_backward_reads_and_the_user_keeps():
    """The model's output is what its backward reads (tanh's gradient is 1 - y**2); a user who
    keeps it across ``backward()`` finds it unchanged, on steps where others dropped it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh()).to(DEV)
    ref = copy.deepcopy(model)
    f = cg(model)
    for step in range(8):
        x = torch.randn(16, 32, device=DEV)
        if step % 3 == 2:
            y, want = f(x), ref(x)
            y.sum().backward()
            want.sum().backward()
            close(y, want, f"step {step}: the kept output after backward")
        else:
            f(x).sum().backward()
            ref(x).sum().backward()
        grads_close(model, ref, f"step {step}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("how", ["saved_tensors", "pack_hook"])
def test_saved_activations_the_user_keeps_through_backward(how):
    """A program that keeps the activations a forward saved (``grad_fn.saved_tensors``, or a
    saved-tensors hook that keeps what it packs) holds the same tensors autograd gives the
    backward: after ``backward()`` they still hold the forward's values, as in eager, on steps
    after others where nothing kept them (whose backward reused their memory)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 8)).to(DEV)  # deep enough that its backward reuses what it consumed
    ref = copy.deepcopy(model)
    f = cg(model)
    for step in range(8):
        x = torch.randn(16, 32, device=DEV)
        keep = step in (4, 6, 7)
        kept: list[torch.Tensor] = []
        if keep and how == "pack_hook":
            with torch.autograd.graph.saved_tensors_hooks(lambda t, store=kept: store.append(t) or t, lambda t: t):
                out = f(x)
        else:
            out = f(x)
        if keep and how == "saved_tensors":
            kept = list(out.grad_fn.saved_tensors)
        before = [t.clone() for t in kept]
        out.square().mean().backward()
        ref(x).square().mean().backward()
        if keep:
            assert kept, "the forward saved nothing"
            for k, (t, b) in enumerate(zip(kept, before)):
                close(t, b, f"step {step}: kept saved tensor {k} after backward")
        grads_close(model, ref, f"step {step}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        del before, out
        kept.clear()
    assert re.search(r"g\d+_backward parent=.* consumed=[1-9]", runtime.describe()), runtime.describe()


def test_failed_backward_capture_reruns_on_the_activations_it_freed(monkeypatch):
    """A backward's capture that fails after it freed the activations handed to it: the step still
    gets eager's gradients (the graph runs eagerly on their memory, which nothing reused), and so
    do the next steps, without CUDA graphs for that backward."""
    import cgtrees.runtime.node as node_mod

    real = node_mod.GraphNode._capture

    def failing(self, call, args):
        if self.kind != "backward":
            return real(self, call, args)

        def free_then_fail(capture_args):
            capture_args.clear()  # what the capture held alone dies here
            raise RuntimeError("injected capture failure")

        return real(self, free_then_fail, args)

    monkeypatch.setattr(node_mod.GraphNode, "_capture", failing)
    model = mlp()
    ref = copy.deepcopy(model)
    f = cg(model)
    for step in range(4):
        x = torch.randn(16, 32, device=DEV)
        f(x).square().mean().backward()
        ref(x).square().mean().backward()
        grads_close(model, ref, f"step {step}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert counters["cgtrees"]["cudagraph_skips"] >= 1


def test_autograd_grad():
    """``torch.autograd.grad`` with respect to the input and the parameters (no ``.grad``
    written), and with ``create_graph=False``: eager's values."""
    model = mlp()
    ref = copy.deepcopy(model)
    f = cg(model)
    for step in range(5):
        x = torch.randn(16, 32, device=DEV, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, want = f(x), ref(x_ref)
        got = torch.autograd.grad(out.square().mean(), [x, *model.parameters()])
        exp = torch.autograd.grad(want.square().mean(), [x_ref, *ref.parameters()])
        for i, (g, e) in enumerate(zip(got, exp)):
            close(g, e, f"step {step} grad {i}")
        assert all(p.grad is None for p in model.parameters())


def test_inference_mode_calls():
    """Calls under ``torch.inference_mode()`` (and then training again): eager's values."""
    model = mlp()
    f = cg(model)
    with torch.inference_mode():
        for _ in range(5):
            x = torch.randn(16, 32, device=DEV)
            close(f(x), model(x), "inference_mode")
    for _ in range(3):
        x = torch.randn(16, 32, device=DEV)
        out, want = f(x), model(x)
        close(out, want, "after inference_mode")
        out.sum().backward()


def test_soak_2000_replays_changing_kept_outputs():
    """2000 calls keeping a changing subset of outputs (a random window of recent ones): every
    kept output stays right, recordings stay bounded, and memory does not grow."""
    model = mlp()
    f = cg(model)
    rng = random.Random(0)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for i in range(2000):
            if i == 200:
                torch.cuda.synchronize()
                baseline = torch.cuda.memory_allocated()
                recorded = counters["cgtrees"]["cudagraph_recorded"]
            x = torch.randn(8, 32, device=DEV)
            out = f(x)
            if rng.random() < 0.3:
                kept.append((out, model(x)))
            if len(kept) > 4 or (kept and rng.random() < 0.2):
                kept.pop(rng.randrange(len(kept)))
            for got, want in kept:
                close(got, want, f"call {i}")
    torch.cuda.synchronize()
    kept.clear()
    grown = torch.cuda.memory_allocated() - baseline
    assert grown <= 1 << 20, f"memory grew by {grown} bytes over 1800 calls"
    total = counters["cgtrees"]["cudagraph_recorded"]
    print(f"soak: {total} recordings, {total - recorded} after call 200, memory grew {grown} bytes")
    assert total <= 21, f"{total} recordings: more than one shape's node limit (2 x (4 + 4 + 2)) + 1"
    assert total - recorded <= 1, f"{total - recorded} recordings after call 200"
