"""Whole torchvision models train right at real sizes (batch 32 at 224x224): resnet18 and
mobilenet_v3_small, three training steps through cgtrees (warmup, recording, replay), every
parameter's gradient against a float64 eager step.

Float32 itself is far from float64 on some of these gradients (resnet18's layer4 convolutions: 9%
in eager, measured on an H100), so each gradient's error is judged against eager float32's own
error on it: cgtrees may be at most 3x as far from float64 as eager is, or 1e-4 where eager is
closer than that. cuDNN's TF32 is off here (the benchmark leaves it on, and there both backends
are 10-30% off float64 on mobilenet's squeeze-excitation biases)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from bench_helpers import bench  # noqa: E402

FLOOR = 1e-4  # where eager float32 is closer to float64 than this, cgtrees may be off by this much
FACTOR = 3.0


@pytest.fixture
def no_tf32():
    """cuDNN's and cuBLAS's TF32 off (cuDNN's through its context manager: torch's test utilities,
    once imported, forbid setting its flags directly)."""
    cudnn = torch.backends.cudnn
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        assert not cudnn.allow_tf32
        yield
    torch.backends.cuda.matmul.allow_tf32 = matmul


def _grads(model, x, labels):
    """One forward and backward; the logits and every parameter's gradient (then cleared)."""
    out = model(x)
    F.cross_entropy(out, labels).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out.detach(), grads


# Measured on an H100 (first step, warmup): four of resnet18's 62 gradients, all downstream of
# layer4's batch norms, are 3.4-5.2x as far from float64 as eager's (layer3.1.conv1.weight 5.4e-2
# against 1.6e-2, layer3.1.bn1.bias 2.4e-2 against 6.7e-3, layer3.1.bn2.bias 1.7e-2 against 4.1e-3,
# layer4.0.downsample.1.weight 9.9e-3 against 1.9e-3): the batch-norm backward sums of
# test_layout_gpu's xfail, compounded through the blocks. Open (issue 18), not a tolerance to widen.
_BN_SUMS = pytest.mark.xfail(strict=True, reason=(  # strict: a pass says issue 18 is fixed
    "issue 18, open: resnet18's gradients downstream of layer4's batch norms are 3.4-5.2x as far from "
    "float64 as eager's (batch-norm backward sums in compiled kernels)"))


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("resnet18", marks=_BN_SUMS), "mobilenet_v3_small"])
def test_whole_vision_model_trains_like_eager(name, no_tf32, cgtrees_counters):
    pytest.importorskip("torchvision")
    measure = bench("measure")
    model, input_fn, _ = bench("workloads").build(name)
    model = model.cuda().train()
    names = [n for n, _ in model.named_parameters()]
    (x,) = input_fn(torch.device("cuda"))
    labels = torch.randint(1000, (x.shape[0],), generator=torch.Generator().manual_seed(4321)).cuda()

    want_out, want = _grads(copy.deepcopy(model).double(), x.double(), labels)
    eager_out, eager = _grads(copy.deepcopy(model), x, labels)
    eager_errors = measure.relative_errors(eager, want)
    f = torch.compile(model, backend="cgtrees")
    for step in range(3):  # warmup, recording, replay: the same input and weights each time
        out, got = _grads(f, x, labels)
        assert measure.relative_errors([out], [want_out])[0] <= FACTOR * max(
            measure.relative_errors([eager_out], [want_out])[0], FLOOR), f"{name} step {step}: logits"
        errors = measure.relative_errors(got, want)
        bad = [f"{n}: {e:.1e} (eager {ee:.1e})" for n, e, ee in zip(names, errors, eager_errors)
               if not e <= FACTOR * max(ee, FLOOR)]
        assert not bad, f"{name} step {step}: gradients off float64 by more than {FACTOR}x eager's: {bad[:5]}"
    assert cgtrees_counters["graph_fallbacks"] == 0
    assert cgtrees_counters["cudagraph_replayed"] > 0, "the third step replays"
