"""Where the host time of Hugging Face's generate path goes, per decode step (issue 55, item 3).

    python benchmarks/probes/probe_hf_host.py [--backend cgtrees|inductor] [--path hf|hf-forward] [--smoke]
        [--generations 6] [--new 64] [--cprofile] [--out FILE]

``serve_worker.HF``'s path (1.1B Llama, bf16, batch 1): generate compiles its decode step with the
backend (``inductor``: generate's own CompileConfig, reduce-overhead's CUDA graph trees). After two
generations (compile, record), each of ``--generations`` more is timed call by call:

- ``ours``: the backend's compiled function, the call Dynamo hands the graph's inputs to (for
  cgtrees: the runtime's replay with its checks, outputs rebuilt);
- ``compiled call``: generate's compiled call, whole (Dynamo's guards and frame, then ours);
- ``guards``: Dynamo's guard check alone, on the last call's own arguments (``guard_manager.check``);
- ``generate``: a generation's wall time per new token, GPU-synchronised at its end only. What is
  not the compiled call is generate's own Python: input preparation, logits processors, stopping
  criteria (whose check waits for the GPU each token), the prefill.

transformers makes a new ``StaticCache`` at every ``generate``: the decode step's cache tensors are
new, so each generation's first call records anew. ``first_call_ms`` is that call, against the
steady calls (the median of the calls after the first two): its excess is the re-recording's cost a
generation.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import serve_worker  # noqa: E402


class Timer:
    """Each call's wall time; the last call's arguments."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last: tuple[tuple, dict] = ((), {})
        self.profiler: cProfile.Profile | None = None  # the steady calls
        self.first_profiler: cProfile.Profile | None = None  # the first call (a generation's recording)

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self.last = (args, kwargs)
            profiling = self.first_profiler if not self.times else self.profiler if len(self.times) >= 2 else None
            if profiling is not None:
                profiling.enable()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - start)
                if profiling is not None:
                    profiling.disable()
        return timed

    def take(self) -> list[float]:
        times, self.times = self.times, []
        return [t * 1e3 for t in times]


def timed_backend(name: str, timer: Timer):
    def compile_fn(gm, example_inputs, **kwargs):
        if name == "inductor":  # generate's CompileConfig hands mode="reduce-overhead"
            inner = torch._TorchCompileInductorWrapper(kwargs.get("mode"), kwargs.get("options"), False)(
                gm, example_inputs)
        else:
            inner = torch._dynamo.lookup_backend(name)(gm, example_inputs, **kwargs)
        return timer.wrap(inner)
    return compile_fn


def guard_us(model: torch.nn.Module, last: tuple[tuple, dict], calls: int = 2000) -> dict:
    """Dynamo's guard check of the compiled call on the last call's arguments, alone. Dynamo skips
    ``nn.Module.__call__``'s frames: the cache entry is on the model's ``forward`` (or a wrapper
    transformers decorates it with), whose locals are its bound arguments."""
    import inspect

    fn = type(model).forward
    while fn is not None:
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
        if entries:
            break
        fn = getattr(fn, "__wrapped__", None)
    if fn is None:
        return {"guard_us": None, "why": "no cache entry on forward or what it wraps"}
    bound = inspect.signature(fn, follow_wrapped=False).bind(model, *last[0], **last[1])
    bound.apply_defaults()
    f_locals = dict(bound.arguments)  # and a decorator's closure (Dynamo's locals hold its free variables)
    f_locals.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    with torch.no_grad():  # as generate calls it (a global-state guard)
        passing = [e for e in entries if e.guard_manager.check(f_locals)]
        if not passing:
            return {"guard_us": None, "cache_entries": len(entries), "function": fn.__qualname__,
                    "why": entries[0].guard_manager.check_verbose(f_locals).verbose_code_parts[:3]}
        guards = passing[0].guard_manager
        start = time.perf_counter()
        for _ in range(calls):
            guards.check(f_locals)
        took = (time.perf_counter() - start) / calls * 1e6
    return {"guard_us": took, "guard_lines": len(guards.code_parts), "cache_entries": len(entries),
            "function": fn.__qualname__}


