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
