"""runtime: wraps each kernel module in tree-managed CUDA graphs. Its rules, in order of precedence
(the code and tests name them R1-R8):

- R1 never garbage: no tensor a user holds shows values it did not compute; if it cannot stay
  right, touching it raises a RuntimeError naming the function, the op and the remedy.
- R2 within a generation a live output is never overwritten: a replay that would reuse its memory
  records a new child instead; past a per-function limit, copies out of the pool or no graphs.
- R3 generations end at ``torch.compiler.cudagraph_mark_step_begin()``, at the next forward after
  a backward ran (training), or at a call with no output of the generation alive (inference); live
  outputs of an ended generation are invalidated (R1), except gradients:
- R4 what a backward produced (a ``.grad``) stays right across generations.
- R5 before recording a child after replays, the pool's book-keeping is restored to the parent's
  checkpoint: dead storages freed, live ones kept.
- R6 static inputs (parameters, buffers, marked addresses) are never copied, a new address
  re-records up to a limit; inputs already in the pool at the recorded address are checked; others
  are copied into the graph's slots; a mutated input gets eager's result.
- R7 a graph that cannot be captured safely runs without one; the reason is counted
  (``cudagraph_skips``) and logged once per function.
- R8 random ops draw fresh values on every replay.

    wrap(module, examples, ctx, shared):
        reason_to_skip        # CPU / several devices / sparse / uncapturable op -> no graphs (R7);
                              # what the graph holds comes from ``module.graph.facts``
        GraphFunction         # warmup -> record -> replay under the tree manager of
                              # (device, thread of the forward); one pool per manager; a forward
                              # and its backward share a ``SharedTree``

Files: ``compat`` (every private torch API), ``liveness`` (live outputs, generation end),
``node`` (one recorded graph and its replay path), ``manager`` (pool, checkpoints, generations),
``function`` (one wrapped graph: node choice and limits), ``skips`` (reasons known at wrap time),
``examples`` (what wrapping reads of the example inputs), ``first_calls`` (a warm load's library
calls, made beforehand in threads). The runtime imports no other stage: what it wraps is a
``cgtrees.compiled.CompiledModule``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from cgtrees import counters
from cgtrees.capture import recording_lock  # noqa: F401 - public: a thread holds it around its own random draws
from cgtrees.compiled import CompiledModule
from cgtrees.context import GraphContext
from cgtrees.logs import log_once
from cgtrees.runtime import skips
from cgtrees.runtime.examples import Examples
from cgtrees.runtime.function import GraphFunction, log, skip
from cgtrees.runtime.manager import Managers, SharedTree

_managers = Managers()
_functions: "weakref.WeakSet[GraphFunction]" = weakref.WeakSet()
_skipped: dict[str, str] = {}  # function name -> reason, for describe()


def wrap(module: CompiledModule, examples: Examples, ctx: GraphContext,
         shared: SharedTree | None = None) -> Callable[[list[Any]], Any]:
    """Return the module's ``call`` wrapped in CUDA graph trees, or the ``call`` itself where
    graphs cannot help (the reason counted and logged once). ``examples``: what the graph's example
    inputs say (``Examples.of``), or what a cache entry recorded of them (``Examples.of_records``).
    ``shared``: what a forward and its backward share (None: a graph without a partner)."""
    if not ctx.config.cudagraphs:
        return module.call
    facts = module.graph.facts
    scalars = module.graph.device_scalars  # CPU 0-d inputs the module moves to the device itself
    reason, device = skips.reason_to_skip(examples, ctx, facts, scalars)
    if reason is not None:
        skip(ctx.name, reason)  # one skip per function, logged once
        _skipped[ctx.name] = reason
        return module.call
    fn = GraphFunction(module.call, examples.symbolic, ctx, device, _managers, facts, module.graph.launches, shared,
                       scalars)
    _functions.add(fn)
    return fn


def wrap_module(module: CompiledModule, examples: Examples, ctx: GraphContext,
                shared: SharedTree | None = None) -> Callable[[list[Any]], Any]:
    """The module in the runtime, the graph's lifted constants appended to each call; the module
    alone (counted in ``graph_fallbacks``, logged once) if the runtime fails on it. Shared by the
    driver, level-1 hits and loaded precompiled functions (imports nothing of AOTAutograd)."""
    try:
        call = wrap(module, examples, ctx, shared)
    except Exception as exc:  # noqa: BLE001 - the module still runs, without the runtime
        counters.bump("graph_fallbacks")
        log_once(log, f"fallback:{ctx.name}:runtime", "cgtrees: %s: runtime failed (%s: %s); this graph "
                 "runs through aten", ctx.name, type(exc).__name__, exc)
        call = module.call
    return ctx.constants.append(call) if ctx.constants else call


def describe() -> str:
    """The trees as text: managers, nodes, generations, live outputs, pool bytes; and the skips."""
    lines = []
    for manager in _managers.all():
        lines.append(manager.describe())
    # functions that have run since the last reset() (a compiled function outlives reset())
    functions = sorted((f for f in _functions if f.warmed or f.disabled), key=lambda f: f.name)
    lines += [fn.describe() for fn in functions]
    lines += [f"function {name}: no CUDA graphs: {reason}" for name, reason in sorted(_skipped.items())]
    return "\n".join(lines) if lines else "no CUDA graph trees"


def reset() -> None:
    """Invalidate live outputs (gradients are copied out), drop every graph and pool."""
    _managers.close_all()
    for fn in list(_functions):
        fn.forget()
    _skipped.clear()
