"""Two-process data-parallel runs for tests/test_distributed.py (gloo, CPU) and
tests/gpu/test_distributed_gpu.py (NCCL, one GPU a rank).

``run_cases(cases, device, env)`` spawns two ranks; each trains, for every case, the same model
twice on the same data: once in eager (DDP, or FSDP2 for the fsdp cases), once with cgtrees in the
case's pattern. After each backward it measures every parameter's gradient against eager's, and
after the last step every parameter; it returns, per rank and case, a ``Report``: the largest
absolute difference and the largest absolute reference value per (step, parameter), the cgtrees
counters of the compiled run and ``cgtrees.runtime.describe()`` after it (its CUDA graph trees).
Errors are measured in the ranks and only numbers and text come back.

Cases (``CASES``), each a pattern of the issue:
- ``ddp_of_compiled``: ``DDP(torch.compile(mlp))``, the issue's 4-layer 64-wide MLP, default buckets.
- ``bucket_view``: the same with ``gradient_as_bucket_view=True`` (``.grad`` becomes DDP's bucket).
- ``no_sync``: the same, accumulating two micro-batches a step, the first under ``no_sync()``.
- ``compiled_ddp``: ``torch.compile(DDP(mlp))`` with the forward a user's module (Dynamo does not
  start a frame inside ``torch.nn``: a ``Sequential`` under a compiled DDP gives no backend a graph).
- ``compiled_ddp_buckets`` / ``ddp_of_compiled_buckets``: a 4-layer 512-wide MLP (a layer is just
  over 1 MiB, DDP's first-bucket size) with ``bucket_cap_mb=1``: DDPOptimizer splits the graph into
  4 pieces, one per bucket; the compiled-DDP case also runs an eval forward under ``no_grad``.
- ``fsdp2_root`` / ``fsdp2_layers``: ``fully_shard`` on the root only, or on every Linear too
  (then FSDP's hooks, which Dynamo does not trace, break the graph at every layer).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WORLD = 2
STEPS = 3
LR = 0.05


@dataclasses.dataclass
class Report:
    grads: dict[tuple[int, str], tuple[float, float]]  # (step, name) -> (max |diff|, max |eager|)
    params: dict[str, tuple[float, float]]  # after the last step
    counters: dict[str, int]
    eval_diff: tuple[float, float] | None = None  # no_grad forward after training, where a case runs one
    describe: str = ""  # cgtrees.runtime.describe() after the compiled run (its trees on CUDA)


class UserMLP(nn.Module):
    """A forward of the user's own (Dynamo starts frames here, not inside ``torch.nn``)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class UnrolledMLP(UserMLP):
    """No loop: a graph break inside a loop makes Dynamo run the whole frame eagerly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c, d, e, f, g, h = self.layers
        return h(g(f(e(d(c(b(a(x))))))))


def mlp(width: int, kind: str, device: str) -> nn.Module:
    torch.manual_seed(0)  # the same weights on both ranks and in both runs
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    cls = {"sequential": lambda ls: nn.Sequential(*ls), "user": UserMLP, "unrolled": UnrolledMLP}[kind]
    return cls(layers).to(device)


@dataclasses.dataclass(frozen=True)
class Case:
    pattern: str  # "ddp_of_compiled", "compiled_ddp" or "fsdp2"
    width: int = 64
    kind: str = "sequential"
    ddp: tuple[tuple[str, Any], ...] = ()  # DDP keyword arguments
    no_sync: bool = False
    shard_layers: bool = False
    eval_forward: bool = False


CASES = {
    "ddp_of_compiled": Case("ddp_of_compiled"),
    "bucket_view": Case("ddp_of_compiled", ddp=(("gradient_as_bucket_view", True),)),
    "no_sync": Case("ddp_of_compiled", no_sync=True),
    "compiled_ddp": Case("compiled_ddp", kind="user"),
    "compiled_ddp_buckets": Case("compiled_ddp", width=512, kind="user", ddp=(("bucket_cap_mb", 1),),
                                 eval_forward=True),
    "ddp_of_compiled_buckets": Case("ddp_of_compiled", width=512, ddp=(("bucket_cap_mb", 1),)),
    "fsdp2_root": Case("fsdp2", kind="user"),
    "fsdp2_layers": Case("fsdp2", kind="unrolled", shard_layers=True),
}


# ---------------------------------------------------------------------------------- in each rank
def _wrap(case: Case, model: nn.Module, compiled: bool, device: str) -> tuple[nn.Module, Callable[..., Any]]:
    """(the module whose parameters train, the callable that runs a step's forward)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    kwargs = dict(case.ddp)
    if device == "cuda":
        kwargs["device_ids"] = [torch.cuda.current_device()]
    if case.pattern == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (WORLD,))
        if case.shard_layers:
            for layer in model.layers:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.compile(model, backend="cgtrees") if compiled else model
    if not compiled:
        ddp = DDP(model, **kwargs)
        return ddp, ddp
    if case.pattern == "ddp_of_compiled":
        ddp = DDP(torch.compile(model, backend="cgtrees"), **kwargs)
        return ddp, ddp
    ddp = DDP(model, **kwargs)
    return ddp, torch.compile(ddp, backend="cgtrees")


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):  # FSDP2: a DTensor shard
            g = g.full_tensor()
        out[name.replace("_orig_mod.", "").replace("module.", "")] = None if g is None else g.detach().clone()
    return out


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        v = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_orig_mod.", "").replace("module.", "")] = v.detach().clone()
    return out


