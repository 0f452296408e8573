"""Column reductions: channels-last batch-norm statistics (sums over N, H, W with C adjacent in
memory) are split by their memory layout into many programs whose loads walk C, and their results
and gradients are eager's. The launch decisions are read from the source a CUDA graph would get
(generated here without the interpreter, never run); numerics run through the interpreter."""

from __future__ import annotations

import re

import pytest
import sympy
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, compile_fn, run
from layout_helpers import same
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees.aot.decompositions import decomposition_table
from cgtrees.codegen import heuristics
from cgtrees.codegen.heuristics import Split

RESNET_BN = [(32, 64, 112, 112), (32, 64, 56, 56), (32, 128, 28, 28), (32, 256, 14, 14), (32, 512, 7, 7)]
MOBILENET_BN = [(32, 16, 112, 112), (32, 576, 7, 7)]
LAUNCH = re.compile(r"^\s*(red_\w+)\[\((\d+),\)\]\(.*XBLOCK=(\d+), RBLOCK=(\d+), num_warps=(\d+)\)$", re.M)


def gpu_source(fn, *inputs: torch.Tensor) -> str:
    """The module source that compiled (not interpreted) kernels would get for ``fn``'s graph."""
    from cgtrees.codegen import wrapper
    from cgtrees.codegen.graph import GraphLowerer
    from cgtrees.codegen.scheduler import schedule
    from cgtrees.config import Config

    gm = make_fx(fn, decomposition_table=decomposition_table(), tracing_mode="fake")(*inputs)
    program = GraphLowerer(gm, Config(interpret=False)).run()
    return wrapper.module_source(["# test"], program, schedule(program), False).source


def kernel_text(source: str, name: str) -> str:
    start = source.index(f"def {name}(")
    return source[start:source.index("\n\n", start)]


def stats(x: torch.Tensor):
    return torch.var_mean(x, dim=(0, 2, 3), keepdim=True, correction=0)


def channels_last(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape).to(memory_format=torch.channels_last)


# ------------------------------------------------------------------------------------ decisions
@pytest.mark.parametrize("shape", RESNET_BN + MOBILENET_BN)
def test_channels_last_bn_statistics_split_into_many_coalesced_programs(shape):
    """Each stage-1 kernel: a column block of 32 adjacent channels (the lanes walk C, stride 1)
    on enough programs to fill an H100 (132 SMs) several times; each stage 2 one persistent block."""
    n, c, h, w = shape
    source = gpu_source(stats, channels_last(shape))
    launches = LAUNCH.findall(source)
    assert len(launches) == 4, source  # mean: partials, total; squared deviations: partials, total
    for name, grid, xblock, _, _ in launches[0::2]:
        assert int(xblock) == heuristics.COLUMN_XBLOCK == 32, (name, xblock)  # C=16: two parts' channels
        assert int(grid) >= 256, (name, grid)  # it was 32 (16 for C=16) before the layout was read
        body = kernel_text(source, name)
        load = re.search(r"tl\.load\(\w+_ptr \+ \((.*?)\), xmask & rmask", body).group(1)
        index = sympy.sympify(load)
        channel = [s for s in index.free_symbols if index.coeff(s) == 1]
        assert len(channel) == 1 and channel[0].name.startswith("x"), load  # C: a kept dim, stride 1
        assert re.search(rf"\n    {channel[0].name} = (xindex|xindex % {c})\n", body), body  # fastest x lane
    for name, *_ in launches[1::2]:
        assert "for roffset" not in kernel_text(source, name), name  # the partials in one block


def test_column_split_keeps_outer_dims_whole_when_one_dim_has_too_few_parts():
    """N=32 alone gives 64 programs for C=64; N kept whole and H cut in 16 gives 1024."""
    split = heuristics.split_reduction((32, 64, 112, 112), (0, 2, 3), inner=False)
    assert split == Split(dim=2, parts=16, keep=(0,), outer=True)
    parts = 32 * split.parts
    assert parts * 64 // heuristics.COLUMN_XBLOCK >= heuristics.COLUMN_SPLIT_PROGRAMS
    assert 32 * 112 * 112 // parts >= heuristics.COLUMN_MIN_CHUNK and parts <= heuristics.COLUMN_MAX_PARTS


def test_row_reductions_split_as_before():
    """Contiguous (NCHW) statistics are row reductions: 16 parts of N, as before columns were read."""
    assert heuristics.split_reduction((32, 64, 56, 56), (0, 2, 3), inner=True) == Split(0, 16)
    assert heuristics.split_reduction((4, 65536), (1,), inner=True) == Split(1, 256)
    assert heuristics.split_reduction((2048, 256), (1,), inner=True) is None


def test_row_or_column_is_read_from_strides_not_logical_dims():
    """The same sum over N, H, W: contiguous, a row reduction (N cut); channels-last, columns."""
    f = lambda x: x.sum(dim=(0, 2, 3))
    contiguous = gpu_source(f, torch.empty(32, 64, 56, 56))
    assert "reduction over dims [1, 3, 4] of (16, 2, 64, 56, 56)" in contiguous, contiguous
    nhwc = gpu_source(f, channels_last((32, 64, 56, 56)))
    assert "reduction over dims [3, 4] of (28, 32, 64, 2, 56)" in nhwc, nhwc  # parts, N kept, C, chunk of H, W