def runtime_parts() -> dict[str, Timer]:
    """Timers inside ours (cgtrees): the graph function's call (its tree's checks and the replay),
    the node's replay (inputs copied in, the launch, outputs rebuilt) and the graph's launch alone."""
    from cgtrees.runtime import compat, function, manager, node

    timers = {"function_ms": Timer(), "fits_ms": Timer(), "replay_ms": Timer(), "copy_in_ms": Timer(),
              "outputs_ms": Timer(), "launch_ms": Timer()}
    function.GraphFunction.__call__ = timers["function_ms"].wrap(function.GraphFunction.__call__)
    node.GraphNode.replay = timers["replay_ms"].wrap(node.GraphNode.replay)
    node.GraphNode.fits = timers["fits_ms"].wrap(node.GraphNode.fits)
    copy_in = node.GraphNode._copy_in

    def described(graph_node, args):  # what the replay copies in: (shape, dtype, device) of each input
        timers["copy_in_ms"].copied = [[list(args[i].shape), str(args[i].dtype), str(args[i].device)]
                                       for i in graph_node.copy_index]
        return copy_in(graph_node, args)
    node.GraphNode._copy_in = timers["copy_in_ms"].wrap(described)
    node.GraphNode._outputs = timers["outputs_ms"].wrap(node.GraphNode._outputs)
    # a recording's parts (each generation's first call): its module run under capture, the graph's
    # instantiation, its first replay, the pool's checkpoint
    record = {"record_ms": (function.GraphFunction, "_record"),
              "prepare_ms": (manager.TreeManager, "prepare_recording"),
              "plan_inputs_ms": (node.GraphNode, "_plan_inputs"), "capture_ms": (node.GraphNode, "_capture"),
              "capture_end_ms": (torch.cuda.CUDAGraph, "capture_end"),
              "checkpoint_ms": (compat, "get_checkpoint_state"),
              "after_recording_ms": (manager.TreeManager, "after_recording")}
    for name, (owner, attr) in record.items():
        timers[name] = Timer()
        setattr(owner, attr, timers[name].wrap(getattr(owner, attr)))
    replayer = compat.graph_replayer
    compat.graph_replayer = lambda graph: timers["launch_ms"].wrap(replayer(graph))  # graphs recorded from now
    return timers


RECORDING = ("record_ms", "prepare_ms", "plan_inputs_ms", "capture_ms", "capture_end_ms", "checkpoint_ms",
             "after_recording_ms")  # summed over a generation (its first call), not a median


