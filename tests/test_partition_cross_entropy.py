"""What our partition saves for the backward of a language model's head and cross-entropy (issue
44, "Real sizes, part 1", item 2): the logits in their own dtype (bf16 under autocast) and float32
statistics, one per row, never a full-size intermediate (the float32 log-softmax, the one-hot of the
targets). At most 1.05x the bytes torch's min-cut rematerialization saves on the same joint graph
(it was 2.0x: the log-softmax and a one-hot scatter, each as large as the logits in float32).
Partitions only: the graphs run as traced, on CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.partitioners import min_cut_rematerialization_partition

from cgtrees.aot.measure import measure, run_partitioned
from cgtrees.aot.partition import partition

ROWS, WIDTH = 6, 16


class Head(torch.nn.Module):
    """A language model's head and loss: logits = x @ W.T, cross-entropy over the vocabulary."""

    def __init__(self, vocab: int, autocast: bool) -> None:
        super().__init__()
        self.lin, self.autocast = torch.nn.Linear(WIDTH, vocab, bias=False), autocast

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return F.cross_entropy(self.lin(x).float(), target)


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    target = torch.randint(0, vocab, (ROWS,))
    target[1] = -100
    return torch.randn(ROWS, WIDTH, requires_grad=True), target


def _saved(model: torch.nn.Module, inputs: tuple) -> list[torch.fx.Node]:
    """The values our partition has the forward return for the backward."""
    seen: list[torch.fx.Node] = []

    def spy(joint, joint_inputs, *, num_fwd_outputs, **kw):
        fw, bw = partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        output = next(iter(fw.graph.find_nodes(op="output")))
        seen.extend(a for a in output.args[0][num_fwd_outputs:] if isinstance(a, torch.fx.Node))
        return fw, bw

    torch._dynamo.reset()
    run_partitioned(model, inputs, spy)
    return seen


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16 autocast"])
@pytest.mark.parametrize("vocab", [50257, 30522, 1000])
def test_saved_bytes_against_min_cut(vocab, autocast):
    model = Head(vocab, autocast)
    ours = measure(copy.deepcopy(model), _inputs(vocab), partition)
    theirs = measure(copy.deepcopy(model), _inputs(vocab), min_cut_rematerialization_partition)
    print(f"vocab {vocab}, autocast {autocast}: ours {ours} B, min-cut {theirs} B, {ours / theirs:.3f}x")
    assert ours <= 1.05 * theirs


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16 autocast"])
def test_saves_the_logits_and_row_statistics(autocast):
    """Over long rows: one tensor of the logits' size, in the logits' dtype, and float32 values one
    per row (the max and the sum of exponentials), which the backward does not recompute."""
    vocab = 50257
    saved = [n.meta["val"] for n in _saved(Head(vocab, autocast), _inputs(vocab))]
    full = [v for v in saved if v.numel() == ROWS * vocab]
    rows = [v for v in saved if v.shape == (ROWS, 1) and v.is_floating_point()]
    assert [v.dtype for v in full] == [torch.bfloat16 if autocast else torch.float32], saved
    assert len(rows) == 2 and all(v.dtype == torch.float32 for v in rows), saved
