"""Dynamo's guard time a decode step (issue 45: "measure Dynamo's guard time per step and report it").

    python benchmarks/probes/probe_guard_time.py [--smoke] [--device cpu|cuda] [--backend eager]

Before each call of a compiled function Dynamo checks the guards of its cache entry (every input
tensor's dtype, device, sizes and strides, the module's attributes, ...): host time on every decode
step, whatever the backend, since the guards are Dynamo's. This compiles ``serve_worker.Loop``'s
decode step (the 1.1B Llama's shape, bf16) with ``--backend`` (default ``eager``: no kernels needed,
the guards are the same), then times ``guard_manager.check`` on the step's own arguments, and counts
the guard lines. The figure is host time on this machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import serve_worker  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="eager")
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    device = torch.device(a.device)
    model = serve_worker.build(a.smoke, device)
    loop = serve_worker.Loop(model, "eager", 1, 40 if a.smoke else 160, 8)
    loop.step = torch.compile(loop.decode, backend=a.backend, fullgraph=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, loop.prompt_len), device=device)
    start = time.perf_counter()
    loop.generate(prompt)
    compile_s = time.perf_counter() - start
    (entry, *rest) = torch._dynamo.eval_frame._debug_get_cache_entry_list(serve_worker.Loop.decode.__code__)
    guards = entry.guard_manager
    f_locals = {"self": loop, "ids": loop.cur, "pos": loop.pos}
    with torch.no_grad():  # as the step runs (a global-state guard)
        assert guards.check(f_locals), guards.check_verbose(f_locals)
        start = time.perf_counter()
        for _ in range(a.calls):
            guards.check(f_locals)
        guard_us = (time.perf_counter() - start) / a.calls * 1e6
    result = {"guard_us": guard_us, "guard_lines": len(guards.code_parts), "cache_entries": 1 + len(rest),
              "compile_s": compile_s, "device": str(device), "torch": torch.__version__,
              "cpu": _cpu(), "model": "smoke" if a.smoke else "llama 1.1B (TinyLlama's shape)"}
    print(json.dumps(result))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    main()
