"""What every stage is told about one aten graph: passed explicitly, never read from globals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from backend.config import Config

if TYPE_CHECKING:
    from backend.aot.constants import Constants


SAVED_FROM = "cgtrees_saved_from"  # fw_module.meta: the number of its outputs the user sees (aot.partition)

GraphKind = Literal["forward", "backward", "inference"]  # which of AOTAutograd's graphs (R3, R4)


@dataclass(frozen=True)
class GraphContext:
    config: Config
    kind: GraphKind
    name: str  # stable id for logs, counters and describe(), e.g. "g0_forward"
    static_input_indices: tuple[int, ...] = ()  # parameters, buffers, marked-static inputs
    mutated_input_indices: tuple[int, ...] = ()  # inputs the graph writes to (aten.copy_ into a placeholder)
    # Shared by the forward and backward of one Dynamo graph; the runtime keeps there which tree
    # manager the forward ran under, so the backward uses it (autograd runs it on another thread).
    pair: Any = field(default=None, compare=False, hash=False)
    # The graph's lifted constants (``aot.constants``): its last inputs, appended to every call.
    constants: "Constants | None" = field(default=None, compare=False, hash=False)
    # A forward's first output that only the backward reads (AOTAutograd's saved activations come
    # after the user's outputs); the runtime hands those out as the same tensors on every replay.
    # None: unknown, or not a forward (every output is rebuilt).
    saved_from: int | None = field(default=None, compare=False, hash=False)
    # The digest of the graph's kernel-module cache key, which its module's header shows (None: no key).
    cache_key: str | None = field(default=None, compare=False, hash=False)
