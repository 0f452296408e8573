"""What the runtime reads of a graph's example inputs when it wraps the graph (``Examples``).

Found in the inputs AOTAutograd passes on a compile (``Examples.of``), or in a cache entry's
records of them on a hit (``Examples.of_records``). A hit makes no fake tensors for it: one costs
40-150 microseconds, and a training graph's hundreds of inputs cost tens of milliseconds of a warm
start (0.03-0.04 s of GPT-2's on an H100).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from cgtrees.compiled import has_symbolic_shapes


@dataclass(frozen=True)
class Examples:
    devices: frozenset[torch.device]  # of the tensor inputs (empty: no tensor input)
    strided: bool = True  # every tensor input has the strided layout
    symbolic: bool = False  # a size or stride is symbolic
    aliased: tuple[int, int] | None = None  # (a mutated input, another input sharing its storage)
    cpu_tensors: int = 0  # tensor inputs on the CPU
    cpu_scalars: int = 0  # of those, 0-d ones (a module may move them to the device: ``device_scalars``)

    @staticmethod
    def of(inputs: Sequence[Any], mutated: Iterable[int] = (), static: Iterable[int] = ()) -> Examples:
        tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
        cpu = [t for t in tensors if t.device.type == "cpu"]
        return Examples(devices=frozenset(t.device for t in tensors),
                        strided=all(t.layout == torch.strided for t in tensors),
                        symbolic=has_symbolic_shapes(list(inputs)),
                        aliased=_mutated_aliased(inputs, mutated, frozenset(static)),
                        cpu_tensors=len(cpu), cpu_scalars=sum(1 for t in cpu if t.dim() == 0))

    @staticmethod
    def of_records(records: Iterable[dict[str, Any]]) -> Examples:
        """From a cache entry's input records (``{"size", "stride", "dtype", "device"}``). An entry
        holds only static-shape strided tensors, each its own storage: AOTAutograd merges inputs
        that share one before the graph is compiled, and such a graph is never cached."""
        records = list(records)
        cpu = [r for r in records if torch.device(r["device"]).type == "cpu"]
        return Examples(devices=frozenset(torch.device(r["device"]) for r in records), cpu_tensors=len(cpu),
                        cpu_scalars=sum(1 for r in cpu if len(r["size"]) == 0))


def _mutated_aliased(inputs: Sequence[Any], mutated: Iterable[int], static: frozenset[int]) -> tuple[int, int] | None:
    """A mutated input that shares memory with another input cannot be copied into its own slot."""
    for i in mutated:
        if i in static or i >= len(inputs) or not isinstance(inputs[i], torch.Tensor):
            continue
        mine = _storage(inputs[i])
        if mine is None:
            continue
        for j, other in enumerate(inputs):
            if j != i and isinstance(other, torch.Tensor) and _storage(other) == mine:
                return i, j
    return None


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - fake tensors without storages: nothing to compare
        return None
