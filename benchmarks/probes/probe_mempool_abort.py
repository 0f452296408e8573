"""Why ``torch.cuda.MemPool`` aborted warmups in the GPU suite (H200): each case runs in a child
process and prints its exit code and the last lines of its stderr (the C++ message before the abort).

    python benchmarks/probes/probe_mempool_abort.py
"""

from __future__ import annotations

import subprocess
import sys

CASES = {
    "output kept, one thread": """
import torch
x = torch.randn(1024, device="cuda")
with torch.cuda.use_mem_pool(torch.cuda.MemPool(), 0):
    y = x * 2
torch.cuda.synchronize(); print("ok", y.sum().item())
""",
    "nothing kept, one thread": """
import torch
x = torch.randn(1024, device="cuda")
with torch.cuda.use_mem_pool(torch.cuda.MemPool(), 0):
    (x * 2).sum().item()
print("ok")
""",
    "released id (ours), output kept, capture after": """
import torch
x = torch.randn(1 << 20, device="cuda")
pool = torch.cuda.graph_pool_handle()
torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
y = x * 2
torch._C._cuda_endAllocateToPool(0, pool); torch._C._cuda_releasePool(0, pool)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    z = x + 1
g.replay(); del y; torch.cuda.empty_cache(); torch.cuda.synchronize(); print("ok", z.sum().item())
""",
}

for name, code in CASES.items():
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    tail = " | ".join(line for line in done.stderr.strip().splitlines()[-4:])
    print(f"{name}: rc={done.returncode} out={done.stdout.strip()!r} err={tail[-600:]!r}", flush=True)
