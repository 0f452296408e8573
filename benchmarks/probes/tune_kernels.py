"""Sweep each generated kernel's launch settings in place, on the GPU: which ``num_warps`` (and rows
per program, for persistent reductions) would a workload's kernels rather have?

    python benchmarks/probes/tune_kernels.py --workload norm_act --mode train [--out DIR]

Compiles the workload with cgtrees (no CUDA graphs, no cache), keeps the arguments of each kernel
module's first call, then, for one kernel at a time, rewrites its launch in the module's source,
reloads it and times the whole module call (median of CUDA-event windows). The heuristic in
``backend/codegen/heuristics.py`` is read against these tables; nothing here changes it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the suite's modules

import measure  # noqa: E402
import workloads  # noqa: E402

LAUNCH = re.compile(r"^(\s*)(\w+)\[\((.*)\)\]\((.*)\bnum_warps=(\d+)\)$")


def capture(workload: str, mode: str) -> list[tuple[object, list]]:
    """(KernelModule, its first call's arguments) for every module the workload runs."""
    from cgtrees import codegen

    seen: list[tuple[object, list]] = []
    real_call = codegen.KernelModule.call

    def keep(self, args):
        if all(m is not self for m, _ in seen):
            seen.append((self, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
        return real_call(self, args)

    codegen.KernelModule.call = keep
    try:
        model, inputs_fn, loss_fn = workloads.WORKLOADS[workload]()
        model = model.cuda()
        inputs = inputs_fn(torch.device("cuda"))
        compiled = torch.compile(model, backend="cgtrees", options={"cudagraphs": False, "cache": False})
        with torch.set_grad_enabled(mode == "train"):
            out = compiled(*inputs)
            if mode == "train":
                loss_fn(out).backward()
    finally:
        codegen.KernelModule.call = real_call
    return seen


def time_call(module, args: list, windows: int = 7, calls: int = 20) -> float:
    """Median milliseconds of one ``module.call`` (CUDA-event windows, as the benchmark times)."""
    def step() -> None:
        module.call(list(args))

    device = torch.device("cuda")
    for _ in range(3):
        step()
    measure.sync(device)
    return 1e3 * statistics.median(measure.window(step, calls, device) for _ in range(windows))


def variants(line: str) -> list[tuple[str, str]]:
    """(label, rewritten launch line) for the settings worth trying on this launch."""
    m = LAUNCH.match(line)
    if m is None:
        return []
    out = []
    warps = int(m.group(5))
    for w in (2, 4, 8, 16, 32):
        if w != warps:
            out.append((f"num_warps={w}", line.replace(f"num_warps={warps})", f"num_warps={w})")))
    xblock = re.search(r"XBLOCK=(\d+), RBLOCK=(\d+)", line)
    grid = m.group(3)
    # Rows per program, for reductions whose grid is a number (a symbolic grid is left alone).
    if xblock and int(xblock.group(2)) > 1 and re.fullmatch(r"\d+,", grid.strip()):
        x = int(xblock.group(1))
        for nx in (n for n in (x // 2, x * 2) if n >= 1):
            for w in sorted({warps, max(1, warps // 2), min(32, warps * 2)}):
                new = line.replace(f"XBLOCK={x},", f"XBLOCK={nx},").replace(f"num_warps={warps})", f"num_warps={w})")
                out.append((f"XBLOCK={nx} num_warps={w}", new.replace(f"[({grid})]", f"[({_regrid(grid, x, nx)})]")))
    return out


def _outputs(module, args: list) -> list:
    out = module.call(list(args))
    return [o.clone() if isinstance(o, torch.Tensor) else o for o in (out if isinstance(out, (list, tuple)) else [out])]


def _same(a: list, b: list) -> bool:
    return all(torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True) if isinstance(x, torch.Tensor) else True
               for x, y in zip(a, b))


def _regrid(grid: str, old: int, new: int) -> str:
    """Grids are written as ``(n,)`` with n = ceil(rows / XBLOCK); recompute for the new XBLOCK."""
    n = int(grid.rstrip(",").strip())
    rows = n * old
    return f"{-(-rows // new)},"


def sweep(module, args: list, out_dir: str | None) -> list[str]:
    from cgtrees import codegen
    from cgtrees.config import Config
    from cgtrees.context import GraphContext

    ctx = GraphContext(config=Config.resolve(options={"cudagraphs": False, "cache": False}), kind="forward",
                       name=module.name + "_tune", static_input_indices=(), mutated_input_indices=(), pair=None)
    expected = _outputs(module, args)
    base = time_call(module, args)
    rows = [f"{module.name}: {base:.3f} ms as generated"]
    lines = module.source.splitlines()
    for i, line in enumerate(lines):
        launch = LAUNCH.match(line)
        kernel = launch.group(2) if launch else ""
        for label, new in variants(line):
            source = "\n".join(lines[:i] + [new] + lines[i + 1:])
            try:
                variant = codegen.load(source, ctx)
                if not _same(expected, _outputs(variant, args)):
                    rows.append(f"  {kernel}: {label}: WRONG RESULT")
                    continue
                ms = time_call(variant, args)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a row too
                rows.append(f"  {kernel}: {label}: failed ({type(exc).__name__})")
                continue
            rows.append(f"  {kernel}: {label}: {ms:.3f} ms ({ms / base:.2f}x)")
    if out_dir:
        with open(os.path.join(out_dir, f"{module.name}.py"), "w") as f:
            f.write(module.source)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, choices=sorted(workloads.WORKLOADS))
    p.add_argument("--mode", default="train", choices=("infer", "train"))
    p.add_argument("--out", help="write each module's source here")
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    for module, module_args in capture(args.workload, args.mode):
        if getattr(module, "source", None):
            print("\n".join(sweep(module, module_args, args.out)), flush=True)


if __name__ == "__main__":
    main()