def test_short_columns_stay_one_kernel():
    source = gpu_source(lambda x: x.sum(dim=(0, 2, 3)), channels_last((2, 64, 8, 8)))
    assert "_part" not in source and len(LAUNCH.findall(source)) == 1, source


@pytest.mark.parametrize("rows, grid, xblock", [(16, 16, 1), (200, 200, 1), (1024, 128, 8), (8192, 512, 16)])
def test_few_rows_spread_over_programs(rows, grid, xblock):
    """A LayerNorm over 16 rows of 256 was one program of 16 rows on one SM (4x slower than
    Inductor's on mlp_small); blocks shrink until there are MIN_PROGRAMS programs, or one row each."""
    source = gpu_source(lambda x: F.layer_norm(x, (256,)), torch.empty(rows, 256))
    [(_, got_grid, got_xblock, rblock, _)] = LAUNCH.findall(source)
    assert (int(got_grid), int(got_xblock), int(rblock)) == (grid, xblock, 256), source


@pytest.mark.parametrize("rows, cols, grid, xblock", [(16, 256, 32, 8), (16, 8192, 128, 64), (16, 4, 1, 4)])
def test_few_columns_spread_over_programs_of_a_sector_at_least(rows, cols, grid, xblock):
    """A bias gradient, sum over 16 rows: 32 programs of 8 adjacent outputs (one 32-byte sector a
    row), not one program of 256; 8192 outputs: 128 programs of 64."""
    source = gpu_source(lambda x: x.sum(0), torch.empty(rows, cols))
    [(_, got_grid, got_xblock, rblock, _)] = LAUNCH.findall(source)
    assert (int(got_grid), int(got_xblock), int(rblock)) == (grid, xblock, 16), source


# ------------------------------------------------------------------------------------- numerics
numerics = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")


@numerics
@pytest.mark.parametrize("shape", [(4, 8, 32, 64), (16, 16, 16, 16), (3, 24, 20, 36)])
def test_channels_last_batch_norm_training_matches_eager(shape):
    """Outputs and the gradients of input, weight and bias, against eager and float64."""
    torch.manual_seed(0)
    x = torch.randn(*shape).to(memory_format=torch.channels_last)
    w, b = torch.randn(shape[1]), torch.randn(shape[1])
    f = lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)
    ours, eager, exact = ([t.clone().requires_grad_() for t in (x, w, b)] for _ in range(3))
    exact = [t.detach().double().requires_grad_() for t in exact]
    comp = Compiler()
    out = torch.compile(f, backend=comp.backend)(*ours)
    grad = torch.randn_like(out)
    expected, truth = f(*eager), f(*exact)
    for y, dy in ((out, grad), (expected, grad), (truth, grad.double())):
        y.backward(dy)
    comp.check()
    assert any("_part_ptr" in m.source for m in comp.modules) or shape == (3, 24, 20, 36)
    same(out, expected, "output", truth)
    for name, a, e, t in zip(("x", "weight", "bias"), ours, eager, exact):
        same(a.grad, e.grad, f"grad of {name}", t.grad)


@numerics
@pytest.mark.parametrize("name, f", [
    ("sum", lambda x: x.sum(dim=(0, 2, 3))),
    ("sum keepdim", lambda x: x.sum(dim=(0, 2, 3), keepdim=True)),
    ("mean", lambda x: x.mean(dim=(0, 2, 3))),
    ("var_mean", stats),
    ("amax", lambda x: x.amax(dim=(0, 2, 3))),
    ("amin keepdim", lambda x: x.amin(dim=(0, 2, 3), keepdim=True)),
])
def test_split_column_reductions_match_eager(name, f):
    """Every splittable reduction through the two stages (N kept whole, H cut), keepdim or not."""
    x = torch.randn(4, 8, 32, 64).to(memory_format=torch.channels_last)
    m = compile_fn(f, x)
    assert "_part_ptr" in m.source, m.source
    got = run(m, x)
    want = f(x)
    want = want if isinstance(want, tuple) else (want,)
    for i, (a, e) in enumerate(zip(got, want)):
        exact = f(x.double())
        exact = (exact if isinstance(exact, tuple) else (exact,))[i]
        same(a, e, f"{name} output {i}", exact)


@numerics
def test_transposed_input_reduces_as_its_memory_says():
    """A sum over the logical last dim of a transposed tensor: in memory its outputs are adjacent
    (a column reduction over 4096 rows, split), where the logical dims say a row reduction (which
    would not have been split: rows under 8192 elements)."""
    x = torch.randn(4096, 64).t()  # (64, 4096), strides (1, 64)
    f = lambda x: x.sum(1)
    m = compile_fn(f, x)
    assert "_part_ptr" in m.source, m.source
    same(run(m, x)[0], f(x), "sum over dim 1", f(x.double()))
    part = LAUNCH.findall(gpu_source(f, x))[0]
    assert int(part[2]) >= 32 and int(part[1]) * int(part[2]) == 64 * 64, part  # 64 parts of 64 adjacent outputs
    y = torch.randn(64, 4096).t()  # (4096, 64), strides (1, 4096): the sum over dim 0 is of adjacent rows
    g = lambda y: y.sum(0)
    same(run(compile_fn(g, y), y)[0], g(y), "sum over dim 0", g(y.double()))
