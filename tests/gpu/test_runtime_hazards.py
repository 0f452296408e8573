"""Every CUDA graph replay hazard we know of, one named test each (runtime rules R1-R8)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import cgtrees.runtime as runtime

DEV = "cuda"
pytestmark = pytest.mark.usefixtures("kernel_modules")


def cg(fn, **kw):
    return torch.compile(fn, backend="cgtrees", **kw)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to(DEV)


def stat(key: str) -> int:
    return counters["cgtrees"][key]


def test_simple_replay_correct():
    model = mlp()
    f = cg(model)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(16, 32, device=DEV)
            torch.testing.assert_close(f(x), model(x))
    assert stat("cudagraph_warmup") == 1
    assert stat("cudagraph_recorded") == 1
    assert stat("cudagraph_replayed") == 4
    assert stat("cudagraph_skips") == 0


def test_static_inputs_not_copied():
    model = mlp()
    f = cg(model)
    x = torch.randn(16, 32, device=DEV)
    with torch.no_grad():
        for _ in range(3):
            f(x)
        text = runtime.describe()
        assert "inputs copied=1 checked=6" in text, text  # parameters are read in place
        ptr = model[0].weight.data_ptr()
        model[0].weight.mul_(2)  # same address, new values: the replay sees them
        assert model[0].weight.data_ptr() == ptr
        torch.testing.assert_close(f(x), model(x))


def test_inputs_of_mixed_dtypes_are_copied_each_replay():
    """A decode step's per-token inputs (ids and positions int64, a boolean mask, a float row): each
    replay copies all of them into the graph's slots, one multi-tensor copy per dtype."""

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(50, 8, device=DEV))  # static: read in place

        def forward(self, ids, pos, keep, scale):
            rows = self.table[ids] * scale + pos.unsqueeze(-1).float()
            return rows.masked_fill(~keep.unsqueeze(-1), 0.0).sum(1)

    model = Step()
    f = cg(model)
    with torch.no_grad():
        for i in range(6):
            ids = torch.randint(0, 50, (2, 3), device=DEV)
            pos = torch.arange(3, device=DEV).expand(2, 3) + i
            keep = torch.rand(2, 3, device=DEV) > 0.3
            scale = torch.full((2, 3, 1), float(i + 1), device=DEV)
            torch.testing.assert_close(f(ids, pos, keep, scale), model(ids, pos, keep, scale))
    assert "inputs copied=4 checked=1" in runtime.describe(), runtime.describe()
    assert stat("cudagraph_replayed") == 4 and stat("cudagraph_recorded") == 1


def test_forward_backward_one_pool():
    model, ref = mlp(), mlp()
    f = cg(model)
    for _ in range(4):
        x = torch.randn(16, 32, device=DEV)
        f(x).square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None
    managers = runtime._managers.all()
    assert len(managers) == 1, runtime.describe()  # the backward ran in its forward's tree
    kinds = {node.kind for node in managers[0].alive_nodes()}
    assert kinds == {"forward", "backward"}, runtime.describe()
    assert stat("cudagraph_replayed") >= 2


def test_gradient_accumulation_matches_eager():
    model, ref = mlp(), mlp()
    f = cg(model)
    for _ in range(2):  # warmup and recording
        x = torch.randn(16, 32, device=DEV)
        f(x).square().mean().backward()
        ref(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    for _ in range(4):  # replays: the first .grad is a pool output; it must survive generations (R4)
        x = torch.randn(16, 32, device=DEV)
        f(x).square().mean().backward()
        ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert stat("cudagraph_replayed") >= 6


def test_overwritten_output_raises_with_remedy():
    model = mlp()
    f = cg(model)
    x = torch.randn(16, 32, device=DEV)
    with torch.no_grad():
        f(x), f(x)
        y = f(x)
        torch.compiler.cudagraph_mark_step_begin()
        f(x)
    # R1 names the function and the op behind the output, with generated modules too
    with pytest.raises(RuntimeError, match=r"(?s)g\d+_inference.*produced by aten\.\w+\.\w+.*[Cc]lone"):
        print(y + 1)


def test_live_output_forces_new_branch():
    model = mlp()
    f = cg(model)
    a, b = torch.randn(16, 32, device=DEV), torch.randn(16, 32, device=DEV)
    with torch.no_grad():
        f(a), f(a)
        ya = f(a)  # kept alive while the next call runs
        yb = f(b)
        torch.testing.assert_close(ya, model(a))
        torch.testing.assert_close(yb, model(b))
    assert stat("cudagraph_recorded") == 2  # a second node, recorded around ya


def test_kept_outputs_stay_right_and_bounded():
    model = mlp()
    f = cg(model, options={"max_live_branches_per_function": 3})
    xs = [torch.randn(16, 32, device=DEV) for _ in range(20)]
    with torch.no_grad():
        kept = [f(x) for x in xs]
        for x, y in zip(xs, kept):
            torch.testing.assert_close(y, model(x))
    assert stat("cudagraph_recorded") <= 8, runtime.describe()


def test_loop_variable_keeps_last_output_alive():
    """``y = f(x)`` in a loop: the previous y is alive during each call; replays must settle."""
    model = mlp()
    f = cg(model)
    y = None
    with torch.no_grad():
        for _ in range(16):
            x = torch.randn(16, 32, device=DEV)
            y = f(x)
            torch.testing.assert_close(y, model(x))
    assert stat("cudagraph_recorded") <= 6, runtime.describe()
    assert stat("cudagraph_replayed") >= 8, runtime.describe()


def test_mutated_nonstatic_input():
    def fn(x):
        x.add_(1)
        return x * 2

    f = cg(fn)
    x, ref = torch.zeros(8, device=DEV), torch.zeros(8, device=DEV)
    with torch.no_grad():
        for _ in range(5):
            torch.testing.assert_close(f(x), fn(ref))
            torch.testing.assert_close(x, ref)


def test_dynamic_shapes_rerecord_limit(caplog):
    def fn(x, w):
        return (x * w).sin().sum(dim=1)

    f = cg(fn, dynamic=True, options={"max_shapes_per_function": 2})
    w = torch.randn(32, device=DEV)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="cgtrees"):
        for n in (2, 3, 4, 5, 6):
            for _ in range(3):
                x = torch.randn(n, 32, device=DEV)
                torch._dynamo.mark_dynamic(x, 0)
                torch.testing.assert_close(f(x, w), fn(x, w))
    assert stat("cudagraph_recorded") == 2, runtime.describe()
    assert stat("cudagraph_skips") == 1, runtime.describe()
    assert "dimension 0" in caplog.text, caplog.text


