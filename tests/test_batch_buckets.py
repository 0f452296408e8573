"""Batch buckets (option ``batch_buckets``): an inference graph with a dynamic batch runs at the next
bucket >= B, its inputs padded with copies of row 0 and its outputs cut back to B rows; a graph
where an op mixes the rows of the batch runs at its own sizes, the reason logged (CPU: the aten
graphs, and the generated kernels through Triton's interpreter)."""

from __future__ import annotations

import copy
import logging
from collections import defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from codegen_helpers import INTERPRET, sum_tolerance, trace
from models import MLP, TinyLM

from cgtrees.aot import buckets, driver
from cgtrees.config import Config

BUCKETS = (1, 2, 4, 8, 16)
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="a CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1 (never mixed)")


@pytest.fixture
def sizes_run(monkeypatch):
    """The shapes of the (non-parameter) inputs each aten graph ran at, by graph name (below the
    bucket wrapper)."""
    seen: dict[str, set] = defaultdict(set)
    wrap = driver.Compilers.wrap

    def recording_wrap(self, module, examples, ctx):
        call = wrap(self, module, examples, ctx)

        static = set(ctx.static_input_indices)  # parameters

        def recording(args):
            seen[ctx.name].add(tuple(tuple(a.shape) for i, a in enumerate(args)
                                     if isinstance(a, torch.Tensor) and i not in static))
            return call(args)
        return recording

    monkeypatch.setattr(driver.Compilers, "wrap", recording_wrap)
    return seen


def _bucket(b: int, sizes: tuple[int, ...] = BUCKETS) -> int:
    return next((s for s in sizes if s >= b), b)


def _batches_run(seen: dict[str, set]) -> dict[str, set[int]]:
    return {name: {shapes[0][0] for shapes in runs} for name, runs in seen.items()}


def test_mlp_matches_eager_one_graph_run_per_bucket(cgtrees_counters, sizes_run):
    """Batches 1..9 (automatic dynamic: 1 is traced static, 2 makes the batch symbolic) give eager's
    results; the dynamic graph runs only at buckets, and its real rows are exactly those of the same
    graph run on a batch whose padding rows hold anything else."""
    model = MLP(d=24, hidden=48, out=5).eval()
    f = torch.compile(model, backend="cgtrees", options={"batch_buckets": BUCKETS})
    inputs = [torch.randn(b, 24) for b in range(1, 10)]
    with torch.no_grad():
        outs = [f(x) for x in inputs]
        for x, y in zip(inputs, outs):
            ref = model(x)
            assert y.shape == ref.shape
            torch.testing.assert_close(y, ref, **sum_tolerance(ref, 48))
    runs = _batches_run(sizes_run)
    assert sorted(map(sorted, runs.values())) == [[1], [2, 4, 8, 16]], runs
    assert cgtrees_counters["bucketed_graphs"] == 1 and cgtrees_counters["bucket_shapes"] == 4
    plain = torch.compile(copy.deepcopy(model), backend="cgtrees", dynamic=True)  # the same graph, unpadded
    with torch.no_grad():
        for x, y in zip(inputs[1:], outs[1:]):
            b = x.shape[0]
            other_rows = torch.cat([x, 1e3 * torch.randn(_bucket(b) - b, 24)])
            assert torch.equal(plain(other_rows)[:b], y)


def test_marked_dynamic_batch_counts_one_shape_per_bucket_touched(cgtrees_counters, sizes_run):
    """``mark_dynamic``: one graph for batches 2..9 (1 is specialised by Dynamo), which runs at the
    buckets 2, 4, 8, 16 only: as many shapes as buckets touched."""
    model = MLP(d=24, hidden=48, out=5).eval()
    f = torch.compile(model, backend="cgtrees", options={"batch_buckets": BUCKETS})
    with torch.no_grad():
        for b in range(1, 10):
            x = torch.randn(b, 24)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(f(x), model(x), **sum_tolerance(model(x), 48))
    runs = _batches_run(sizes_run)
    bucketed = [batches for batches in runs.values() if len(batches) > 1]
    assert bucketed == [{2, 4, 8, 16}], runs
    assert cgtrees_counters["bucket_shapes"] == len({_bucket(b) for b in range(2, 10)}) == 4


