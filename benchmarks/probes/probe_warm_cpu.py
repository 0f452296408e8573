"""A warm start on CPU by phase (issue 53 item 2): three training steps of a workload (demo, gpt2 or
llama: 2-layer transformers configs, random weights), our phases timed, the cache directory's
syscalls and the work done counted. Run it twice over one directory, cold then warm:

    CGTREES_CPU_PIPELINE=1 CGTREES_CACHE_DIR=/tmp/c python benchmarks/probes/probe_warm_cpu.py gpt2

(add CGTREES_INTERPRET=1 for Triton's interpreter). Prints one RESULT line of JSON: the runs behind
benchmarks/results/warm-phases/cpu-train-at-19d9655.json.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import os
import sys
import time
from typing import Any, Callable

import torch

PHASES: dict[str, float] = collections.defaultdict(float)
COUNTS: collections.Counter = collections.Counter()
FS: collections.Counter = collections.Counter()


def timed(owner: Any, name: str, phase: str) -> None:
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            PHASES[phase] += time.perf_counter() - start
            COUNTS[phase] += 1
    setattr(owner, name, wrapper)


def count_fs(owner: Any, name: str, cache_dir: str, label: str) -> None:
    """Count ``owner.name(path, ...)`` calls on the cache directory."""
    real = getattr(owner, name)

    def wrapper(path: Any, *a: Any, **k: Any) -> Any:
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(cache_dir):
            FS[label] += 1
        return real(path, *a, **k)
    setattr(owner, name, wrapper)


def instrument() -> None:
    import cgtrees.aot.driver as driver
    import cgtrees.aot.rebuild
    import cgtrees.cache.aot
    import cgtrees.cache.store
    import cgtrees.codegen
    import cgtrees.codegen.binaries

    for owner, name, phase in [
        (cgtrees.cache.store.Store, "open", "store_open"), (cgtrees.cache.store.Store, "read", "store_read"),
        (driver.cache, "load_aot", "level1_load"), (cgtrees.cache.aot, "aot_key", "key"),
        (cgtrees.cache.aot, "resolve", "level2_resolve"), (driver, "rebuild", "rebuild"),
        (cgtrees.codegen, "load", "module_import"), (cgtrees.codegen.binaries, "install", "kernel_binaries"),
        (driver.compat, "aot_module_simplified", "aot_autograd"), (driver.Compilers, "forward", "compile_forward"),
        (driver.Compilers, "backward", "compile_backward"), (driver, "_generate", "codegen"),
        (cgtrees.aot.rebuild.LazyBackward, "_compile", "lazy_backward_compile"),
        (driver, "compile_dynamo_graph", "backend_total"),
    ]:
        timed(owner, name, phase)
    cache_dir = os.environ["CGTREES_CACHE_DIR"]
    for name in ("stat", "mkdir", "listdir", "scandir", "chmod", "utime", "open"):
        count_fs(os, name, cache_dir, name)
    count_fs(io, "open", cache_dir, "io.open")


def workload(name: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    torch.manual_seed(0)
    if name == "demo":
        from cgtrees.demo import DemoBlock
        model, x = DemoBlock(128, 4), torch.randn(4, 64, 128)
        return model, lambda m: m(x).float().pow(2).mean()
    import transformers
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 1000, (2, 64))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def main() -> None:
    instrument()
    model, loss_of = workload(sys.argv[1])
    compiled = torch.compile(model, backend="cgtrees")
    start, losses, first = time.perf_counter(), [], 0.0
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss = loss_of(compiled)
        loss.backward()
        losses.append(loss.detach())
        if step == 0:
            first = time.perf_counter() - start
    first3 = time.perf_counter() - start
    from torch._dynamo.utils import compile_times, counters
    names, seconds = compile_times(repr="csv", aggregate=True)
    dynamo = dict(zip(names, map(float, seconds)))
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    print("RESULT " + json.dumps({
        "workload": sys.argv[1], "first_s": round(first, 3), "first3_s": round(first3, 3),
        "dynamo_total": round(dynamo.get("_compile.compile_inner", 0.0), 3),
        "backend_call": round(dynamo.get("OutputGraph.call_user_compiler", 0.0), 3),
        "phases": {k: round(v, 4) for k, v in PHASES.items()}, "counts": dict(COUNTS), "fs": dict(FS),
        "cgtrees": dict(counters["cgtrees"]), "loss_sum": float(sum(x.double() for x in losses)),
        "grad_sum": float(grads.double().abs().sum())}))


if __name__ == "__main__":
    main()
