"""Measure one (workload, backend, mode) in this process and print one JSON line.

    python benchmarks/worker.py --workload mlp_small --backend cgtrees --mode infer [--device cuda]

The runner starts one worker per row, in a fresh process, with the cache directories it chose in
the environment. ``run_row`` is also called in-process by the ``--smoke`` run. A failure is
reported in the row (``error``), with whatever figures were measured before it.

A backend named ``<backend>-ca`` (training only; ``backend_names.py``) is ``<backend>`` with the
backward captured by compiled autograd and compiled by the same backend and mode (issue 20). It is
turned on with ``torch._dynamo.compiled_autograd._enable(compiler)`` around ``loss.backward()``, not
with ``torch._dynamo.config.compiled_autograd``: the config flag only takes effect when
``backward()`` runs inside a compiled frame, so the loss and backward would have to move into one
compiled step function, and the row would measure a different step from the other train rows. The
context manager keeps the step as it is: the compiled model, the loss outside it, the backward,
eager SGD.

A backend named ``<backend>-pc`` (issue 19; ``backend_names.py``) is ``<backend>`` with Dynamo's
caching precompile on: a warm process installs the saved guards and bytecode instead of tracing.
``cgtrees-pc`` needs ``CGTREES_PRECOMPILE_CACHE=1`` in the environment (the runner sets it; cgtrees
saves Dynamo's cache at each graph's first call, inside the timed calls); ``inductor-pc`` sets
``torch._dynamo.config.caching_precompile`` here, before torch.compile, and saves Dynamo's cache
after the first outputs (untimed; ``dynamo_cache_save`` in the row says whether it could). Either
row records whether the warm process used the cache: Dynamo's ``dynamo_cache_hit``, ``_miss`` and
``_error``, and for cgtrees the graphs it compiled and the saved functions it loaded. A path that
fails or falls back is in the row, never a crash of the run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import measure
import workloads
from backend_names import CA_BACKENDS, PC_BACKENDS, base, is_ca, is_pc, worker_env

GRAPH_BACKENDS = {"reduce-overhead", "cudagraphs", "cgtrees", "raw_graph", "reduce-overhead-ca", "cgtrees-ca",
                  "cgtrees-pc"}
BACKENDS = ("eager", "inductor", "reduce-overhead", "cudagraphs", "cgtrees", "raw_graph", *CA_BACKENDS,
            *PC_BACKENDS)
COMPILE_ARGS = {"inductor": {}, "reduce-overhead": {"mode": "reduce-overhead"},
                "cudagraphs": {"backend": "cudagraphs"}, "cgtrees": {"backend": "cgtrees"}}


def compile_model(model: torch.nn.Module, backend: str) -> Callable:
    """The model as the backend runs it (raw_graph is built by ``raw_graph_call``)."""
    if backend == "eager":
        return model
    if backend not in BACKENDS or base(backend) not in COMPILE_ARGS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    use_dynamo_cache(backend)
    return torch.compile(model, **COMPILE_ARGS[base(backend)])


def ready_to_compile(backend: str) -> None:
    """Before the clock starts, what the first outputs were timed after until the clock moved to the
    torch.compile call: importing Dynamo (about 2 s on the device machine, for every backend alike),
    looking the backend up, Inductor's wrapper importing its modules (0.5 s). A torch.compile of a
    function never called does it; the model's own torch.compile is then what the clock sees."""
    if backend in BACKENDS and base(backend) in COMPILE_ARGS:
        from torch._dynamo.utils import counters

        before = dict(counters["dynamo_cache"])
        torch.compile(_never_called, **COMPILE_ARGS[base(backend)])
        counters["dynamo_cache"] = collections.Counter(before)  # not the row's: its looking up this one in the cache


def _never_called() -> None:
    raise AssertionError("only compiled, to import what torch.compile needs")


def use_dynamo_cache(backend: str) -> None:
    """A ``-pc`` backend: Dynamo's caching precompile in force before torch.compile (Dynamo decides
    on its cache when torch.compile is called). cgtrees turns it on itself as torch.compile looks
    it up, given ``CGTREES_PRECOMPILE_CACHE=1`` (``backend_names.worker_env``): without it the row
    fails rather than measure a plain warm start under the -pc name."""
    if not is_pc(backend):
        return
    missing = {k: v for k, v in worker_env(backend).items() if os.environ.get(k) != v}
    if missing:
        raise RuntimeError(f"{backend} needs {missing} in the worker's environment (run.py sets it)")
    if base(backend) != "cgtrees":
        torch._dynamo.config.caching_precompile = True


