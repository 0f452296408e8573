"""One row of the real-size suite (``real_sizes.py``) in this process; its figures as one JSON file.

    python benchmarks/size_worker.py --model gpt2_small --backend cgtrees --result row.json [--smoke] [--device cpu]

The runner (``size_run.py``) starts one worker per (model, backend), each a fresh process with
fresh cache directories. A worker, in order (``measure_row``):

1. builds the model (seeded) and its inputs; a library that does not import skips the row;
2. runs the eager reference: one eager step from the initial weights, without an optimizer step
   (the weights stay as built): its loss (inference: its output) and a few parameters' gradients
   (the first, last and two between) go to the host, and the gradients are cleared;
3. calls ``torch.compile`` (before the clock: the call imports Dynamo, alike for every backend);
4. times the first 3 steps, each synchronized (``first_step_s``, ``first3_s``); the first step's
   loss and gradients, copied to the host (inside that time) before its optimizer step, give the
   errors against the reference (``loss_abs_err``/``loss_rel_err``, ``out_*`` for inference;
   ``grad_abs_err``/``grad_rel_err``, the worst parameter named in ``worst_grad``, each one in
   ``grad_errors``);
5. runs warm-up steps, then timed steps, each timed alone between ``torch.cuda.synchronize()``
   calls: ``step_ms`` is their median, with ``step_ms_min`` and ``step_ms_max``; ``compile_s`` is
   ``first3_s`` minus 3 x the median step: compilation, warm-up runs and CUDA-graph recording;
6. memory: ``peak_reserved_gb`` is ``torch.cuda.max_memory_reserved()`` from a
   ``reset_peak_memory_stats()`` before the first step through the timed steps. CUDA-graph pools
   are segments of the caching allocator, so reserved counts them. ``peak_allocated_gb``
   (``max_memory_allocated``) leaves out what a replay writes in its pool. ``steady_*_gb``: the
   same over the warm-up and timed steps only, after ``empty_cache()``;
7. on CUDA, profiles a few more steps (``torch.profiler``): device time per step by kernel
   category (``CATEGORIES``), busy time (the union of kernel intervals, so overlapping streams
   count once), idle = the median step minus busy, and the top 10 kernels.

A relative error is the largest absolute difference over the largest magnitude of the reference
(for a loss: over its absolute value). The eager row's errors are eager against itself: the noise
floor of nondeterministic kernels. Under autocast the eager row also compares its reference with
an fp32 step from the same weights (``autocast_loss_rel_err``, ``autocast_grad_rel_err``, ...): the
scale of bf16's rounding, which a compiled row's errors are read against (a randomly initialised
ResNet-50's gradients differ by ~100% between bf16 and fp32 at small batches).

A DDP model (``Spec.world`` > 1) runs as one process per rank started by this worker (rank 0's
figures are the row's, ``rank_step_ms`` has each rank's median); it is skipped without enough
GPUs. ``--smoke`` on a CPU runs it with gloo. Any failure is the row's ``error`` (with the phase it
happened in), never a crash: an out-of-memory row keeps what it measured before.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import measure
import real_sizes
from measure import GENERATED_PREFIXES

COMPILE_ARGS = {"inductor": {}, "reduce-overhead": {"mode": "reduce-overhead"}, "cgtrees": {"backend": "cgtrees"}}
BACKENDS = ("eager", *COMPILE_ARGS)
GRAPH_BACKENDS = ("reduce-overhead", "cgtrees")  # a step begins with cudagraph_mark_step_begin()
GB = 2**30
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Plan:
    warmup: int = 5
    steps: int = 20
    profile_steps: int = 5


SMOKE_PLAN = Plan(warmup=0, steps=2, profile_steps=1)


# --- one step ------------------------------------------------------------------------------------

@dataclass
class Values:
    """The first step's loss (or output) and chosen gradients, on the host."""

    value: torch.Tensor | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)

    def take(self, value: torch.Tensor, chosen: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.value = value.detach().float().cpu()
        self.grads = {name: None if p.grad is None else p.grad.detach().float().cpu() for name, p in chosen}


def chosen_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters whose gradients are compared: the first, the last and two between."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    picks = sorted({0, len(named) // 3, 2 * len(named) // 3, len(named) - 1}) if named else []
    return [named[i] for i in picks]


def make_step(case: real_sizes.Case, fn: Callable, opt: torch.optim.Optimizer | None, mark: bool,
              keep: Values, chosen: list[tuple[str, torch.nn.Parameter]],
              lap: Callable[[str], None] = lambda phase: None) -> Callable[[], None]:
    """One step: forward (and loss) under autocast, backward, optimizer step, zero_grad; the first
    step's value and gradients go to ``keep`` before its optimizer step. ``opt`` None: no update.
    ``lap(phase)`` is called as each phase ends (``host_profile.Phases`` times them)."""
    device_type = next(case.model.parameters()).device.type

    def step() -> None:
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=case.autocast), \
                torch.set_grad_enabled(case.train):
            value = case.forward(fn)
        lap("forward")
        if case.train:
            value.backward()
        if keep.value is None:
            keep.take(value, chosen)
        del value
        lap("backward")
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        lap("optimizer")
    return step


