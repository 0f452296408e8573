"""A language model's loss in two generated kernels, forward and backward together (issue 55, item 4).

GPT-2's loss, ``F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)``, was three
kernels: the rows' max and sum of exponentials, then a one-program kernel for the mean over the rows
(the target's logit picked again per row), then the backward's ``softmax - onehot`` times the incoming
gradient over the count. The mean is now the row kernel's *tail* (``codegen/scheduler.py``): each
program adds its rows' share to a slot of its own and the last program to finish adds the slots in
order (``codegen/tail.py``). A gradient written as the ``[1, N, V]`` logits it flows back to joins
the row kernel that recomputes the statistics (``_Open.unit_dims``), so the backward stays one kernel.

Irregular sizes (37 rows; 1000, 5003 and 9001 columns, the last past one block so the row is
looped), ignored rows, every row ignored (eager's NaN), float32 logits and bf16 logits upcast to
float as Hugging Face does, with and without the LM head's matrix product before the loss.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, config, kernel_count

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

ROWS, WIDTH = 37, 24
VOCABS = (1000, 5003, 9001)  # 9001 > codegen.heuristics.PERSISTENT_LIMIT: a looped row


def _labels(vocab: int, ignored: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, vocab, (1, ROWS), generator=generator)
    labels[0, [0, 9, 30]] = -100
    labels[0, 5] = vocab - 1
    if ignored == "all":
        labels[:] = -100
    return labels


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def _head(dtype: torch.dtype):
    """The LM head and the loss; bf16 logits are upcast to float before it, as Hugging Face does."""
    def fn(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _loss((x @ w.t()).float(), labels)
    return fn


def _inputs(case: str, vocab: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(1)
    if case == "logits":
        return (torch.randn(1, ROWS, vocab, generator=generator) * 3), None
    dtype = torch.bfloat16 if case == "lm_head_bf16" else torch.float32
    x = torch.randn(1, ROWS, WIDTH, generator=generator).to(dtype)
    return x, (torch.randn(vocab, WIDTH, generator=generator) * 0.3).to(dtype)


def _run(fn, leaf: torch.Tensor, others: tuple, compiler=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the gradient of ``leaf``, compiled with ``compiler``'s backend or eager."""
    leaf = leaf.detach().clone().requires_grad_()
    call = torch.compile(fn, backend=compiler.with_our_partition) if compiler else fn
    args = (leaf, *others) if len(others) == 1 else (others[0], leaf, others[1])
    loss = call(*args)
    loss.backward()
    return loss, leaf.grad


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """Within tolerances that scale with the largest expected value (bf16 gradients: bf16's); the
    largest error, for the report."""
    scale = max(expected.float().nan_to_num(0).abs().max().item(), 1e-3)
    half = expected.dtype == torch.bfloat16
    tol = dict(atol=1e-2 * scale, rtol=1.6e-2) if half else dict(atol=1e-5 * scale, rtol=1e-4)
    torch.testing.assert_close(actual.float(), expected.float(), equal_nan=True, **tol, msg=lambda m: f"{what}: {m}")
    return (actual.float() - expected.float()).nan_to_num(0).abs().max().item()


def _kernels(comp: Compiler) -> dict[str, int]:
    return {m.name.split("_")[1]: kernel_count(m) for m in comp.modules}


@pytest.mark.parametrize("ignored", ["some", "all"])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("case", ["logits", "lm_head", "lm_head_bf16"])
def test_gpt2_loss_in_two_kernels(case, vocab, ignored):
    """One kernel forward (row statistics, picked logit, the mean as its tail), one backward; the
    loss and the gradients (of the logits, or of the LM head's weight) as eager's."""
    labels = _labels(vocab, ignored)
    x, w = _inputs(case, vocab)
    comp = Compiler()
    if case == "logits":
        got = _run(_loss, x, (labels,), comp)
        want = _run(_loss, x, (labels,))
    else:
        got = _run(_head(w.dtype), w, (x, labels), comp)
        want = _run(_head(w.dtype), w, (x, labels))
    comp.check()
    counts = _kernels(comp)
    assert counts == {"forward": 1, "backward": 1}, counts
    if ignored == "all":
        assert torch.isnan(got[0]) and torch.isnan(want[0])
    loss_error = _close(got[0], want[0], "loss")
    grad_error = _close(got[1], want[1], "gradient")
    print(f"{case} {vocab} {ignored}: kernels {counts}, loss error {loss_error:.3g}, gradient error {grad_error:.3g}")


def _forward_source(comp: Compiler) -> str:
    return next(m.source for m in comp.modules if m.name.startswith("g_forward"))


def test_looped_row_keeps_one_loop_and_its_tail():
    """Past one block the row is one online loop; the tail follows it, after every row's share."""
    labels, (x, _) = _labels(9001, "some"), _inputs("logits", 9001)
    comp = Compiler()
    _run(_loss, x, (labels,), comp)
    source = _forward_source(comp)
    assert source.count("for roffset in range(") == 1
    assert source.count("tl.atomic_add(") == 1 and "if ticket == programs - 1:" in source