def save_dynamo_cache(backend: str) -> str | None:
    """``inductor-pc``: write Dynamo's cache (guards, bytecode, Inductor's bundled artifacts), as a
    user of Inductor's caching precompile does with ``torch.compiler.save_cache_artifacts()``.
    "ok", or what failed; None for other backends (cgtrees saves at each graph's first call)."""
    if not is_pc(backend) or base(backend) == "cgtrees":
        return None
    try:
        torch.compiler.save_cache_artifacts()
    except Exception as exc:  # the row says so: a warm row then shows the miss
        return f"failed: {type(exc).__name__}: {exc}"[:500]
    return "ok"


def backward_call(backend: str) -> Callable[[torch.Tensor], None]:
    """``loss.backward()`` as the backend runs it: under compiled autograd for a ``-ca`` backend,
    the captured backward compiled by the same backend and mode (one compiler for every step)."""
    if not is_ca(backend):
        return torch.Tensor.backward
    compiler = torch.compile(**COMPILE_ARGS[base(backend)])

    def backward(loss: torch.Tensor) -> None:
        with torch._dynamo.compiled_autograd._enable(compiler):
            loss.backward()
    return backward


def raw_graph_call(model: torch.nn.Module, inputs: tuple) -> Callable:
    """The per-call floor: one ``torch.cuda.CUDAGraph`` of the whole model, replayed.

    The first call warms up on a side stream, captures, and replays; later calls only replay.
    The inputs never change between calls, so they serve as the graph's static inputs.
    """
    state: dict = {}

    def call(*_: object) -> torch.Tensor:
        if "graph" not in state:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):
                state["out"] = model(*inputs)
        state["graph"].replay()
        return state["out"]

    return call


@dataclass
class Kept:
    """What the first step produced, cloned, to compare with eager's first step. The first step
    clones on the device (a copy to the host would add its transfer to the first outputs' time);
    ``to_host`` moves the clones out before the steady state, where they would count in every
    step's peak allocated, and the allocator may serve the same clone from a larger cached block
    in one process than in another (a 3 MB gradient in a 4 MB block: 1-3 MB between backends on
    GPT-2 and Llama).

    ``outputs``: the model's output (infer), or the loss and the model's output (train);
    ``grads``: each parameter's gradient after the first backward, named in ``names``;
    ``compile_s``: the seconds ``torch.compile`` itself took. With Dynamo's caching precompile on,
    that call loads and installs the saved entry (guards, bytecode and the backend's artifacts), so
    it is part of the first outputs' time.
    """

    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    train: bool = False
    compile_s: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.outputs)

    def to_host(self) -> None:
        self.outputs = [_on_host(t) for t in self.outputs]
        self.grads = [_on_host(t) for t in self.grads]

    def absolute(self) -> list[torch.Tensor | None]:
        """The tensors of ``max_err``: the output (infer), the loss and the gradients (train)."""
        return [self.outputs[0], *self.grads] if self.train else self.outputs


def infer_step(fn: Callable, inputs: tuple, mark: bool, keep: Kept) -> Callable[[], None]:
    """One inference call; the first output is cloned into ``keep`` for the error check."""
    def step() -> None:
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            out = fn(*inputs)
        if not keep:
            keep.outputs.append(_clone(out))
    return step


def train_step(fn: Callable, inputs: tuple, loss_fn: Callable, model: torch.nn.Module,
               mark: bool, keep: Kept, backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
               ) -> Callable[[], None]:
    """Forward, loss, ``backward(loss)``, eager SGD step, zero_grad; the first loss, output and grads
    go to ``keep``."""
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = torch.optim.SGD(params, lr=1e-3)
    keep.train = True

    def step() -> None:
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        out = fn(*inputs)
        first_out = None if keep else _clone(out)
        loss = loss_fn(out)
        del out  # held no longer than before: only what the loss's backward saves
        backward(loss)
        if not keep:
            keep.outputs.extend([_clone(loss), first_out])
            keep.grads.extend(_clone(p.grad) for p in params)
            keep.names.extend(name for name, _ in named)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _on_host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


