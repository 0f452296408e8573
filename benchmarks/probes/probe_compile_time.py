"""Probe: how long Triton takes to compile our depthwise convolution kernels, on any machine.

Triton compiles for a GPU it is told of (``GPUTarget("cuda", 90, 32)``: an H100 or H200) with the
``ptxas`` its wheel ships, so compile times can be read where there is no GPU. This generates the
kernel module of a depthwise convolution with a fused GELU (channels-last, batch 32, 40 channels at
56x56, convnext_atto's first stage) for each window size, and compiles each of its kernels at the
block size the module launches it with and at smaller ones, in a fresh Triton cache::

    python benchmarks/probes/probe_compile_time.py
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="probe-triton-")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cgtrees import codegen  # noqa: E402
from cgtrees.aot.decompositions import decomposition_table  # noqa: E402
from cgtrees.config import Config  # noqa: E402
from cgtrees.context import GraphContext  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BLOCKS = (1024, 256)


def kernels(kernel: int) -> dict[str, triton.runtime.jit.JITFunction]:
    """The Triton kernels of the module generated for a ``kernel`` x ``kernel`` depthwise convolution
    (generated as for Triton's interpreter, whose kernel text is the compiled one's)."""
    x = torch.randn(32, 40, 56, 56).to(memory_format=torch.channels_last)
    w, b = torch.randn(40, 1, kernel, kernel), torch.randn(40)

    def block(x, w, b):
        return F.gelu(F.conv2d(x, w, b, 1, kernel // 2, 1, 40))

    gm = make_fx(block, decomposition_table())(x, w, b)
    source = codegen.generate(gm, [x, w, b], GraphContext(Config(interpret=True), "inference", f"dw{kernel}"))
    path = os.path.join(os.environ["TRITON_CACHE_DIR"], f"dw{kernel}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"dw{kernel}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {k: v for k, v in vars(module).items() if isinstance(v, triton.runtime.jit.JITFunction)}


def compile_s(fn: triton.runtime.jit.JITFunction, xblock: int) -> float:
    signature = {name: "constexpr" if fn.params[i].is_constexpr else "*fp32" if name.endswith("_ptr") else "i32"
                 for i, name in enumerate(fn.arg_names)}
    start = time.perf_counter()
    triton.compile(ASTSource(fn, signature, constexprs={"XBLOCK": xblock}), target=TARGET,
                   options={"num_warps": 4})
    return time.perf_counter() - start


def main() -> None:
    print(f"Triton {triton.__version__}, target {TARGET}; seconds to compile, 4 warps")
    print(f"{'window':8s} {'kernel':44s} " + " ".join(f"XBLOCK {b:>5d}" for b in BLOCKS))
    for kernel in (3, 5, 7):
        for name, fn in kernels(kernel).items():
            times = [compile_s(fn, block) for block in BLOCKS]
            print(f"{kernel}x{kernel:<6d} {name:44s} " + " ".join(f"{t:12.2f}" for t in times))


if __name__ == "__main__":
    main()
