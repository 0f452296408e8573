"""What every stage is told about one aten graph: passed explicitly, never read from globals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from cgtrees.config import Config

GraphKind = Literal["forward", "backward", "inference"]  # which of AOTAutograd's graphs (R3, R4)


@dataclass(frozen=True)
class GraphContext:
    config: Config
    kind: GraphKind
    name: str  # stable id for logs, counters and describe(), e.g. "g0_forward"
    static_input_indices: tuple[int, ...] = ()  # parameters, buffers, marked-static inputs
    mutated_input_indices: tuple[int, ...] = ()  # inputs the graph writes to (``aot.driver.mutated_inputs``)
    # The graph's lifted constants (``aot.constants``): its last inputs, appended to every call.
    constants: "Constants | None" = field(default=None, compare=False, hash=False)
    # A forward's first output that only the backward reads (AOTAutograd's saved activations come
    # after the user's outputs); the runtime hands those out as the same tensors on every replay.
    # None: unknown, or not a forward (every output is rebuilt).
    saved_from: int | None = field(default=None, compare=False, hash=False)
    # The digest of the graph's kernel-module cache key, which its module's header shows (None: no key).
    cache_key: str | None = field(default=None, compare=False, hash=False)
    # The digest of the graph's canonical text (``cache.key.graph_digest``), shown in the header too.
    graph_hash: str | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class Constants:
    """The lifted tensors of one aten graph, in the order of their placeholders."""

    names: tuple[str, ...] = ()
    tensors: tuple[torch.Tensor, ...] = ()

    def __len__(self) -> int:
        return len(self.tensors)

    def indices(self, num_inputs: int) -> tuple[int, ...]:
        """Their positions among the lifted graph's inputs (after the ``num_inputs`` given ones)."""
        return tuple(range(num_inputs, num_inputs + len(self.tensors)))

    def append(self, call: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """``call`` with the constants added after the caller's arguments."""
        if not self.tensors:
            return call
        tensors = list(self.tensors)

        def call_with_constants(args: list[Any]) -> Any:
            args.extend(tensors)
            return call(args)

        return call_with_constants
