"""Batch buckets on CUDA graphs (option ``batch_buckets``): every batch size of a serving loop
replays one recorded graph per bucket; outputs cut from a bucket's pool outputs and kept across
calls stay right (R1, R2); the GPU's attention ops keep the rows apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from models import TinyLM
from torch._dynamo.utils import counters

DEV = "cuda"
BUCKETS = (1, 2, 4, 8, 16)
pytestmark = pytest.mark.usefixtures("kernel_modules")


def stat(key: str) -> int:
    return counters["cgtrees"][key]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to(DEV).eval()


def _batch(b: int, *shape: int) -> torch.Tensor:
    x = torch.randn(b, *shape, device=DEV)
    torch._dynamo.mark_dynamic(x, 0)
    return x


def test_every_batch_size_replays_one_graph_per_bucket(no_tf32):
    """Batches 2..16, three rounds: graphs recorded at 2, 4, 8 and 16 only, every later call a replay."""
    model = mlp()
    f = torch.compile(model, backend="cgtrees", options={"batch_buckets": BUCKETS})
    with torch.no_grad():
        for _ in range(3):
            for b in range(2, 17):
                x = _batch(b, 32)
                torch.testing.assert_close(f(x), model(x))
    assert stat("bucketed_graphs") == 1 and stat("bucket_shapes") == 4
    assert stat("cudagraph_recorded") == 4, dict(counters["cgtrees"])
    assert stat("cudagraph_skips") == 0
    assert stat("cudagraph_replayed") == 3 * 15 - 4 - 4  # the rest: a warmup and a recording per bucket


def test_kept_outputs_of_one_bucket_stay_right(no_tf32):
    """Outputs are views of the bucket's pool outputs: kept across calls of the same bucket, they
    are never overwritten (R2 records around them) and stay eager's."""
    model = mlp()
    f = torch.compile(model, backend="cgtrees", options={"batch_buckets": BUCKETS})
    with torch.no_grad():
        kept = [(x, f(x)) for x in (_batch(b, 32) for b in (3, 4, 3, 5, 3, 4, 3, 3))]
        for x, y in kept:
            torch.testing.assert_close(y, model(x))


def test_attention_model_on_the_gpu(no_tf32):
    """The GPU's SDPA op (flash or efficient attention) takes the batch first: bucketed, eager's results."""
    torch.manual_seed(0)
    model = TinyLM().to(DEV).eval()
    f = torch.compile(model, backend="cgtrees", options={"batch_buckets": BUCKETS})
    with torch.no_grad():
        for b in (2, 3, 5, 7, 3, 9):
            ids = torch.randint(0, 50, (b, 7), device=DEV)
            torch._dynamo.mark_dynamic(ids, 0)
            (probs, best), (ref_probs, ref_best) = f(ids), model(ids)
            torch.testing.assert_close(probs, ref_probs)
            assert torch.equal(best, ref_best)
    assert stat("bucketed_graphs") == 1 and stat("bucket_shapes") == 4
