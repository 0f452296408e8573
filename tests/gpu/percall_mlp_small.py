"""Per-call time of mlp_small inference: raw torch.cuda.CUDAGraph vs cgtrees vs backend="cudagraphs".

Not a test (no test_ prefix): ``python tests/gpu/percall_mlp_small.py [--aten] [--history]``.
``--history`` first runs a dozen other compiled functions in the process (``test_runtime_percall``).
Medians of CUDA-event windows. By default cgtrees runs as a user gets it: our decompositions,
generated kernels, default options (GEMM forms timed at compile time, ``gemm_choice``). With
``--aten`` the kernel modules are the undecomposed aten graphs (the kernels the raw graph replays
too), so the figure is the runtime's own cost. ``--profile`` adds host-time figures and a cProfile
of the call path.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn as nn


def build() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)]
    layers.append(nn.Linear(256, 16))
    return nn.Sequential(*layers).cuda(), torch.randn(16, 256, device="cuda")


def raw_graph(model: nn.Module, x: torch.Tensor):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = model(x)

    def call(_x):
        graph.replay()
        return out
    return call


def dynamo_floor_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Dynamo's own cost: its graph captured as one CUDA graph, no AOTAutograd, no runtime of ours.
    Parameters are read in place; every other input is copied into its slot."""
    static = [isinstance(a, nn.Parameter) for a in example_inputs]
    slots = [a if s else a.clone() for a, s in zip(example_inputs, static)]
    copies = [(i, slots[i]) for i, s in enumerate(static) if not s]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        gm(*slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        outs = gm(*slots)
    replay = graph.replay

    def call(*args):
        for i, slot in copies:
            slot.copy_(args[i])
        replay()
        return outs
    return call


def per_call_us(fn, x: torch.Tensor, calls: int = 2000, windows: int = 7) -> float:
    def step():
        with torch.no_grad():
            fn(x)
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def profile(model: nn.Module, x: torch.Tensor) -> None:
    """Where the host time of one cgtrees call goes (cProfile over many calls, by own time)."""
    import cProfile
    import pstats

    ours = torch.compile(model, backend="cgtrees")
    with torch.no_grad():
        for _ in range(20):
            ours(x)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(1000):
            ours(x)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    runtime_only(ours, x)
    torch._dynamo.reset()


def runtime_only(ours, x: torch.Tensor) -> None:
    """Our wrapper alone (no Dynamo, no AOTAutograd), and a bare copy + replay of the same node."""
    import cgtrees.runtime as runtime
    from cgtrees.runtime.function import GraphFunction

    # the function that replayed most: mlp_small's (others ran before it with --history)
    fn = max((f for f in runtime._functions if f.kind == "inference"),
             key=lambda f: sum(n.replays for by_key in f.trees.values() for ns in by_key.values() for n in ns))
    seen: list[list] = []

    class Spy(GraphFunction):
        def __call__(self, args):
            seen.append(list(args))
            return GraphFunction.__call__(self, args)

    fn.__class__ = Spy
    with torch.no_grad():
        ours(x)
    fn.__class__ = GraphFunction
    args = seen[0]
    node = next(n for by_key in fn.trees.values() for nodes in by_key.values() for n in nodes)
    src = args[node.single_index]

    def wrapper(_x):
        return fn(list(args))

    def bare(_x):
        node.single_slot.copy_(src)
        node.graph_replay()

    def replay_only(_x):
        node.graph_replay()

    def copy_only(_x):
        node.single_slot.copy_(src)

    for name, f in (("full compiled call", ours), ("runtime wrapper only", wrapper), ("bare copy+replay", bare),
                    ("replay only", replay_only), ("copy only", copy_only)):
        print(f"host us/call mlp_small {name:22s} {host_us(f, x):8.1f} us  (GPU-bound: {per_call_us(f, x):6.1f} us)")


def host_us(fn, x: torch.Tensor, calls: int = 300) -> float:
    """Host time per call while the GPU queue is not full: the Python and launch cost itself."""
    import time

    best = float("inf")
    with torch.no_grad():
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn(x)
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def history() -> None:
    """A dozen other compiled functions first, as a real process has: inference, training, dynamic
    shapes, a graph break, two threads, several models, then ``torch._dynamo.reset()``."""
    import threading

    torch.manual_seed(1)

    def run(f, *shapes, grad=False, calls=4):
        for _ in range(calls):
            for shape in shapes:
                x = torch.randn(*shape, device="cuda", requires_grad=grad)
                out = f(x)
                if grad:
                    out.float().sum().backward()

    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).cuda().eval()
    with torch.no_grad():
        run(torch.compile(conv, backend="cgtrees"), (2, 3, 16, 16))
    mlp = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)).cuda()
    run(torch.compile(mlp, backend="cgtrees"), (8, 64), grad=True)
    run(torch.compile(lambda x: (x.sin() * 2).cumsum(0), backend="cgtrees", dynamic=True),
        (8, 4), (16, 4), (24, 4), (40, 4))

    def branchy(x):
        y = x.relu()
        if y.sum() > 0:  # a graph break
            return y * 2
        return y - 1
    run(torch.compile(branchy, backend="cgtrees"), (32,), (32,))
    for width in (16, 48, 96):
        m = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)).cuda()
        run(torch.compile(m, backend="cgtrees"), (4, width), grad=True)
    shared = torch.compile(nn.Linear(32, 32).cuda(), backend="cgtrees")
    with torch.no_grad():
        threads = [threading.Thread(target=run, args=(shared, (4, 32))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    run(torch.compile(lambda x: x.softmax(-1) @ x.t(), backend="cgtrees"), (8, 8), (16, 16), grad=True)
    torch._dynamo.reset()
    run(torch.compile(lambda x: x.exp().mean(0), backend="cgtrees"), (8, 8))
    torch.cuda.synchronize()


def main() -> None:
    os.environ.setdefault("CGTREES_CACHE", "0")
    if "--aten" in sys.argv:
        # The runtime's own figure: the kernel modules are the aten graphs, without decompositions,
        # so the graph holds the kernels the raw graph holds (the default path's figure says what
        # codegen adds or saves).
        from cgtrees import codegen
        from cgtrees.aot import decompositions

        codegen.compile_graph = lambda gm, example_inputs, ctx: codegen.AtenModule(gm)
        decompositions.decomposition_table = dict
    if "--history" in sys.argv:
        history()
    model, x = build()
    with torch.no_grad():
        want = model(x)
    results = {}
    raw = raw_graph(model, x)
    results["raw_graph"] = per_call_us(raw, x)
    if "--profile" in sys.argv:
        print(f"host us/call mlp_small {'raw graph':22s} {host_us(raw, x):8.1f} us")
    ours = torch.compile(model, backend="cgtrees")
    with torch.no_grad():
        torch.testing.assert_close(ours(x), want)
    results["cgtrees"] = per_call_us(ours, x)
    if "--profile" in sys.argv:
        print(f"host us/call mlp_small {'cgtrees':22s} {host_us(ours, x):8.1f} us")
    torch._dynamo.reset()
    floor = torch.compile(model, backend=dynamo_floor_backend)
    results["dynamo_floor"] = per_call_us(floor, x)
    if "--profile" in sys.argv:
        print(f"host us/call mlp_small {'dynamo floor':22s} {host_us(floor, x):8.1f} us")
    torch._dynamo.reset()
    theirs = torch.compile(model, backend="cudagraphs")
    results["cudagraphs"] = per_call_us(theirs, x)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = per_call_us(model, x, calls=500)
    results["eager"] = eager
    if "--profile" in sys.argv:
        profile(model, x)
    for name, us in results.items():
        print(f"percall mlp_small {name:11s} {us:8.1f} us")
    print(f"percall ratio cgtrees/raw_graph = {results['cgtrees'] / results['raw_graph']:.2f} (target <= 1.25)")


if __name__ == "__main__":
    main()