@needs_interpreter
def test_transformer_block_through_the_interpreter(cgtrees_counters, sizes_run):
    """Generated kernels compiled for a symbolic batch, run at the buckets: softmax close to eager's,
    argmax equal, the outputs views of the padded ones."""
    model = TinyLM().eval()
    f = torch.compile(model, backend="cgtrees", options={"batch_buckets": BUCKETS, "interpret": True})
    with torch.no_grad():
        for b in range(1, 10):
            ids = torch.randint(0, 50, (b, 7))
            torch._dynamo.mark_dynamic(ids, 0)
            (probs, best), (ref_probs, ref_best) = f(ids), model(ids)
            torch.testing.assert_close(probs, ref_probs, **sum_tolerance(ref_probs, 32))
            assert torch.equal(best, ref_best)
            if _bucket(b) != b and b > 1:
                assert probs._base is not None and probs._base.shape[0] == _bucket(b)
    assert cgtrees_counters["bucketed_graphs"] == 1 and cgtrees_counters["kernels_generated"] > 0
    assert [b for b in _batches_run(sizes_run).values() if len(b) > 1] == [{2, 4, 8, 16}]


def test_batch_folded_into_rows_and_cut_along_another_dimension(cgtrees_counters):
    """``view(B*S, D)`` keeps the batch outermost: an output of B*S rows is cut to B*S, and one that
    holds the batch in dimension 1 (a transpose) is cut along dimension 1."""
    w = torch.randn(6, 5)

    def f(x):
        y = (x.reshape(-1, 6) @ w).relu()
        return y, y.view(x.shape[0], -1).t()

    g = torch.compile(f, backend="cgtrees", options={"batch_buckets": (4, 8)})
    for b in (3, 5, 6):
        x = torch.randn(b, 3, 6)
        torch._dynamo.mark_dynamic(x, 0)
        (flat, cols), (ref_flat, ref_cols) = g(x), f(x)
        assert flat.shape == (3 * b, 5) and cols.shape == (15, b)
        torch.testing.assert_close(flat, ref_flat)
        torch.testing.assert_close(cols, ref_cols)
    assert cgtrees_counters["bucketed_graphs"] == 1 and cgtrees_counters["bucket_shapes"] == 2


def test_past_the_largest_bucket_runs_unpadded_logged_once(cgtrees_counters, caplog):
    model = MLP(d=8, hidden=16, out=3).eval()
    f = torch.compile(model, backend="cgtrees", options={"batch_buckets": (2, 4)})
    with caplog.at_level(logging.WARNING, logger="cgtrees"), torch.no_grad():
        for b in (3, 5, 6, 7):
            x = torch.randn(b, 8)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(f(x), model(x))
    past = [r for r in caplog.records if "past the largest batch bucket" in r.getMessage()]
    assert len(past) == 1 and "batch size 5" in past[0].getMessage()
    assert cgtrees_counters["bucket_shapes"] == 4  # 4, then 5, 6 and 7 each at its own size


class BatchNormTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(x) + 1


MIXING = {
    "sum over the batch": (lambda x: x.sum(0) + x, "reduces over the batch dimension"),
    "mean of everything": (lambda x: x.mean() * x, "reduces over the batch dimension"),
    # the graph as decomposed for codegen (Triton's interpreter), or as eager runs it (aten on CPU)
    "softmax over the batch": (lambda x: x.softmax(0), ("reduces over the batch dimension",
                                                        "_softmax) runs along the batch dimension")),
    "batch norm in training": (BatchNormTrain().train(), ("var_mean", "aten._native_batch_norm_legit_functional"
                                                          ".default is not known to keep the rows of a batch apart")),
    "batch size as a value": (lambda x: x * x.shape[0], "uses the batch size as a value"),
    "last row": (lambda x: x[-1] * x, "selects rows of the batch"),
    "unknown op": (lambda x: x.flip(0) + 1, "aten.flip.default is not known to keep the rows of a batch apart"),
}


@pytest.mark.parametrize("case", list(MIXING))
def test_graph_that_mixes_rows_runs_unbucketed_with_the_reason(case, cgtrees_counters, caplog):
    fn, reason = MIXING[case]
    eager = copy.deepcopy(fn) if isinstance(fn, nn.Module) else fn
    f = torch.compile(fn, backend="cgtrees", options={"batch_buckets": (4, 8)})
    with caplog.at_level(logging.WARNING, logger="cgtrees"), torch.no_grad():
        for b in (3, 5):
            x = torch.randn(b, 6)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(f(x), eager(x))
    if isinstance(fn, nn.Module):  # the running statistics too
        torch.testing.assert_close(fn.bn.running_mean, eager.bn.running_mean)
    assert cgtrees_counters["bucketed_graphs"] == 0 and cgtrees_counters["bucket_shapes"] == 0
    told = [r.getMessage() for r in caplog.records if "runs without batch buckets" in r.getMessage()]
    reasons = reason if isinstance(reason, tuple) else (reason,)
    assert len(told) == 1 and any(r in told[0] for r in reasons), told