def test_dropout_fresh_every_replay():
    f = cg(lambda x: F.dropout(x, 0.5, training=True))
    x = torch.ones(4096, device=DEV)
    with torch.no_grad():
        outs = [f(x).clone() for _ in range(5)]
    assert stat("cudagraph_replayed") >= 2
    for a, b in zip(outs[2:], outs[3:]):
        assert not torch.equal(a, b)
    assert all(0.3 < (o == 0).float().mean().item() < 0.7 for o in outs)


def test_constant_and_aliased_outputs():
    def fn(x):
        y = x * 3
        return y, y.view(-1), torch.ones(3, device=x.device), x.view(-1)

    f = cg(fn)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 4, device=DEV)
            y, flat, ones, xflat = f(x)
            torch.testing.assert_close(y, x * 3)
            torch.testing.assert_close(ones, torch.ones(3, device=DEV))
            assert flat.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
            assert xflat.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            y.add_(1)
            torch.testing.assert_close(flat, (x * 3 + 1).view(-1))


def test_expanded_stride0_inputs():
    def fn(x, w):
        return (x * w).sum(dim=0)

    f = cg(fn)
    w = torch.randn(4, 8, device=DEV)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(1, 8, device=DEV).expand(4, 8)
            torch.testing.assert_close(f(x, w), fn(x, w))


def test_siblings_share_memory():
    """A->B and A->B' are siblings; B' records after replays (checkpoint restored), memory max not sum."""
    n = 1 << 20
    fa = cg(lambda x: x * 2)
    fb = cg(lambda y: (y.sin() * y.cos()).sum())
    fc = cg(lambda y: (y.exp() + y.tanh()).sum())
    x = torch.randn(n, device=DEV)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fb(fa(x)), (x * 2).sin().mul((x * 2).cos()).sum())
        pool_after_b = runtime._managers.all()[0].pool_bytes()
        for _ in range(3):
            torch.testing.assert_close(fc(fa(x)), ((x * 2).exp() + (x * 2).tanh()).sum())
        pool_after_c = runtime._managers.all()[0].pool_bytes()
        for _ in range(2):
            torch.testing.assert_close(fb(fa(x)), (x * 2).sin().mul((x * 2).cos()).sum())
    assert pool_after_c <= pool_after_b + (n * 4), runtime.describe()


def test_tensor_dies_between_checkpoint_and_replay():
    fa = cg(lambda x: (x + 1, x * 2))
    fb = cg(lambda y: y.sum(dim=0))
    fc = cg(lambda y: y.mean(dim=0))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(64, 64, device=DEV)
            p, q = fa(x)
            fb(q)
        for _ in range(4):
            x = torch.randn(64, 64, device=DEV)
            p, q = fa(x)  # replayed: its checkpoint has p and q
            del p  # dies before the next recording restores that checkpoint
            torch.testing.assert_close(fc(q), (x * 2).mean(dim=0))
            torch.testing.assert_close(q, x * 2)
    assert stat("cudagraph_replayed") >= 4


def test_uncapturable_op_skipped():
    f = cg(lambda x: x[x > 0].sum())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(100, device=DEV)
            torch.testing.assert_close(f(x), x[x > 0].sum())


def test_uncapturable_op_explained_before_capture():
    """R7 sees the ops of every kernel module (a generated one keeps no graph, only its listing)."""

    def fn(x):
        return torch.histc(x * 2, bins=4, min=-3, max=3) + 1

    f = cg(fn)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(100, device=DEV)
            torch.testing.assert_close(f(x), fn(x))
    text = runtime.describe()
    assert "aten.histc.default cannot be captured" in text, text
    assert stat("cudagraph_skips") == 1, text
    assert stat("cudagraph_recorded") == 0, text


def test_capture_failure_runs_eagerly_and_leaves_rng_working():
    from cgtrees.config import Config
    from cgtrees.context import GraphContext

    def call(args):
        x = args[0]
        args.clear()
        y = x * 2
        torch.cuda.current_stream().synchronize()  # not allowed while capturing
        return [y]

    x = torch.randn(8, device=DEV)
    from types import SimpleNamespace

    from cgtrees.compiled import AtenGraph, GraphFacts
    from cgtrees.runtime.examples import Examples

    ctx = GraphContext(config=Config.resolve(), kind="inference", name="sync_inside")
    fn = runtime.wrap(SimpleNamespace(call=call, graph=AtenGraph(GraphFacts(), 1)), Examples.of([x]), ctx)
    for _ in range(3):
        torch.testing.assert_close(fn([x])[0], x * 2)
    assert stat("cudagraph_skips") == 1
    assert "capture failed" in runtime.describe()
    torch.randn(4, device=DEV)  # the default generator is not left capturing
