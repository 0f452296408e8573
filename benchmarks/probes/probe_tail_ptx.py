"""Probe: the PTX of a loss's tail (``codegen/kernel.py``, ``_emit_tail``) for an H100/H200, on any
machine. The interpreter runs programs one after another, so it cannot show how the last program
finds the others' slots; the compiled code can be read instead. This compiles GPT-2's loss forward
(4096 rows x 9001 columns, looped) through cgtrees with the interpreter, takes the tail kernel's text
(the compiled one's, but for the sizes the interpreter needs as constexprs), compiles it for sm_90 with
Triton's own ptxas and prints the instructions that order the tail, as in CUDA's threadfence reduction:
the program's slot stores and the ticket's ``atom.acq_rel.gpu`` under one thread's predicate, the
ticket broadcast through shared memory behind a ``bar.sync``, then ``ld.volatile`` reads of the slots.

    python benchmarks/probes/probe_tail_ptx.py
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COMPILING = len(sys.argv) == 3  # the second process: compile the kernel text it is given
WORK = Path(sys.argv[1]).parent if COMPILING else Path(tempfile.mkdtemp(prefix="tail_ptx_"))
if not COMPILING:  # the interpreter patches triton.language in its process: compile in another one
    os.environ.update(CGTREES_INTERPRET="1", CGTREES_CPU_PIPELINE="1", CGTREES_DEBUG_DIR=str(WORK / "debug"),
                      CGTREES_CACHE="0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROWS, VOCAB = 4096, 9001


def tail_kernel_source() -> tuple[str, str]:
    x, y = torch.randn(ROWS, VOCAB, requires_grad=True), torch.randint(0, VOCAB, (ROWS,))
    torch.compile(lambda x, y: F.cross_entropy(x, y, ignore_index=-100), backend="cgtrees")(x, y)  # a forward
    module = next(p for p in (WORK / "debug").rglob("*.py") if "_ticket" in p.read_text())
    text = module.read_text()
    start = text.index("@triton.jit")
    source = text[start:text.index("\ndef call(args):", start)].rstrip() + "\n"  # the one kernel, a tail's
    name = re.search(r"def (\w+)\(", source).group(1)
    return name, source.replace("rnumel: tl.constexpr", "rnumel").replace("programs: tl.constexpr", "programs")


def ptx(path: Path, name: str) -> str:
    spec = importlib.util.spec_from_file_location("tail_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name)
    signature = {}
    for i, arg in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[arg] = "constexpr"
        elif arg.endswith("_ticket_ptr"):
            signature[arg] = "*i32"
        elif arg.endswith("_ptr"):
            signature[arg] = "*i64" if arg in ("primals_2_ptr", "sum_3_parts_ptr") else "*fp32"
        else:
            signature[arg] = "i32"
    kernel = triton.compile(ASTSource(fn, signature, constexprs={"XBLOCK": 1, "RBLOCK": 2048, "PBLOCK": 1024}),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    return kernel.asm["ptx"]


def main() -> int:
    if not COMPILING:
        name, source = tail_kernel_source()
        path = WORK / "tail_kernel.py"
        path.write_text("import triton\nimport triton.language as tl\n\n" + source + "\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CGTREES_", "TRITON_INTERPRET"))}
        return subprocess.run([sys.executable, __file__, str(path), name], env=env).returncode
    name = sys.argv[2]
    code = ptx(Path(sys.argv[1]), name)
    print(f"{name}: Triton {triton.__version__}, sm_90, 8 warps; the tail's ordering instructions:")
    lines = code.splitlines()
    atom = next(i for i, line in enumerate(lines) if "atom.global" in line)
    for line in lines[atom - 8:atom + 6] + [line for line in lines if "ld.volatile" in line][:2]:
        if line.strip() and not line.strip().startswith(("//", ".loc")):
            print("   ", line.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