def _train(case: Case, compiled: bool, batches: list[list[torch.Tensor]], device: str) -> dict[str, Any]:
    from cgtrees import runtime

    model = mlp(case.width, case.kind, device)
    owner, step_fn = _wrap(case, model, compiled, device)
    opt = torch.optim.SGD(owner.parameters(), lr=LR)
    grads = []
    for micro in batches:
        opt.zero_grad()
        for i, x in enumerate(micro):
            last = i == len(micro) - 1
            if case.no_sync and not last:
                with owner.no_sync():
                    step_fn(x).square().mean().backward()
            else:
                step_fn(x).square().mean().backward()
        grads.append(_grads(owner))
        opt.step()
    out: dict[str, Any] = {"grads": grads, "params": _params(owner)}
    if case.eval_forward:
        with torch.no_grad():
            for _ in range(3):  # on CUDA: warmup, record, replay
                out["eval"] = step_fn(batches[0][0]).detach().clone()
    out["describe"] = runtime.describe()
    return out


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float]:
    if a is None or b is None:
        return (0.0, 0.0) if a is None and b is None else (float("inf"), 0.0)
    return (a.float() - b.float()).abs().max().item(), b.abs().max().item()


def run_case(name: str, rank: int, device: str, steps: int) -> Report:
    from torch._dynamo.utils import counters

    case = CASES[name]
    torch._dynamo.reset()
    counters["cgtrees"].clear()
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data: DDP must average
    micro = 2 if case.no_sync else 1
    batches = [[torch.randn(16, case.width, generator=gen).to(device) for _ in range(micro)] for _ in range(steps)]
    eager = _train(case, False, batches, device)
    cg = _train(case, True, batches, device)
    grads = {(s, n): _diff(cg["grads"][s][n], g) for s, step in enumerate(eager["grads"]) for n, g in step.items()}
    params = {n: _diff(cg["params"][n], p) for n, p in eager["params"].items()}
    eval_diff = _diff(cg["eval"], eager["eval"]) if case.eval_forward else None
    return Report(grads, params, dict(counters["cgtrees"]), eval_diff, cg["describe"])


def _worker(rank: int, port: int, cases: list[str], device: str, env: dict[str, str], out_dir: str,
            steps: int, backend_root: str | None = None) -> None:
    if backend_root is not None:  # before anything imports it
        sys.path.insert(0, backend_root)
    os.environ.update(env)  # before anything compiles (CGTREES_INTERPRET decides how kernels load)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=WORLD)
    try:
        reports = {name: run_case(name, rank, device, steps) for name in cases}
        torch.save({n: dataclasses.asdict(r) for n, r in reports.items()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------- in the test
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(cases: list[str], device: str, env: dict[str, str], timeout_s: float,
              steps: int = STEPS, backend_root: str | None = None) -> list[dict[str, Report]]:
    """Both ranks' reports, per case. A rank that fails raises here with its traceback; a run past
    ``timeout_s`` is killed and raises TimeoutError. ``backend_root``: the directory the ranks
    import ``backend`` from (a snapshot: the cache key hashes our source), else the usual one."""
    with tempfile.TemporaryDirectory() as out_dir:
        args = (free_port(), cases, device, env, out_dir, steps, backend_root)
        ctx = mp.start_processes(_worker, args=args, nprocs=WORLD,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the two ranks ran past {timeout_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        loaded = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    return [{n: Report(**d) for n, d in ranks.items()} for ranks in loaded]


def assert_close_reports(report: Report, rel_tol: float, what: str) -> None:
    """Every gradient of every step, every parameter after the steps, within ``rel_tol`` of the
    tensor's own largest eager value."""
    for (step, name), (diff, scale) in sorted(report.grads.items()):
        assert diff <= rel_tol * scale, f"{what}: step {step} gradient of {name}: max |diff| {diff:.3g}, " \
                                        f"max |eager| {scale:.3g}"
    for name, (diff, scale) in sorted(report.params.items()):
        assert diff <= rel_tol * scale, f"{what}: {name} after the last step: max |diff| {diff:.3g}, " \
                                        f"max |eager| {scale:.3g}"
    if report.eval_diff is not None:
        diff, scale = report.eval_diff
        assert diff <= rel_tol * scale, f"{what}: eval forward: max |diff| {diff:.3g}, max |eager| {scale:.3g}"
