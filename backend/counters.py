"""Counters in ``torch._dynamo.utils.counters["cgtrees"]`` (the keys tests and users rely on)."""

from __future__ import annotations

from torch._dynamo.utils import counters

KEYS = (
    "graphs_compiled", "graph_fallbacks", "kernels_generated", "aten_fallbacks", "aten_gaps",
    "cache_hit", "cache_miss", "cache_bypass", "cache_corrupt",
    "cudagraph_warmup", "cudagraph_recorded", "cudagraph_replayed", "cudagraph_skips",
)


def bump(key: str, n: int = 1) -> None:
    counters["cgtrees"][key] += n


def snapshot() -> dict[str, int]:
    """All known keys (zero when never bumped) plus any others that were."""
    table = counters["cgtrees"]
    return {**{k: table[k] for k in KEYS}, **dict(table)}
