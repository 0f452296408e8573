"""When, in a synchronized real-size training step, the host reaches each stage of our runtime's call
(on the GPU machine; no profiler: each stamp is one ``perf_counter`` call).

    python benchmarks/probes/probe_step_stamps.py MODEL [--steps 20] [--out FILE]

``probe_step_gaps.py`` shows that the GPU waits mostly at a step's start, until the forward graph's
launch. This probe says where that host time goes: the runtime's methods are wrapped to stamp the
time of their entry and exit, and each stamp is printed as the median over ``--steps`` synchronized
steps of its time since the step began (the stamp that follows the synchronize).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cgtrees.aot import wrappers  # noqa: E402
from cgtrees.runtime import function, manager, node  # noqa: E402
from host_profile import StepPhases  # noqa: E402

STAMPS: list[tuple[str, float]] = []


def stamp(name: str) -> None:
    STAMPS.append((name, time.perf_counter()))


def wrap(cls: type, method: str, label) -> None:
    """Stamp entry and exit of ``cls.method``; ``label(self)`` names the call (its kind)."""
    original = getattr(cls, method)

    def wrapped(self, *args, **kwargs):
        name = f"{label(self)} {method}"
        stamp(f"{name} >")
        out = original(self, *args, **kwargs)
        stamp(f"{name} <")
        return out

    setattr(cls, method, wrapped)


def wrap_launches() -> None:
    """Stamp each recorded graph's launch (the C++ replay bound on each node)."""
    for obj in gc.get_objects():
        if isinstance(obj, node.GraphNode) and getattr(obj, "graph_replay", None) is not None:
            launch, kind = obj.graph_replay, obj.kind

            def stamped(launch=launch, kind=kind):
                stamp(f"{kind} launch >")
                launch()
                stamp(f"{kind} launch <")

            obj.graph_replay = stamped


def stamp_wrappers() -> None:
    """Stamp the entry of our autograd wrapper (``training_function``'s ``run``, before
    ``Function.apply``) and of the Function's forward (after it): built at the first compile."""
    original = wrappers.training_function

    def patched(forward, backward, plan, detach, aot_attributes=None):
        def boxed_forward(args):
            stamp("Function.forward >")
            return forward(args)

        run = original(boxed_forward, backward, plan, detach, aot_attributes)

        def stamped_run(*args):
            stamp("wrapper run >")
            return run(*args)

        return stamped_run

    wrappers.training_function = patched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()
    stamp_wrappers()
    step = StepPhases(a.model, "cgtrees")
    for _ in range(8):
        step()
    wrap(function.GraphFunction, "__call__", lambda s: s.kind)
    wrap(manager.TreeManager, "begin_call", lambda s: f"manager (live {len(s.live)})")
    wrap(node.GraphNode, "fits", lambda s: s.kind)
    wrap(node.GraphNode, "replay", lambda s: s.kind)
    wrap_launches()
    original_call = type(step).__call__
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(a.steps):
        torch.cuda.synchronize()
        STAMPS.clear()
        stamp("step >")
        original_call(step)
        stamp("step host <")
        torch.cuda.synchronize()
        stamp("synchronized")
        start = STAMPS[0][1]
        seen: collections.Counter[str] = collections.Counter()
        for name, t in STAMPS:
            seen[name] += 1
            by_name[f"{name} #{seen[name]}"].append((t - start) * 1e6)
    rows = sorted(((statistics.median(v), k) for k, v in by_name.items() if len(v) == a.steps))
    for t, k in rows:
        print(f"{t:9.1f} us  {k}")
    print("phases:", step.report())
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "device": torch.cuda.get_device_name(),
                                           "median_us": {k: t for t, k in rows}}, indent=1))


if __name__ == "__main__":
    main()
