"""A channels-last training step on CUDA, the layout rewrite forced (``layout_opt="force"``), against
eager: output, input gradient, every parameter gradient and the running statistics.

Forced on the H100 before the generated module checked the strides of what aten returns, a
conv-BN-ReLU gave wrong input gradients: cuDNN's ``convolution_backward`` returned a gradient in
other strides than its meta said, and our kernels read it with the traced ones. The module now
gives each such result its traced strides (backend/codegen/extern_strides.py); which values
came back otherwise is printed (the DEBUG log of ``cgtrees.codegen``), for the record.
"""

from __future__ import annotations

import glob
import logging
import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from layout_helpers import train_against_eager  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

DEV = "cuda"


class ConvBNReLUConv(nn.Module):
    def __init__(self, c_in: int = 3, c: int = 32) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.bn(self.conv1(x))))



@pytest.mark.parametrize("cudagraphs", [True, False], ids=["cudagraphs", "no_cudagraphs"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw_in", "nhwc_in"])
def test_forced_channels_last_training_matches_eager(cudagraphs, memory_format, no_tf32, tmp_path, caplog):
    from torch._dynamo.utils import counters

    model = ConvBNReLUConv().to(DEV)
    x = torch.randn(8, 3, 32, 32, device=DEV).contiguous(memory_format=memory_format)
    options = {"layout_opt": "force", "cudagraphs": cudagraphs, "cache": False, "debug_dir": str(tmp_path)}
    with caplog.at_level(logging.DEBUG, logger="cgtrees.codegen"):
        train_against_eager(model, x, options, steps=3, buffers_against_float64=True)
    assert counters["cgtrees"]["layout_channels_last"] == 1  # the joint graph was rewritten
    assert counters["cgtrees"]["graph_fallbacks"] == 0  # forward and backward generated
    checks = [line.strip() for path in glob.glob(str(tmp_path / "*.py")) for line in open(path)
              if " = with_traced_strides(" in line]
    assert any("getitem" in line for line in checks), checks  # convolution_backward's results are checked
    restrided = [r.getMessage() for r in caplog.records if "came back from aten with strides" in r.getMessage()]
    print(f"\n{len(checks)} checks; restrided by this run: {restrided or 'none'}")
