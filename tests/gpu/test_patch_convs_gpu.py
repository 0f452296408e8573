"""A ViT's patch convolution on the GPU, default options (``backend/codegen/patch_convs.py``): the two
forms are timed at compile time, the choice is a line of the module's header, and the result is as
close to float64's as eager's is, whichever form was taken."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")


def _patch_tokens(x, w, b):
    return F.conv2d(x, w, b, stride=16).flatten(2).transpose(1, 2) * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vit_b16_patch_embedding_is_timed_and_close_to_float64(dtype):
    from codegen_helpers import compile_fn, config

    torch.manual_seed(0)
    x = torch.randn(16, 3, 224, 224, dtype=dtype, device="cuda")
    w = torch.randn(768, 3, 16, 16, dtype=dtype, device="cuda") * 0.03
    b = torch.randn(768, dtype=dtype, device="cuda")
    module = compile_fn(_patch_tokens, x, w, b, cfg=config(gemm_decisions="measure"))
    (line,) = [c for c in module.graph.gemm_choices if "convolution" in c]
    print(line)
    assert " us" in line, line  # both forms were timed
    got = module.call([x, w, b])[0]
    exact = _patch_tokens(x.double(), w.double(), b.double())
    eager = _patch_tokens(x, w, b)
    ours, theirs = ((t.double() - exact).abs().max().item() for t in (got, eager))
    eps = torch.finfo(torch.float32 if dtype == torch.float32 else dtype).eps
    # float32: cuDNN may take TF32 (allow_tf32 defaults on for convolutions), cuBLAS does not
    assert ours <= 2 * theirs + 4 * eps * exact.abs().max().item(), (ours, theirs, line)
    assert got.stride() == eager.stride()


def test_vit_b16_patch_embedding_trains_with_its_backward_timed_and_as_close_as_eagers(tmp_path):
    """The weight gradient (the image needs none) under bf16 autocast, default options: the backward's
    two forms are timed at compile time, and the float32 gradients are as close to float64's as
    eager's are, whichever form was taken."""
    import re

    import cgtrees  # noqa: F401

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 768, 16, stride=16).cuda()
    x = torch.randn(32, 3, 224, 224, device="cuda")
    r = torch.randn(32, 196, 768, device="cuda")

    def grads(fn, dtype=torch.float32):  # float32 weights under bf16 autocast; float64 without it
        conv.zero_grad()
        with torch.autocast("cuda", torch.bfloat16, enabled=dtype == torch.float32):
            out = fn(x.to(dtype))
        (out.flatten(2).transpose(1, 2).to(dtype) * r.to(dtype)).sum().backward()
        return [p.grad.detach().clone() for p in conv.parameters()]

    eager = grads(conv)
    exact = grads(conv.double(), torch.float64)
    conv.float()
    torch._dynamo.reset()
    ours = grads(torch.compile(conv, backend="cgtrees", options={"debug_dir": str(tmp_path)}))
    (backward,) = [p for p in tmp_path.iterdir() if "_backward_" in p.name]
    (line,) = re.findall(r"^#   \w+: convolution_backward .*$", backward.read_text(), re.M)
    print(line)
    assert " us" in line, line  # both forms were timed
    for got, want, ref in zip(ours, eager, exact):
        err, eager_err = ((t.double() - ref).abs().max().item() for t in (got, want))
        assert err <= eager_err + 2 ** -8 * ref.abs().max().item(), (err, eager_err, line)
        assert got.stride() == want.stride()