def make_step(spec: dict, device: torch.device, keep: Kept) -> Callable[[], None]:
    """Build the workload (seeded), put it on the device, and wrap one call of it as a step."""
    model, input_fn, loss_fn = workloads.build(spec["workload"], smoke=spec["smoke"])
    model.to(device).train(spec["mode"] == "train")
    inputs = input_fn(device)
    backend = spec["backend"]
    if backend == "raw_graph":
        if spec["mode"] != "infer" or device.type != "cuda":
            raise RuntimeError("raw_graph is an inference floor and needs CUDA")
        fn = raw_graph_call(model, inputs)
    mark = backend in GRAPH_BACKENDS and backend != "raw_graph"
    if mark:
        # The first call imports torch._inductor.cudagraph_trees (about a second): that is the
        # benchmark loop's cost, not the backend's, so it is paid here, before any timing. Before
        # the compile call, not between it and the first outputs: what the compile call leaves to
        # do (Python's collector, due after a warm load's objects) then falls in the timed calls.
        torch.compiler.cudagraph_mark_step_begin()
    if backend != "raw_graph":
        ready_to_compile(backend)
        start = time.perf_counter()
        fn = compile_model(model, backend)
        keep.compile_s = time.perf_counter() - start
    if spec["mode"] == "infer":
        if is_ca(backend):
            raise RuntimeError(f"{backend} compiles the backward: training only")
        return infer_step(fn, inputs, mark, keep)
    return train_step(fn, inputs, loss_fn, model, mark, keep, backward_call(backend))


def reference(spec: dict, device: torch.device) -> Kept:
    """Eager's first output (infer) or first loss, output and grads (train), from the same seed."""
    keep = Kept()
    make_step({**spec, "backend": "eager"}, device, keep)()
    return keep


def environment(device: torch.device) -> dict:
    import triton  # only for its version

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device_name": name, "torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0]}


INDUCTOR_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass", "cudagraph_skips"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}


def _counters(backend: str) -> dict:
    """This process's counters: ours (every known key, zero when never bumped; for cgtrees, the
    replays of backward graphs too), Dynamo's graph breaks (count and first reasons) and graphs,
    compiled autograd's, Inductor's caches and graph skips."""
    from torch._dynamo.utils import counters

    ours = dict(counters.get("cgtrees", {}))
    if base(backend) == "cgtrees":
        from cgtrees import counters as cgtrees_counters

        ours = {**cgtrees_counters.snapshot(), "backward_replays": backward_replays(),
                "aten_gap_ops": cgtrees_counters.gap_ops()}
    breaks = counters.get("graph_break", {})
    found = {"cgtrees": ours, "graph_breaks": sum(breaks.values()),
             "graph_break_reasons": [str(reason)[:300] for reason in list(breaks)[:5]],
             "unique_graphs": counters.get("stats", {}).get("unique_graphs", 0),
             "compiled_autograd": dict(counters.get("compiled_autograd", {})),
             "dynamo_cache": dict(counters.get("dynamo_cache", {}))}
    for group, keys in INDUCTOR_COUNTERS.items():
        found[group] = {k: counters.get(group, {}).get(k, 0) for k in keys}
    return found


def ca_figures(found: dict, backend: str) -> dict:
    """A compiled-autograd row's own figures: compiled autograd's captures; for cgtrees, the
    backward graphs that reached us as compiled-autograd graphs and the replays of backward graphs."""
    figures = {"ca_captures": found["compiled_autograd"].get("captures", 0)}
    if base(backend) == "cgtrees":
        ours = found["cgtrees"]
        figures.update(compiled_autograd_graphs=ours.get("compiled_autograd_graphs", 0),
                       backward_replays=ours["backward_replays"])
    return figures


def start_figures(found: dict, backend: str) -> dict:
    """What a start reused (issue 19): for cgtrees rows, the graphs it compiled and the saved
    functions it loaded; for ``-pc`` rows, Dynamo's cache hits, misses and errors and whether its
    caching precompile was on (cgtrees turns it on: this says it did)."""
    figures = {}
    if base(backend) == "cgtrees":
        ours = found["cgtrees"]
        figures.update(graphs_compiled=ours.get("graphs_compiled", 0),
                       precompile_loaded=ours.get("precompile_loaded", 0))
    if is_pc(backend):
        cache = found.get("dynamo_cache") or {}
        figures.update({k: cache.get(k, 0) for k in ("dynamo_cache_hit", "dynamo_cache_miss", "dynamo_cache_error")},
                       caching_precompile=bool(getattr(torch._dynamo.config, "caching_precompile", False)))
    return figures


def backward_replays() -> int:
    """Replays of our CUDA-graph nodes of backward functions, summed over the living trees (under
    compiled autograd only its graphs run as backward functions)."""
    from cgtrees import runtime

    found = re.finditer(r"node \d+ g\d+_backward\S* .*?replays=(\d+)", runtime.describe())
    return sum(int(m.group(1)) for m in found)