def row_step(model: str, backend: str, lap: Callable[[str], None] = lambda phase: None) -> Callable[[], None]:
    """A real-size row's step as ``measure_row`` runs it, without its reference (for the probes)."""
    case = real_sizes.build(model, torch.device("cuda"))
    mark = backend in GRAPH_BACKENDS
    if mark:  # imports torch._inductor.cudagraph_trees (about a second) before the first step
        torch.compiler.cudagraph_mark_step_begin()
    fn, _ = compile_model(case.model, backend)
    opt = case.optimizer(list(case.model.parameters())) if case.train else None
    return make_step(case, fn, opt, mark, Values(), [], lap)


def reference(case: real_sizes.Case, model: torch.nn.Module, chosen: list[tuple[str, torch.nn.Parameter]]) -> Values:
    """One eager step without an optimizer step (the weights stay as they are), its gradients cleared."""
    want = Values()
    make_step(case, model, None, False, want, chosen)()
    model.zero_grad(set_to_none=True)
    return want


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_model(model: torch.nn.Module, backend: str) -> tuple[Callable, float]:
    """The model as ``backend`` runs it, and the seconds the ``torch.compile`` call took."""
    if backend == "eager":
        return model, 0.0
    if backend not in COMPILE_ARGS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    start = time.perf_counter()
    fn = torch.compile(model, **COMPILE_ARGS[backend])
    return fn, time.perf_counter() - start


# --- the figures -----------------------------------------------------------------------------------

def errors(got: Values, want: Values, train: bool) -> dict:
    """Largest absolute and relative differences from the reference: the loss (or output), and the
    chosen gradients, each relative to the largest magnitude of eager's, at least 1e-3 of the
    largest among them (``measure.relative_errors``: attention's key bias has an analytically zero
    gradient, so eager's is noise); the worst gradient is named."""
    key = "loss" if train else "out"
    found = dict(zip((f"{key}_abs_err", f"{key}_rel_err"), _diff(got.value, want.value), strict=True))
    found["loss"] = want.value.item() if want.value.numel() == 1 else None
    names = [n for n, g in want.grads.items() if g is not None or got.grads.get(n) is not None]
    if names:
        pairs = [(got.grads.get(n), want.grads[n]) for n in names]
        rel = measure.relative_errors(*zip(*pairs, strict=True))
        grads = {n: {"abs": _diff(g, w)[0], "rel": r} for n, (g, w), r in zip(names, pairs, rel, strict=True)}
        worst = max(grads, key=lambda n: grads[n]["rel"])
        found.update(grad_abs_err=max(e["abs"] if e["abs"] is not None else math.inf for e in grads.values()),
                     grad_rel_err=grads[worst]["rel"], worst_grad=worst, grad_errors=grads)
    return found


def _diff(got: torch.Tensor | None, want: torch.Tensor | None) -> tuple[float | None, float | None]:
    if got is None or want is None:
        return None, None
    if got.shape != want.shape:
        return float("inf"), float("inf")
    diff = (got - want).abs().nan_to_num(nan=float("inf")).max().item()
    scale = want.abs().max().item()
    return diff, (0.0 if diff == 0 else diff / scale if scale > 0 else float("inf"))


def first_steps(step: Callable[[], None], device: torch.device) -> dict:
    start, marks = time.perf_counter(), []
    for _ in range(3):
        step()
        sync(device)
        marks.append(time.perf_counter() - start)
    return {"first_step_s": marks[0], "first3_s": marks[2]}