def test_training_graph_is_left_alone(cgtrees_counters, caplog):
    model = MLP(d=8, hidden=16, out=3)
    reference = copy.deepcopy(model)
    f = torch.compile(model, backend="cgtrees", options={"batch_buckets": (4, 8)})
    with caplog.at_level(logging.INFO, logger="cgtrees"):
        for b in (3, 5):
            x = torch.randn(b, 8)
            torch._dynamo.mark_dynamic(x, 0)
            f(x).square().sum().backward()
            reference(x).square().sum().backward()
    torch.testing.assert_close(model.fc1.weight.grad, reference.fc1.weight.grad)
    assert cgtrees_counters["bucketed_graphs"] == 0
    assert "is a training graph: batch_buckets applies to inference graphs" in caplog.text


# ---- the analysis alone, on traced aten graphs ----------------------------------------------------

def _w() -> torch.Tensor:
    """A batch-free weight, made inside the traced function (make_fx takes no outside tensor)."""
    return torch.linspace(-1, 1, 36).view(6, 6)


def _plan(fn, name):
    """The plan of ``fn`` traced with symbolic sizes for an input of 4 x 6."""
    return buckets.plan(trace(fn, torch.randn(4, 6), dynamic=True), (4, 8), name, output_kinds=None)


KEEPS_ROWS_APART = {
    "pointwise and broadcast": lambda x: (x * _w()[0]).relu() + 1,
    "layer norm, softmax, argmax over features": lambda x: F.layer_norm(x, (6,)).softmax(-1).argmax(-1),
    "linear over flattened rows": lambda x: (x.reshape(-1, 1) @ _w()[:1]).view(x.shape[0], -1).sum(1),
    "cumsum and sort over features": lambda x: x.cumsum(1).sort(-1).values,
    "batch-free table lookup": lambda x: F.embedding((x > 0).long(), _w()).mean(-1),
}
MIXES_ROWS = {
    "gram matrix": (lambda x: x.t() @ x, "multiplies two matrices that both hold the batch"),
    "cumsum over the batch": (lambda x: x.cumsum(0), "runs along the batch dimension"),
    "concatenated along the batch": (lambda x: torch.cat([x, x]) * 2, "concatenates along the batch"),
    "batch moved inside": (lambda x: x.t().reshape(-1) * 2, "reshapes the batch dimension inside another"),
    "features cut by the batch size": (lambda x: x[:, : x.shape[0]] * 2, "slices another dimension"),
}


@pytest.mark.parametrize("case", list(KEEPS_ROWS_APART))
def test_analysis_allows(case):
    p = _plan(KEEPS_ROWS_APART[case], f"allows {case}")
    assert p is not None and p.pad == ((0, 0),) and p.cut[0][:2] == (0, 0)


@pytest.mark.parametrize("case", list(MIXES_ROWS))
def test_analysis_refuses(case, caplog):
    fn, reason = MIXES_ROWS[case]
    with caplog.at_level(logging.WARNING, logger="cgtrees"):
        assert _plan(fn, f"refuses {case}") is None
    assert reason in caplog.text


def test_padding_rows_are_copies_of_row_zero():
    x = torch.arange(6.0).view(3, 2)
    rows = buckets.padded_rows(3, 5, x.device)
    assert torch.equal(x.index_select(0, rows), torch.tensor([[0.0, 1], [2, 3], [4, 5], [0, 1], [0, 1]]))


# ---- the option ------------------------------------------------------------------------------------

def test_option_and_variable():
    assert Config.resolve(environ={}).batch_buckets == ()  # off
    assert Config.resolve(options={"batch_buckets": [8, 1, 4, 2, 4]}, environ={}).batch_buckets == (1, 2, 4, 8)
    assert Config.resolve(environ={"CGTREES_BATCH_BUCKETS": "1, 2,4,8"}).batch_buckets == (1, 2, 4, 8)
    env = {"CGTREES_BATCH_BUCKETS": "1,2"}
    assert Config.resolve(options={"batch_buckets": (16,)}, environ=env).batch_buckets == (16,)  # options win
    assert ("batch_buckets", (1, 2)) not in Config.resolve(environ=env).codegen_key()  # same generated code


@pytest.mark.parametrize("bad", ["1,x", "0,4", (2.5,), 8, [True], "-1"])
def test_bad_buckets_say_what_is_expected(bad):
    expected = (r"batch_buckets=.* is not valid; expected positive batch sizes: .*; fix: "
                r"options=\{'batch_buckets': \(1, 2, 4, 8\)\} or CGTREES_BATCH_BUCKETS=1,2,4,8")
    with pytest.raises(ValueError, match=expected):
        Config.resolve(options={"batch_buckets": bad}, environ={})
    with pytest.raises(ValueError, match="env CGTREES_BATCH_BUCKETS: batch_buckets='4,a'"):
        Config.resolve(environ={"CGTREES_BATCH_BUCKETS": "4,a"})