def compare(row: dict, keep: Kept, want: Kept) -> None:
    """Errors vs eager into ``row``: largest absolute, and relative for outputs and gradients
    (the worst gradient named)."""
    row["max_err"] = measure.max_error(keep.absolute(), want.absolute())
    if len(keep.outputs) != len(want.outputs) or keep.names != want.names:
        row["rel_err_out"] = row["rel_err_grad"] = float("inf")
        return
    row["rel_err_out"] = max(measure.relative_errors(keep.outputs, want.outputs), default=None)
    grads = measure.relative_errors(keep.grads, want.grads)
    if grads:
        worst = max(range(len(grads)), key=grads.__getitem__)
        row.update(rel_err_grad=grads[worst], worst_grad=keep.names[worst])


class Phases:
    """Names the phase under way (for errors) and how long each took (for planning runs)."""

    def __init__(self) -> None:
        self.name, self.seconds, self._t = "build", {}, time.perf_counter()

    def next(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[self.name] = now - self._t
        self.name, self._t = name, now


def run_row(spec: dict) -> dict:
    """Measure one row: first outputs, steady state, error vs eager. Never raises."""
    device = torch.device(spec["device"])
    plan = measure.SMOKE_PLAN if spec["smoke"] else measure.Plan()
    row: dict = {**spec, "ok": False, "error": None}
    phases = Phases()
    try:
        keep = Kept()
        step = make_step(spec, device, keep)
        phases.next("first calls")
        if spec.get("profile_start"):  # slower under cProfile: these start times are not comparable
            marks, row["start_profile"] = measure.profiled(measure.first_outputs, step, device)
        else:
            marks = measure.first_outputs(step, device)
        # from the torch.compile call: where a -pc backend loads Dynamo's saved entry
        row.update(first_s=keep.compile_s + marks[0], first3_s=keep.compile_s + marks[-1],
                   compile_call_s=keep.compile_s)
        keep.to_host()  # out of the steady state's peak (``Kept``)
        if is_pc(spec["backend"]):
            phases.next("save Dynamo's cache")
            row["dynamo_cache_save"] = save_dynamo_cache(spec["backend"])
        phases.next("steady state")
        row.update(measure.steady_state(step, device, plan))
        if spec.get("profile"):
            phases.next("profile")
            row["profile"] = measure.profile_table(step, device)
        phases.next("error vs eager")
        del step
        compare(row, keep, reference(spec, device))
        row["ok"] = True
    except Exception as exc:  # the row says what failed; the run goes on
        row["error"] = f"{phases.name}: {type(exc).__name__}: {exc}"[:2000]
        row["traceback"] = traceback.format_exc()[-4000:]
    phases.next("counters")
    row["counters"] = _counters(spec["backend"])
    if is_ca(spec["backend"]):
        row.update(ca_figures(row["counters"], spec["backend"]))
    row.update(start_figures(row["counters"], spec["backend"]))
    row["compile_phases"] = measure.compile_phases()
    phases.next("done")
    row["phase_s"] = phases.seconds
    return row


def main() -> None:
    start = time.time()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=sorted(workloads.NAMES))
    parser.add_argument("--backend", required=True, choices=BACKENDS)
    parser.add_argument("--mode", required=True, choices=("infer", "train"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--phase", default="cold", help="label only: the runner sets the caches")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also profile steady-state calls")
    parser.add_argument("--profile-start", action="store_true", help="run the first calls under cProfile")
    parser.add_argument("--launched", type=float, help="time.time() when the runner started this process")
    parser.add_argument("--result", help="also write the row here (atomically, as the very last step)")
    args = parser.parse_args()
    spec = {"workload": args.workload, "backend": args.backend, "mode": args.mode,
            "device": args.device, "phase": args.phase, "smoke": args.smoke, "profile": args.profile,
            "profile_start": args.profile_start}
    row = run_row(spec)
    row.update(environment(torch.device(args.device)))
    row["startup_s"] = start - args.launched if args.launched else None  # interpreter + imports
    row["worker_s"] = time.time() - start
    row["cache_dirs"] = {k: os.environ.get(k) for k in CACHE_VARS}
    line = json.dumps(row, default=str)
    print(line, flush=True)
    if args.result:
        Path(args.result + ".tmp").write_text(line)
        os.replace(args.result + ".tmp", args.result)


CACHE_VARS = ("CGTREES_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")

if __name__ == "__main__":
    main()