def steady_steps(step: Callable[[], None], device: torch.device, plan: Plan) -> dict:
    for _ in range(plan.warmup):
        step()
    sync(device)
    times = []
    for _ in range(plan.steps):
        start = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {"step_ms": statistics.median(times), "step_ms_min": min(times), "step_ms_max": max(times),
            "step_ms_all": times}


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device: torch.device) -> tuple[float, float] | tuple[None, None]:
    """Peak reserved and allocated GB since the last reset."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_reserved(device) / GB, torch.cuda.max_memory_allocated(device) / GB


# --- the profile -----------------------------------------------------------------------------------

# Kernel categories, tried in order on the kernel's name (lower case; generated kernels by prefix).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "mha_")),
    ("gemm", ("gemm", "gemv", "cublas", "cutlass", "xmma", "nvjet", "wgmma", "splitk", "convolve", "conv2d",
              "dgrad", "wgrad", "fprop")),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "fusedadam", "fused_sgd")),
    ("copies", ("memcpy", "memset", "copy", "fill")),
)
CATEGORY_NAMES = ("gemm", "attention", "generated", "copies", "optimizer", "communication", "other")


def category(name: str) -> str:
    """``generated`` (ours: pw_/red_/...; Inductor's: triton_), else the first of ``CATEGORIES`` one
    of whose words is in the name (GEMMs and convolutions are ``gemm``), else ``other``."""
    if name.startswith(GENERATED_PREFIXES):
        return "generated"
    low = name.lower()
    return next((kind for kind, words in CATEGORIES if any(w in low for w in words)), "other")


TOP_KERNELS = 40
_INDEX = re.compile(r"_\d+$")


def family(name: str) -> str:
    """A generated kernel's name without its index in the module (``pw_fused_mul_sub_7`` and
    ``pw_fused_mul_sub_40`` are one family): one layer's kernel, met once per layer, adds up."""
    return _INDEX.sub("", name) if category(name) == "generated" else name


def kernel_profile(kernels: list[tuple[str, float, float]], steps: int, step_ms: float | None) -> dict:
    """Per step: device ms by category, busy ms (the union of the kernels' intervals), idle ms
    (``step_ms`` minus busy), the top ``TOP_KERNELS`` kernels (ms, launches, category; the report
    shows 10, the file keeps more for reading a miss) and the top ``TOP_KERNELS`` families of
    kernels (``family``: generated kernels summed over their index). ``kernels``: (name,
    start us, end us) of every kernel, copy and memset over ``steps`` steps."""
    by_kind = dict.fromkeys(CATEGORY_NAMES, 0.0)
    by_name: dict[str, list[float]] = {}
    by_family: dict[str, list[float]] = {}
    for name, start, end in kernels:
        by_kind[category(name)] += (end - start) / 1e3 / steps
        for key, totals in ((name, by_name), (family(name), by_family)):
            total = totals.setdefault(key, [0.0, 0])
            total[0] += (end - start) / 1e3 / steps
            total[1] += 1
    busy = _union_us(kernels) / 1e3 / steps
    return {"steps": steps, "categories_ms": by_kind, "busy_ms": busy,
            "idle_ms": None if step_ms is None else max(0.0, step_ms - busy), "kernels": len(kernels) // max(steps, 1),
            "top": _top(by_name, steps), "top_families": _top(by_family, steps)}


def _top(totals: dict[str, list[float]], steps: int) -> list[dict]:
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return [{"name": n[:160], "ms": ms, "launches": count / steps, "category": category(n)} for n, (ms, count) in top]


def _union_us(kernels: list[tuple[str, float, float]]) -> float:
    total, end_so_far = 0.0, float("-inf")
    for _, start, end in sorted(kernels, key=lambda k: k[1]):
        if end > end_so_far:
            total += end - max(start, end_so_far)
            end_so_far = end
    return total


def profile(step: Callable[[], None], device: torch.device, steps: int, step_ms: float | None) -> dict:
    """``kernel_profile`` of ``steps`` more steps. On CUDA the profiler traces the device only (a CPU
    trace of an eager 1B-parameter step is ~10^5 events, which take long to read back); should that
    trace fail or hold no kernel, it runs again with the CPU traced too."""
    from torch.profiler import ProfilerActivity

    if device.type != "cuda":
        return kernel_profile(_kernels(step, device, steps, [ProfilerActivity.CPU]), steps, step_ms)
    try:
        kernels = _kernels(step, device, steps, [ProfilerActivity.CUDA])
    except Exception:
        kernels = []
    if not kernels:
        kernels = _kernels(step, device, steps, [ProfilerActivity.CPU, ProfilerActivity.CUDA])
    return kernel_profile(kernels, steps, step_ms)


def _kernels(step: Callable[[], None], device: torch.device, steps: int, activities: list) -> list:
    """(name, start us, end us) of every device event (kernels, copies, memsets) over ``steps`` steps."""
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda]


# --- a row -----------------------------------------------------------------------------------------