def test_last_program_adds_every_slot(monkeypatch):
    """The last program adds the slots ``PBLOCK`` at a time: with 2 a time, every one of the
    launch's programs is still counted once (a loss over 37 rows as eager's)."""
    from cgtrees.codegen import wrapper

    monkeypatch.setattr(wrapper, "TAIL_BLOCK", 2)
    labels, (x, _) = _labels(1000, "some"), _inputs("logits", 1000)
    comp = Compiler()
    got = _run(_loss, x, (labels,), comp)
    source = _forward_source(comp)
    programs = int(source.split("[(")[1].split(",)]")[0])
    assert programs > 2 and "PBLOCK=2" in source, source
    _close(got[0], _run(_loss, x, (labels,))[0], "loss")


def test_each_launch_has_its_own_ticket():
    """The counter is made at 0 by each call, not kept by the module (two launches at once, on two
    streams, would share a module's): a second call (other values) is right too."""
    labels, (x, _) = _labels(1000, "some"), _inputs("logits", 1000)
    comp = Compiler()
    compiled = torch.compile(_loss, backend=comp.with_our_partition)
    for scale in (1.0, 5.0):
        got = compiled(x * scale, labels)
        _close(got, _loss(x * scale, labels), f"loss at scale {scale}")
    module = next(m for m in comp.modules if m.name.startswith("g_forward")).module
    assert not [k for k, v in vars(module).items() if k.endswith("_ticket")]
    source = _forward_source(comp)
    call = source[source.index("def call(args):"):]
    assert call.count("_ticket = torch.zeros((1,), dtype=torch.int32, device=DEVICE)") == 1, call


@pytest.mark.parametrize("n", [300, 9001])
def test_a_mean_of_row_statistics_is_a_tail(n):
    """The rule is general: any sum over every row of a row value (here a log-sum-exp's mean and a
    layer norm's summed variance) ends its row kernel; one kernel, values as eager's."""
    x = torch.randn(37, n) * 2

    def fn(x):
        return torch.logsumexp(x, 1).mean(), torch.var_mean(x, 1)[0].sum()

    comp = Compiler()
    got = torch.compile(fn, backend=comp.with_our_partition)(x)
    comp.check()
    assert [kernel_count(m) for m in comp.modules] == [1]
    for g, w in zip(got, fn(x)):
        _close(g, w, "value")


def test_a_max_over_rows_is_not_a_tail():
    """Only sums join as a tail: a max over the rows' sums keeps its own kernel."""
    x = torch.randn(37, 300)
    comp = Compiler()
    got = torch.compile(lambda x: x.sum(1).amax(0), backend=comp.with_our_partition)(x)
    comp.check()
    assert [kernel_count(m) for m in comp.modules] == [2]
    _close(got, x.sum(1).amax(0), "max")


def test_no_rows_at_all_is_eager_nan():
    """Over no rows the kernel still launches one program, whose tail writes a mean of nothing:
    NaN, as eager's (a kernel skipped for its zero size would leave the loss unwritten)."""
    x, labels = torch.randn(0, 1000), torch.zeros(0, dtype=torch.int64)
    comp = Compiler()
    got = _run(_loss, x, (labels,), comp)
    comp.check()
    assert "[(1,)](" in _forward_source(comp)
    assert torch.isnan(got[0]) and torch.isnan(F.cross_entropy(x, labels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_lm_head_gradient_loads_each_row_value_once(dtype):
    """The LM head padded to aligned sizes (GPT-2's vocabulary is not): the loss's gradient is written
    into the padded layout by the kernel that computes it, its columns past the vocabulary zeros. The
    row values it reads (each row's maximum and sum, its label; the loss's scale) are loaded as one
    ``[XBLOCK, 1]`` block a row, then masked by the columns, not loaded again for every column (an
    H200 took 2.0 ms so for GPT-2 small's gradient, five row values an element); the gradient is eager's."""
    labels = _labels(9001, "some")  # rows past one block: a kernel of rows, looped over their columns
    x, w = _inputs("lm_head_bf16" if dtype == torch.bfloat16 else "lm_head", 9001)
    comp = Compiler(config(gemm_decisions="align"))
    got = _run(_head(dtype), w, (x, labels), comp)
    want = _run(_head(dtype), w, (x, labels))
    comp.check()
    backward = next(m.source for m in comp.modules if m.name.startswith("g_backward"))
    assert "padded to" in backward
    for row_value in ("amax", "sum_1", "tangents_1"):  # each row's maximum and sum, the loss's incoming gradient
        assert re.search(rf"tl\.load\({row_value}_ptr \+ [^\n]*tl\.zeros\(\[XBLOCK, 1\], tl\.int32\), xmask", backward)
    assert "tl.zeros([XBLOCK, RBLOCK], tl.int32)" not in backward  # no row value loaded a column at a time
    _close(got[0], want[0], "loss")
    _close(got[1], want[1], "gradient")
