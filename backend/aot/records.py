"""What a level-1 function records of a graph's inputs and constants (``compiled_function``'s
``InputSpec`` and ``Constant``), and what is read back from those records where it is rebuilt.

An aten graph's example input is recorded as its metadata (sizes and strides as ints, a symbolic
one as its text, ``"s0"``) or, for a size input, as a ``SizeInput``; a rebuild makes the runtime's
``Examples`` from the records, never fake tensors (they cost milliseconds). Lifted constants are
kept with their bytes, up to ``MAX_CONSTANT_BYTES`` a graph.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from cgtrees.aot import compat
from cgtrees.aot.compat import Uncacheable
from cgtrees.compiled_function import Constant, Dim, InputSpec, SizeInput, TensorSpec
from cgtrees.context import Constants
from cgtrees.runtime.examples import Examples

MAX_CONSTANT_BYTES = 1 << 20  # a function keeps its graphs' constants; larger ones are not kept


def constant_records(consts: Constants | None) -> tuple[Constant, ...]:
    """A graph's lifted constants, with their bytes."""
    if not consts:
        return ()
    total = sum(t.numel() * t.element_size() for t in consts.tensors)
    if total > MAX_CONSTANT_BYTES:
        raise Uncacheable(f"graph holds {total} bytes of tensor constants (more than {MAX_CONSTANT_BYTES})")
    return tuple(Constant(name, tensor_spec(t), compat.tensor_bytes(t))
                 for name, t in zip(consts.names, consts.tensors))


def load_constants(records: Sequence[Constant]) -> Constants | None:
    """The graph's constants; None when it has none."""
    if not records:
        return None
    tensors = []
    for r in records:
        dtype = getattr(torch, r.spec.dtype)
        data = bytearray(r.data)
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        value = torch.empty_strided(r.spec.size, r.spec.stride, dtype=dtype, device=r.spec.device)
        value.copy_(flat.reshape(r.spec.size))
        tensors.append(value)
    return Constants(tuple(r.name for r in records), tuple(tensors))


def input_record(x: Any) -> InputSpec:
    """An aten graph's example input, as its part records it: a tensor's metadata (a symbolic size
    or stride as its text), or a size (``SizeInput("s0")``, or an int)."""
    if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool):
        return SizeInput(_dim(x))
    if not isinstance(x, torch.Tensor):
        raise Uncacheable(f"a graph input is a {type(x).__name__}")
    return TensorSpec(tuple(_dim(s) for s in x.shape), tuple(_dim(s) for s in x.stride()),
                      str(x.dtype).removeprefix("torch."), str(x.device))


def _dim(s: Any) -> Dim:
    n = compat.concrete_int(s)
    return n if n is not None else str(s)


def examples(records: Sequence[InputSpec]) -> Examples:
    """What the runtime reads of a part's inputs (``input_record``): their devices, and whether a
    size is symbolic (then it keys its CUDA graphs by the sizes of each call)."""
    symbolic = any(isinstance(r.value, str) if isinstance(r, SizeInput) else r.symbolic for r in records)
    examples = Examples.of_records([r.as_record() for r in records if isinstance(r, TensorSpec)])
    return dataclasses.replace(examples, symbolic=True) if symbolic else examples


def tensor_spec(x: Any) -> TensorSpec:
    if not isinstance(x, torch.Tensor) or any(not isinstance(s, int) for s in (*x.shape, *x.stride())):
        raise Uncacheable("a graph input is not a static-shape tensor")
    return TensorSpec(tuple(x.shape), tuple(x.stride()), str(x.dtype).removeprefix("torch."), str(x.device))