def measure_row(spec: dict, row: dict, phase: Callable[[str], None]) -> None:
    """The module docstring's steps, filling ``row``; raises on failure (``run_row`` records it)."""
    device = torch.device(spec["device"])
    plan = Plan(spec["warmup"], spec["steps"], spec["profile_steps"])
    phase("build")
    case = real_sizes.build(spec["model"], device, spec["smoke"], spec["rank"])
    model = _ddp(case.model, device) if spec["world"] > 1 else case.model
    chosen = chosen_params(model)
    row.update(items_per_step=case.items * spec["world"], unit=case.unit,
               params_m=sum(p.numel() for p in case.model.parameters()) / 1e6)
    phase("eager reference")
    want = reference(case, model, chosen)
    if spec["backend"] == "eager" and case.autocast:  # the scale of bf16's rounding, for reading the errors
        phase("fp32 reference")
        fp32 = reference(dataclasses.replace(case, autocast=False), model, chosen)
        row.update({f"autocast_{k}": v for k, v in errors(want, fp32, case.train).items() if k != "loss"})
    phase("compile call")
    mark = spec["backend"] in GRAPH_BACKENDS
    if mark:  # imports torch._inductor.cudagraph_trees (about a second): the loop's cost, not the backend's
        torch.compiler.cudagraph_mark_step_begin()
    fn, row["compile_call_s"] = compile_model(model, spec["backend"])
    opt = case.optimizer(list(model.parameters())) if case.train else None
    got = Values()
    step = make_step(case, fn, opt, mark, got, chosen)
    phase("first steps")
    reset_memory(device)
    row.update(first_steps(step, device))
    first_reserved, first_allocated = peaks(device)
    row.update(errors(got, want, case.train))
    phase("steady steps")
    reset_memory(device)
    row.update(steady_steps(step, device, plan))
    row["compile_s"] = row["first3_s"] - 3 * row["step_ms"] / 1e3
    row["throughput"] = row["items_per_step"] / (row["step_ms"] / 1e3)
    steady_reserved, steady_allocated = peaks(device)
    if steady_reserved is not None:
        row.update(peak_reserved_gb=max(first_reserved, steady_reserved),
                   peak_allocated_gb=max(first_allocated, steady_allocated),
                   steady_reserved_gb=steady_reserved, steady_allocated_gb=steady_allocated)
    if device.type == "cuda" and plan.profile_steps:
        phase("profile")
        try:  # a profile that fails loses the profile only
            row["profile"] = profile(step, device, plan.profile_steps, row["step_ms"])
        except Exception as exc:
            row["profile_error"] = f"{type(exc).__name__}: {exc}"[:1000]


