"""The CPU module (no interpreter) makes eager's calls (``codegen/eager_ops.py``): ``t(t(w))`` is ``w``,
``addmm(b, x, t(w))`` is ``linear(x, w, b)``, a kept-dimension sum that a ``view`` squeezes is a plain
sum; values and gradients stay eager's, and a graph input is never returned as itself."""

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees.codegen import eager_ops

aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_linear_backward_graph_folds_to_eager_calls():
    def f(x, w, b, g):
        y = aten.addmm(b, x, aten.t(w))
        gw = aten.t(aten.t(aten.mm(aten.t(g), x)))
        gb = aten.view(aten.sum.dim_IntList(g, [0], True), [w.shape[0]])
        return y, gw, gb

    args = (torch.randn(9, 23), torch.randn(13, 23), torch.randn(13), torch.randn(9, 13))
    gm = make_fx(f)(*args)
    folded = eager_ops.fold(gm)
    targets = _targets(folded)
    assert aten.linear.default in targets and aten.addmm.default not in targets
    assert targets.count(aten.t.default) == 1  # t(g), which mm reads: eager's own transpose
    assert aten.view.default not in targets
    for got, want in zip(folded(*args), f(*args)):
        assert got.shape == want.shape and got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _targets(gm).count(aten.t.default) == 4  # the graph handed in is left as it was


def test_input_is_not_returned_as_itself():
    def f(w):
        return aten.t(aten.t(w)), aten.mul(aten.t(aten.t(w)), 2)

    gm = make_fx(f)(torch.randn(5, 7))
    folded = eager_ops.fold(gm)
    out_node = folded.graph.output_node().args[0][0]
    assert out_node.op == "call_function"  # still a view of the input, as AOTAutograd's metadata says
    mul = next(n for n in folded.graph.nodes if n.target is aten.mul.Tensor)
    assert mul.args[0].op == "placeholder"  # where no output is the input, the transposes go


def test_shared_transpose_and_3d_input_stay():
    def f(x3, x, w):
        wt = aten.t(w)
        return aten.mm(x, wt), aten.add(wt, 1), aten.matmul(x3, aten.t(w))

    args = (torch.randn(2, 9, 23), torch.randn(9, 23), torch.randn(23, 23))
    folded = eager_ops.fold(make_fx(f)(*args))
    targets = _targets(folded)
    assert aten.mm.default in targets  # the t(w) that mm reads is read by add too: it stays
    assert targets.count(aten.linear.default) == 1  # matmul's 3-D product, flattened to 2-D by make_fx
    for got, want in zip(folded(*args), f(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compiled_mlp_on_cpu_matches_eager_with_fewer_calls(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(23, 37), torch.nn.GELU(), torch.nn.LayerNorm(37),
                                torch.nn.Linear(37, 5))
    x = torch.randn(9, 23)
    compiled = torch.compile(model, backend="cgtrees", options={"debug_dir": str(tmp_path), "cache": False})
    got = compiled(x)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = model(x)
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5 * p.grad.abs().max().item())
    sources = {path.name.split("_")[1]: path.read_text() for path in tmp_path.glob("g*_*.py")}
    assert sources["forward"].count("aten.linear.default(") == 2 and "aten.addmm" not in sources["forward"]
    assert "aten.t.default(t_" not in sources["backward"]  # no transpose of a transpose


class _Cache(torch.nn.Module):
    def __init__(self, read_old: bool) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 11, 5))
        self.read_old = read_old

    def forward(self, x, pos):
        old = self.cache.sum() if self.read_old else 0  # a second reader of the buffer
        self.cache.index_copy_(1, pos, x)
        return self.cache.sum(1) + old


def test_kv_cache_write_stays_in_place_and_right(tmp_path):
    for read_old in (False, True):
        model, want = _Cache(read_old), _Cache(read_old)
        compiled = torch.compile(model, backend="cgtrees", options={"debug_dir": str(tmp_path / str(read_old)),
                                                                   "cache": False})
        for step in range(3):
            x, pos = torch.randn(2, 1, 5), torch.tensor([step * 3 + 1])
            torch.testing.assert_close(compiled(x, pos), want(x, pos), rtol=0, atol=0)
            torch.testing.assert_close(model.cache, want.cache, rtol=0, atol=0)
        (source,) = [p.read_text() for p in (tmp_path / str(read_old)).glob("g*_inference*.py")]
        if read_old:  # the old value is read: functionalization's copy and write-back stay
            assert "aten.index_copy.default(" in source and "aten.copy_.default(" in source
        else:
            assert "aten.index_copy_.default(" in source and "aten.copy_" not in source


def test_scaled_addmm_stays():
    def f(b, x, w):
        return aten.addmm(b, x, aten.t(w), beta=2, alpha=0.5), aten.addmm(b, x, aten.t(w), alpha=3)

    args = (torch.randn(13), torch.randn(9, 23), torch.randn(13, 23))
    folded = eager_ops.fold(make_fx(f)(*args))
    assert aten.linear.default not in _targets(folded)  # linear has no beta or alpha
    for got, want in zip(folded(*args), f(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
