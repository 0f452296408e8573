"""Counters in ``torch._dynamo.utils.counters["cgtrees"]`` (the keys tests and users rely on)."""

from __future__ import annotations

from torch._dynamo.utils import counters

KEYS = (
    # graphs_compiled: Dynamo graphs compiled; graphs_loaded: those whose AOT result came from the cache;
    # graphs_as_captured: those with no CUDA tensor, which run as Dynamo captured them (``aot/as_captured.py``)
    "graphs_compiled", "graphs_loaded", "graphs_as_captured", "graph_fallbacks",
    "kernels_generated", "aten_fallbacks", "aten_gaps",
    "cache_hit", "cache_miss", "cache_bypass", "cache_corrupt",
    # the same per cache level (``cache.events``): "aot", a Dynamo graph's whole AOT result; "module", a kernel module
    *(f"cache_{event}_{level}" for level in ("aot", "module") for event in ("hit", "miss", "bypass", "corrupt")),
    "cudagraph_warmup", "cudagraph_recorded", "cudagraph_replayed", "cudagraph_skips",
    "bucketed_graphs", "bucket_shapes",  # batch_buckets: graphs padded to buckets, sizes they first ran at
    # the cluster's tier (``cache.remote``): entries read from it, not there, failing their signature
    # check, and received after waiting for the process that compiled them
    "cache_remote_hit", "cache_remote_miss", "cache_remote_bad", "cache_remote_waited",
)


def bump(key: str, n: int = 1) -> None:
    counters["cgtrees"][key] += n


def get(key: str) -> int:
    return counters["cgtrees"][key]


GAP_OPS = "cgtrees_aten_gap_ops"  # counters[GAP_OPS][op name]: the aten calls counted in aten_gaps, by op


def bump_gap(op: str) -> None:
    """One more aten call that is a gap in our lowering (``aten_gaps``), recorded by op as well."""
    counters["cgtrees"]["aten_gaps"] += 1
    counters[GAP_OPS][op] += 1


def gap_ops() -> dict[str, int]:
    return dict(counters.get(GAP_OPS, {}))


def snapshot() -> dict[str, int]:
    """All known keys (zero when never bumped) plus any others that were."""
    table = counters["cgtrees"]
    return {**{k: table[k] for k in KEYS}, **dict(table)}