def copies_us(copied: list, calls: int = 2000) -> dict:
    """The replay's copy-in of inputs like ``copied`` ((shape, dtype, device) each), three ways."""
    dtypes = {"torch.int64": torch.int64, "torch.bool": torch.bool, "torch.int32": torch.int32,
              "torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16}
    src = [torch.zeros(shape, dtype=dtypes[d], device=dev) for shape, d, dev in copied]
    dst = [torch.zeros_like(t) for t in src]
    by_dtype: dict = {}
    for d, t in zip(dst, src):
        by_dtype.setdefault(t.dtype, ([], []))
        by_dtype[t.dtype][0].append(d)
        by_dtype[t.dtype][1].append(t)
    dst_bytes = [d.view(-1).view(torch.uint8) for d in dst]
    ways = {"foreach_us": lambda: torch._foreach_copy_(dst, src),
            "foreach_by_dtype_us": lambda: [torch._foreach_copy_(d, t) for d, t in by_dtype.values()],
            "foreach_bytes_us": lambda: torch._foreach_copy_(dst_bytes, [t.view(-1).view(torch.uint8) for t in src]),
            "copy_each_us": lambda: [d.copy_(t) for d, t in zip(dst, src)]}
    out = {}
    for name, way in ways.items():
        way()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            way()
        out[name] = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    return out


def steady(times: list[float]) -> float:
    return statistics.median(times[2:]) if len(times) > 2 else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cgtrees")
    p.add_argument("--path", default="hf", choices=("hf", "hf-forward"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--generations", type=int, default=6)
    p.add_argument("--cprofile", action="store_true", help="also: where the backend's steady calls spend it (cProfile)")
    p.add_argument("--parts", action="store_true", help="cgtrees: time the runtime's layers inside ours")
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = serve_worker.build(a.smoke, device)
    ours, whole = Timer(), Timer()
    parts = runtime_parts() if a.parts and a.backend == "cgtrees" else None
    if a.path == "hf":
        hf = serve_worker.HF(model, "cgtrees", 1, 32 + a.new, a.new)
        hf.kwargs["compile_config"].backend = timed_backend(a.backend, ours)
    else:  # the older path: the model's forward compiled (the prefill too)
        hf = serve_worker.HFForward(model, "cgtrees", 1, 32 + a.new, a.new)
        hf.model.forward = torch.compile(model.forward, backend=timed_backend(a.backend, ours))
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), device=device)
    warm_s = []
    for _ in range(2):  # compile, then record
        start = time.perf_counter()
        hf.generate(prompt)
        serve_worker.sync(device)
        warm_s.append(time.perf_counter() - start)
        print(f"generation {len(warm_s)}: {warm_s[-1]:.1f} s", flush=True)
    if a.path == "hf":
        model._compiled_call = whole.wrap(model._compiled_call)
    else:
        hf.model.forward = whole.wrap(hf.model.forward)
    ours.take()
    for t in (parts or {}).values():
        t.take()
    before = dict(counters["cgtrees"])
    gens = []
    for g in range(a.generations):
        if a.cprofile and g == a.generations - 1:
            ours.profiler, ours.first_profiler = cProfile.Profile(), cProfile.Profile()  # the last generation's
        serve_worker.sync(device)
        start = time.perf_counter()
        hf.generate(prompt)
        serve_worker.sync(device)
        gen_ms = (time.perf_counter() - start) / a.new * 1e3
        mine, calls = ours.take(), whole.take()
        layers = {name: (sum(t.take()) if name in RECORDING else steady(t.take())) for name, t in parts.items()
                  } if parts else {}
        gens.append({"generate_ms": gen_ms, "calls": len(calls), "first_call_ms": calls[0], "first_ours_ms": mine[0],
                     "compiled_call_ms": steady(calls), "ours_ms": steady(mine), **layers})
        print(json.dumps({"generation": g + 3, **{k: round(v, 3) for k, v in gens[-1].items()}}), flush=True)
    med = {k: statistics.median(g[k] for g in gens) for k in gens[0]}
    guards = guard_us(model, whole.last) if a.path == "hf" else {}
    row = {"backend": a.backend, "path": a.path, "new": a.new, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "first_generations_s": warm_s, "generations": gens, "median": med, **guards,
           "split_us": {"generate_python": (med["generate_ms"] - med["compiled_call_ms"]) * 1e3,
                        "dynamo": (med["compiled_call_ms"] - med["ours_ms"]) * 1e3, "ours": med["ours_ms"] * 1e3,
                        "rerecord_ms_per_generation": med["first_call_ms"] - med["compiled_call_ms"]}}
    row["counters"] = {k: v - before.get(k, 0) for k, v in counters["cgtrees"].items() if v != before.get(k, 0)}
    if parts:
        row["copied_inputs"] = getattr(parts["copy_in_ms"], "copied", None)
        if row["copied_inputs"] and device.type == "cuda":
            row["copies_us"] = copies_us(row["copied_inputs"])
    if a.backend == "cgtrees":
        import cgtrees.runtime

        row["describe"] = cgtrees.runtime.describe().splitlines()
    for key, prof in (("cprofile", ours.profiler), ("cprofile_first_call", ours.first_profiler)):
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative" if key == "cprofile_first_call" else "tottime"
                                                       ).print_stats(40)
            row[key] = text.getvalue().splitlines()
    print(json.dumps({k: row[k] for k in ("backend", "median", "split_us", "guard_us") if k in row}))
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
