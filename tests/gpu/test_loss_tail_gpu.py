"""A loss's mean over every row as the row kernel's tail, on a real GPU (``codegen/tail.py``): each program
writes its share to a slot, the last one to take the ticket adds the slots. Under the interpreter
programs run one after another, so only a GPU runs them at once: the ticket's ordering, the volatile
reads of the slots and each launch's own counter (made at 0 by ``call``) are checked here, over many
programs and many CUDA graph replays, each step's loss and gradient against eager's (float64 at the
scale of the values)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

ROWS, VOCAB = 4096, 50257  # GPT-2's vocabulary; thousands of rows: many programs take a ticket


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)


def _step(fn, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, labels)
    loss.backward()
    return loss.detach(), x.grad


def test_loss_tail_matches_eager_on_every_replay(cgtrees_counters):
    torch.manual_seed(0)
    # fresh 393 MiB logits each step: graphs only with the copy limit off (max_copy_mb_per_launch=0)
    compiled = torch.compile(_loss, backend="cgtrees", options={"max_copy_mb_per_launch": 0})
    for step in range(24):  # warmup, record, then replays: each launch counts from 0
        logits = torch.randn(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
        labels = torch.randint(0, VOCAB, (ROWS,), device="cuda")
        labels[step % 7::7] = -100
        loss, grad = _step(compiled, logits, labels)
        exact_loss, exact_grad = _step(_loss, logits.double(), labels)
        eager_loss, eager_grad = _step(_loss, logits, labels)
        bound = 2 * (eager_loss.double() - exact_loss).abs().item() + 1e-6 * exact_loss.abs().item()
        assert (loss.double() - exact_loss).abs().item() <= bound, (step, loss.item(), exact_loss.item())
        # the gradient is bf16, as the logits: within twice eager's rounding, plus a float32 ulp of the scale
        ours, theirs = ((g.double() - exact_grad).abs().max().item() for g in (grad, eager_grad))
        assert ours <= 2 * theirs + 1.2e-7 * exact_grad.abs().max().item(), (step, ours, theirs)
    assert cgtrees_counters["cudagraph_replayed"] >= 20, dict(cgtrees_counters)


def test_every_row_ignored_gives_eagers_nan_on_every_replay(cgtrees_counters):
    compiled = torch.compile(_loss, backend="cgtrees", options={"max_copy_mb_per_launch": 0})
    for _ in range(6):
        logits = torch.randn(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16)
        labels = torch.full((ROWS,), -100, device="cuda")
        with torch.no_grad():
            assert torch.isnan(compiled(logits, labels)) and torch.isnan(_loss(logits, labels))
    assert cgtrees_counters["cudagraph_replayed"] >= 3, dict(cgtrees_counters)


def test_two_streams_at_once_each_get_eagers_loss():
    """Two threads launch the same loss kernel at once, each on a stream of its own: each launch has
    its own ticket and slots (``tail.py``), so neither's last program adds the other's slots. Eager's
    loss on the same stream is the reference, per launch (float64 scale as above)."""
    import threading

    compiled = torch.compile(_loss, backend="cgtrees", options={"cudagraphs": False})
    with torch.no_grad():  # compiled once, here, before the threads
        logits = torch.randn(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16)
        compiled(logits, torch.zeros(ROWS, dtype=torch.long, device="cuda"))
    misses: list[tuple] = []

    def work(seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.no_grad():
            for step in range(12):
                logits = torch.randn(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
                labels = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=gen)
                got, eager = compiled(logits, labels), _loss(logits, labels)
                exact = _loss(logits.double(), labels)
                bound = 2 * (eager.double() - exact).abs().item() + 1e-6 * exact.abs().item()
                if (got.double() - exact).abs().item() > bound:
                    misses.append((seed, step, got.item(), exact.item()))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not misses, misses
