"""Where the host time of Hugging Face's generate path goes, per decode step (issue 45).

    python benchmarks/probes/probe_hf_host.py [--backend cgtrees|inductor] [--path hf|hf-forward] [--smoke] [--out FILE]

``serve_worker.HF``'s path (1.1B Llama, bf16, batch 1, cache 160): generate compiles its decode step
with the backend. A wrapper around the backend's compiled function times our part (``backend_ms``:
the call Dynamo hands the graph's inputs to: the runtime's replay, outputs rebuilt); a wrapper around
generate's compiled call times the whole compiled call (``compiled_call_ms``: Dynamo's guards, its
wrapper, and ours); ``generate_ms`` is the wall time of a generation per new token, GPU-synchronised at
the end only. The rest is generate's own Python (logits processors, stopping criteria, cache
bookkeeping), its per-token synchronisation, and the prefill.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import serve_worker  # noqa: E402


class Timer:
    def __init__(self, profiler: cProfile.Profile | None = None) -> None:
        self.total, self.calls, self.profiler = 0.0, 0, profiler

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.profiler is not None:
                self.profiler.enable()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start
                self.calls += 1
                if self.profiler is not None:
                    self.profiler.disable()
        return timed

    def ms(self) -> float:
        return self.total / max(self.calls, 1) * 1e3


def timed_backend(name: str, timer: Timer):
    def compile_fn(gm, example_inputs, **kwargs):
        if name == "inductor":  # generate's CompileConfig hands mode="reduce-overhead"
            inner = torch._TorchCompileInductorWrapper(kwargs.get("mode"), kwargs.get("options"), False)(
                gm, example_inputs)
        else:
            inner = torch._dynamo.lookup_backend(name)(gm, example_inputs, **kwargs)
        return timer.wrap(inner)
    return compile_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cgtrees")
    p.add_argument("--path", default="hf", choices=("hf", "hf-forward"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--cprofile", action="store_true", help="also: where the backend's part spends it (cProfile)")
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = serve_worker.build(a.smoke, device)
    ours = Timer(cProfile.Profile() if a.cprofile else None)
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
    whole = Timer()
    if a.path == "hf":
        model._compiled_call = whole.wrap(model._compiled_call)
    else:
        hf.model.forward = whole.wrap(hf.model.forward)
    before = dict(counters["cgtrees"])
    ours.total = ours.calls = 0
    ours.profiler = cProfile.Profile() if a.cprofile else None  # the steady calls only
    serve_worker.sync(device)
    start = time.perf_counter()
    hf.generate(prompt)
    serve_worker.sync(device)
    gen_ms = (time.perf_counter() - start) / a.new * 1e3
    row = {"backend": a.backend, "path": a.path,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "generate_ms": gen_ms, "compiled_call_ms": whole.ms(), "backend_ms": ours.ms(),
           "decode_calls": whole.calls, "first_generations_s": warm_s}
    row["steady_counters"] = {k: v - before.get(k, 0) for k, v in counters["cgtrees"].items() if v != before.get(k, 0)}
    if a.backend == "cgtrees":
        import cgtrees.runtime

        row["describe"] = cgtrees.runtime.describe().splitlines()
    if ours.profiler is not None:
        ours.profiler.disable()
        text = io.StringIO()
        pstats.Stats(ours.profiler, stream=text).sort_stats("tottime").print_stats(30)
        row["cprofile"] = text.getvalue().splitlines()
    print(json.dumps(row, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