def _ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def run_row(spec: dict) -> dict:
    """Measure one row; never raises: a failure is the row's ``error``, a missing library a skip."""
    row: dict = {**spec, "status": "error", "ok": False, "error": None}
    phases: dict[str, float] = {}
    now = {"name": "start", "t": time.perf_counter()}

    def phase(name: str) -> None:
        t = time.perf_counter()
        phases[now["name"]] = t - now["t"]
        now.update(name=name, t=t)

    try:
        measure_row(spec, row, phase)
        row.update(status="ok", ok=True)
    except real_sizes.MissingPackage as exc:
        row.update(status="skipped", error=str(exc))
    except Exception as exc:  # out of memory included: the row keeps what it measured
        row.update(error=f"{now['name']}: {type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:])
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            row["peak_reserved_gb"], row["peak_allocated_gb"] = peaks(torch.device(spec["device"]))
    phase("done")
    row["phase_s"] = phases
    row["counters"] = _counters()
    row.update(environment(spec["device"]))
    return row


def _counters() -> dict:
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    return {"cgtrees": dict(counters.get("cgtrees", {})), "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": [str(r)[:300] for r in list(breaks)[:5]],
            "unique_graphs": counters.get("stats", {}).get("unique_graphs", 0),
            "inductor_cudagraph_skips": counters.get("inductor", {}).get("cudagraph_skips", 0)}


def environment(device: str) -> dict:
    versions = {name: getattr(sys.modules.get(name), "__version__", None)
                for name in ("transformers", "timm", "torchvision", "triton")}
    try:
        gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    except Exception as exc:  # no such GPU: the row says so elsewhere
        gpu = f"unknown ({type(exc).__name__})"
    return {"device_name": gpu, "torch": torch.__version__, "python": sys.version.split()[0],
            "versions": versions}


# --- DDP: one process per rank ------------------------------------------------------------------

def run_rank(spec: dict) -> dict:
    """This process is rank ``spec["rank"]`` of a DDP row (started by ``run_ranks``)."""
    import torch.distributed as dist

    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.set_device(spec["rank"])
        spec = {**spec, "device": f"cuda:{spec['rank']}"}
    dist.init_process_group("nccl" if cuda else "gloo", rank=spec["rank"], world_size=spec["world"],
                            **({"device_id": torch.device(spec["device"])} if cuda else {}))
    try:
        return run_row(spec)
    finally:
        dist.destroy_process_group()


def run_ranks(spec: dict, argv: list[str]) -> dict:
    """A DDP row: one process per rank, this worker's arguments plus ``--rank``; rank 0's row, with
    every rank's median step. Skipped without a GPU per rank (a smoke run on the CPU uses gloo)."""
    world = spec["world"]
    gpus = torch.cuda.device_count()
    if spec["device"].startswith("cuda") and gpus < world:
        return {**spec, "status": "skipped", "ok": False,
                "error": f"needs {world} GPUs (torch.cuda.device_count() >= {world}), found {gpus}"}
    if not spec["device"].startswith("cuda") and not spec["smoke"]:
        return {**spec, "status": "skipped", "ok": False,
                "error": f"needs {world} GPUs; a CPU runs it with --smoke only"}
    # NVLink multicast stays off: the device machines set these, and a rank has them whatever we were started with
    env = {**os.environ, **NO_MULTICAST, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world)}
    with tempfile.TemporaryDirectory(prefix="cgtrees-ranks-") as tmp:
        procs, logs = [], [Path(tmp) / f"rank{r}.log" for r in range(world)]
        for rank in range(world):
            cmd = [sys.executable, __file__, *argv, "--rank", str(rank), "--result", f"{tmp}/rank{rank}.json"]
            with open(logs[rank], "w") as log:
                procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                              stdout=log, stderr=subprocess.STDOUT))
        results = [Path(tmp) / f"rank{r}.json" for r in range(world)]
        _wait_all(procs, results)
        rows = [json.loads(p.read_text()) if p.exists() else None for p in results]
        tails = [log.read_text()[-1500:] for log in logs]
    if rows[0] is None:
        return {**spec, "status": "error", "ok": False,
                "error": f"rank 0 wrote no result (exit codes {[p.returncode for p in procs]}): {tails[0]}"}
    row = {**rows[0], "rank_step_ms": [r.get("step_ms") if r else None for r in rows]}
    others = [f"rank {i}: {r['error'] if r else tails[i]}" for i, r in enumerate(rows) if i and not (r and r["ok"])]
    if others:
        row["other_ranks"] = others
    return row


def _wait_all(procs: list[subprocess.Popen], results: list[Path], grace_s: float = 60.0) -> None:
    """Until every rank is done: exited, or wrote its result (it writes it after leaving the process
    group, and may linger in its compile workers' shutdown). Once a rank fails the others get
    ``grace_s``, since a collective may wait forever on a rank that died; what is left is killed."""
    failed_at = None
    while not all(p.poll() is not None or r.exists() for p, r in zip(procs, results, strict=True)):
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.perf_counter()
        if failed_at is not None and time.perf_counter() - failed_at > grace_s:
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    start = time.time()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=real_sizes.MODELS)
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny configs (real_sizes.py), SMOKE_PLAN's steps")
    p.add_argument("--warmup", type=int, default=Plan.warmup)
    p.add_argument("--steps", type=int, default=Plan.steps)
    p.add_argument("--profile-steps", type=int, default=Plan.profile_steps, help="0: no profile")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a DDP rank (run_ranks)
    p.add_argument("--result", help="write the row here (atomically, as the last step)")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.steps, args.profile_steps = SMOKE_PLAN.warmup, SMOKE_PLAN.steps, SMOKE_PLAN.profile_steps
    spec = {"model": args.model, "backend": args.backend, "mode": real_sizes.SUITE[args.model].mode,
            "sizes": real_sizes.SUITE[args.model].sizes, "precision": real_sizes.SUITE[args.model].precision,
            "world": real_sizes.SUITE[args.model].world, "rank": args.rank or 0, "device": args.device,
            "smoke": args.smoke, "warmup": args.warmup, "steps": args.steps, "profile_steps": args.profile_steps}
    if spec["world"] > 1 and args.rank is None:
        row = run_ranks(spec, _without_result(argv))
    elif spec["world"] > 1:
        row = run_rank(spec)
    else:
        row = run_row(spec)
    row["worker_s"] = time.time() - start
    line = json.dumps(row, default=str)
    if args.result:
        Path(args.result + ".tmp").write_text(line)
        os.replace(args.result + ".tmp", args.result)
    else:
        print(line, flush=True)


def _without_result(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--result":
            skip = True
        elif not a.startswith("--result="):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
