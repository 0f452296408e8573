"""ViT's first LayerNorm (issue 18): fused with the patch embedding's ``flatten(2).transpose(1, 2)``,
the cls-token ``cat`` and the pos-embed add, it reads the convolution output with stride 1 along a
kept dimension (the tokens) and stride 196 along the reduced one (the channels); its other loads
and its stores are contiguous along the channels.

Which way Triton lays out that load is decided by its coalescing pass from the contiguity that its
axis analysis proves for each pointer. ``x1 = xindex % 197`` proves none along the tokens (197 is
odd) and ``r0 * 196`` none along the channels: a tie, which Triton 3.6 breaks towards dimension 0,
so the strided load gets lanes along the tokens (``threadsPerWarp = [32, 1]``, order ``[0, 1]``) and
a layout conversion through shared memory joins it to the channel-fast values: coalesced on both
sides. The test below compiles the kernel that a GPU would get to TTGIR for sm_90 (no GPU needed)
and checks that layout, so that a Triton whose tie goes the other way (lanes along the channels:
one sector per lane) fails here rather than only in a profile. Values and gradients run through
the interpreter against eager.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees.aot.decompositions import decomposition_table

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tier: runs kernels through Triton's interpreter")

D, TOKENS = 192, 197  # vit_tiny: 14x14 patches and the cls token, 192 channels


class PatchEmbedNorm(nn.Module):
    """The front of timm's vit_tiny_patch16_224 up to its first block's first LayerNorm, and an MLP
    after it (as in the block) so that the norm's output is used by more than a return."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, D, 16, 16)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, TOKENS, D))
        self.norm = nn.LayerNorm(D, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        with torch.no_grad():  # not the default ones and zeros: their gradients would hide mistakes
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.proj(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def first_norm(conv: torch.Tensor, cls: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    """The fused part alone, from the convolution's output (NCHW, as aten returns it)."""
    x = torch.cat([cls.expand(conv.shape[0], -1, -1), conv.flatten(2).transpose(1, 2)], 1) + pos
    return x, F.layer_norm(x, (D,), w, b, 1e-6)


def test_vit_first_layernorm_values_and_gradients_match_eager():
    model = PatchEmbedNorm()
    reference = copy.deepcopy(model)
    image = torch.randn(2, 3, 224, 224)
    ours_in, ref_in = image.clone().requires_grad_(), image.clone().requires_grad_()
    out, expected = torch.compile(model, backend="cgtrees")(ours_in), reference(ref_in)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, atol=1e-5, rtol=1e-4)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=f"grad of {name}")


# ------------------------------------------------------------------------ what a GPU would get
def gpu_kernel(batch: int) -> tuple[str, str]:
    """The fused norm's kernel source as compiled (not interpreted) code gets it, and its launch."""
    from cgtrees.codegen import wrapper
    from cgtrees.codegen.graph import GraphLowerer
    from cgtrees.codegen.scheduler import schedule
    from cgtrees.config import Config

    inputs = (torch.empty(batch, D, 14, 14), torch.empty(1, 1, D), torch.empty(1, TOKENS, D), torch.empty(D),
              torch.empty(D))
    gm = make_fx(first_norm, decomposition_table=decomposition_table(), tracing_mode="fake")(*inputs)
    program = GraphLowerer(gm, Config(interpret=False)).run()
    source = wrapper.module_source(["# test"], program, schedule(program), False).source
    kernels = re.findall(r"@triton\.jit\n(def red_\w+\(.*?)\n\n", source, re.S)
    assert len(kernels) == 1, source  # cat, add and the norm in one kernel
    name = re.match(r"def (\w+)\(", kernels[0]).group(1)
    launch = re.search(rf"^\s*{name}\[.*$", source, re.M).group(0)
    return kernels[0], launch


def conv_load(kernel: str) -> tuple[str, str]:
    """The variable that loads the convolution output, and its offset expression."""
    match = re.search(r"(tmp\d+) = tl\.load\(conv_1_ptr \+ \((.*?)\), ", kernel)
    assert match, kernel
    return match.group(1), match.group(2)


def test_strided_input_walks_tokens_with_stride_one_and_channels_with_stride_196():
    kernel, launch = gpu_kernel(32)
    _, offset = conv_load(kernel)
    assert set(offset.replace(" ", "").split("+")) == {"r0*196", "x0*37632", "x1-1"}, offset
    assert "x1 = xindex % 197" in kernel and "r0 = rindex" in kernel, kernel
    # 32 tokens per program: a warp's lanes walk 32 adjacent tokens (128 bytes) of one channel
    assert "XBLOCK=32, RBLOCK=256, num_warps=8" in launch, launch


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernel import KERNEL

signature, constexprs, attrs, num_warps = json.load(open(sys.argv[1]))
attrs = {(int(i),): [["tt.divisibility", 16]] for i in attrs}
try:
    compiled = triton.compile(ASTSource(KERNEL, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})
except Exception as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(3)
print(compiled.asm["ttgir"])
"""


def _ttgir(kernel: str, launch: str, folder: Path) -> str:
    """``kernel`` compiled by Triton's NVIDIA backend for sm_90 down to TTGIR (no GPU needed), with
    the argument specialization of ``launch`` (16-byte aligned pointers, sizes divisible by 16). In a
    process of its own: this one runs Triton's interpreter, which compiled kernels must not meet."""
    name = re.match(r"def (\w+)\(", kernel).group(1)
    (folder / "kernel.py").write_text(
        f"import triton\nimport triton.language as tl\n\n\n@triton.jit\n{kernel}\n\n\nKERNEL = {name}\n")
    params = re.match(r"def \w+\((.*)\):", kernel).group(1).split(", ")
    meta = dict(re.findall(r"(\w+)=(\d+)", launch))
    sizes = [int(a) for a in re.findall(r"\b(\d+)\b", launch.split("](")[1].split("XBLOCK")[0])]
    signature, constexprs, aligned = {}, {}, []
    for i, p in enumerate(params):
        p = p.split(":")[0].strip()
        if p in meta:
            signature[p], constexprs[p] = "constexpr", int(meta[p])
        elif p.endswith("_ptr"):
            signature[p] = "*fp32"
            aligned.append(i)
        else:
            signature[p] = "i32"
            if sizes.pop(0) % 16 == 0:
                aligned.append(i)
    (folder / "args.json").write_text(json.dumps([signature, constexprs, aligned, int(meta["num_warps"])]))
    (folder / "compile.py").write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(folder / "compile.py"), str(folder / "args.json")], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        pytest.skip(f"Triton cannot compile for sm_90 here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    return done.stdout


def _layout_of_load(ttgir: str, var: str) -> dict[str, list[int]]:
    match = re.search(rf"%{var}(?:_\d+)? = tt\.load [^\n]*: tensor<[^,]*, #(blocked\d*)>", ttgir)
    assert match, ttgir
    definition = re.search(rf"^#{match.group(1)} = #ttg\.blocked<\{{(.*)\}}>", ttgir, re.M).group(1)
    return {k: [int(v) for v in vs.split(",")] for k, vs in re.findall(r"(\w+) = \[([\d, ]+)\]", definition)}


def test_strided_input_is_laid_out_with_lanes_along_the_tokens(tmp_path):
    """In the TTGIR, the convolution output's load puts a warp's lanes on adjacent tokens (dim 0,
    stride 1 in memory: at least 8 of them, one 32-byte sector of float32) and the
    channel-contiguous loads keep theirs on the channels (dim 1)."""
    kernel, launch = gpu_kernel(32)
    ttgir = _ttgir(kernel, launch, tmp_path)
    var, _ = conv_load(kernel)
    strided = _layout_of_load(ttgir, var)
    assert strided["order"][0] == 0 and strided["threadsPerWarp"][0] >= 8, strided
    pos_var = re.search(r"(tmp\d+) = tl\.load\(pos_1_ptr", kernel).group(1)
    rows = _layout_of_load(ttgir, pos_var)
    assert rows["order"][0] == 1 and rows["threadsPerWarp"] == [1, 32], rows
