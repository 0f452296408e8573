"""runtime: wraps kernel modules in tree-managed CUDA graphs (placeholder: no graphs yet)."""

from __future__ import annotations

from typing import Any, Callable

from backend import counters
from backend.context import GraphContext
from backend.logs import log, log_once


def wrap(call: Callable[[list[Any]], Any], example_inputs: list[Any], ctx: GraphContext) -> Callable[[list[Any]], Any]:
    log_once(log, f"skip:{ctx.name}", "cgtrees: %s runs without CUDA graphs: graphs not implemented yet", ctx.name)
    counters.bump("cudagraph_skips")
    return call


def describe() -> str:
    return "no CUDA graph trees"


def reset() -> None:
    pass
