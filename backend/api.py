"""The backend callable that Dynamo calls with each captured FX graph."""

from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable, Mapping

import torch

from cgtrees import counters
from cgtrees.config import Config, OptionError
from cgtrees.logs import forget, log
from cgtrees.progress import PROGRESS


def restart_exceptions() -> tuple[type[BaseException], ...]:
    """Exceptions Dynamo raises through a backend to ask for a new trace of the frame: they are
    not failures, and must reach Dynamo (swallowed, a dynamic-shape LayerNorm never compiled)."""
    from torch._dynamo import exc

    return tuple(e for e in (vars(exc).get("RestartAnalysis"),) if e is not None)


def _not_ours_to_report(exc: OptionError, frame: Any) -> Exception:
    """``exc`` as an error Dynamo passes through unwrapped (a ``ShortenTraceback``: not the 31 lines of
    ``BackendCompilerFailed``), its traceback cut to the backend's frame, and without Dynamo's advice to
    report a bug to PyTorch (Dynamo adds it to exceptions that carry a ``real_stack``: this one never
    holds one). Torch has no hook that hands a string backend its options at ``torch.compile(...)``:
    the first call is where they are checked."""
    try:
        from torch._dynamo.exc import ShortenTraceback

        passed = type("OptionError", (ShortenTraceback, OptionError),
                      {"real_stack": property(_no_stack, lambda self, value: None), "__module__": "cgtrees.config"})
        return passed(str(exc), first_useful_frame=frame)
    except Exception:  # noqa: BLE001 - another torch: the plain error, wrapped by Dynamo
        return exc


def _no_stack(self: Any) -> Any:
    raise AttributeError("real_stack")


class CgtreesBackend:
    """``backend(gm, example_inputs, mode=None, options=None) -> callable``.

    torch.compile hands a string backend its ``mode`` (when not "default") and ``options`` as
    keyword arguments. Bad options are the user's error and raise; a graph we cannot compile is
    ours, and runs eagerly with the reason logged.
    """

    def __init__(self) -> None:
        self._graph_ids = itertools.count()
        if "precompile_cache" in Config.set_in_environment():  # Dynamo decides on its cache before any graph
            from cgtrees import precompile

            precompile.use_dynamo_cache()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                 options: Mapping[str, Any] | None = None, **unknown: Any) -> Callable[..., Any]:
        if unknown:
            raise TypeError(f"cgtrees: unexpected arguments {sorted(unknown)}; it takes mode= and options=")
        try:
            config = Config.resolve(mode, options)
        except OptionError as exc:
            raise _not_ours_to_report(exc, inspect.currentframe()) from None
        graph_id = next(self._graph_ids)
        hits_before = counters.get("cache_hit_aot")
        try:
            from cgtrees import precompile
            from cgtrees.aot import as_captured, compiled_autograd
            from cgtrees.aot.driver import Compiled, compile_dynamo_graph
            from cgtrees.cache.aot import Level1Hints

            # keep: torch will save the result (aot_compile); a line on the terminal if it takes long
            with PROGRESS.compiling(f"g{graph_id}", config.progress), precompile.compiling(gm, config) as keep:
                if not keep and as_captured.applies(gm, example_inputs, config):  # CPU: eager's ops, eager's cost
                    return as_captured.call(gm, f"g{graph_id}")
                if compiled_autograd.is_backward_graph(example_inputs):  # its first input is a list
                    result = Compiled(compiled_autograd.compile_backward_graph(gm, example_inputs, config, graph_id))
                else:
                    result = compile_dynamo_graph(gm, example_inputs, config, graph_id, hints=Level1Hints(keep=keep))
        except restart_exceptions():
            raise  # Dynamo's own signal to trace the frame again (e.g. a float input made a tensor)
        except Exception as exc:  # noqa: BLE001 - the user's program must not die of our bug
            counters.bump("graph_fallbacks")
            log.warning("cgtrees: graph g%d could not be compiled (%s: %s); it runs eagerly",
                        graph_id, type(exc).__name__, exc, exc_info=log.isEnabledFor(10))
            return gm.forward
        # compiled means compiled: a graph whose AOT result came from the cache (level 1) was loaded
        counters.bump("graphs_loaded" if counters.get("cache_hit_aot") > hits_before else "graphs_compiled")
        return precompile.serializable(result, config, gm, f"g{graph_id}") if keep else result.call

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()`` (through torch.compile's wrapper) and ``cgtrees.reset()``."""
        from cgtrees import runtime

        runtime.reset()
        forget()
