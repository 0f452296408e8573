"""What a level-1 entry records of a graph's inputs and constants (``cache.aot``), and what is
read back from those records on a hit.

An aten graph's example input is recorded as its metadata (sizes and strides as ints, a symbolic
one as its text, ``"s0"``) or, for a size input, as ``{"size_input": ...}``; a hit builds the
runtime's ``Examples`` from the records, never fake tensors (they cost milliseconds). Lifted
constants are kept with their bytes (base64), up to ``MAX_CONSTANT_BYTES`` a graph.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import torch

from cgtrees.cache import compat
from cgtrees.cache.compat import Uncacheable
from cgtrees.context import Constants
from cgtrees.runtime.examples import Examples

MAX_CONSTANT_BYTES = 1 << 20  # an entry keeps its graphs' constants; larger ones are not kept


def constant_records(consts: Constants | None) -> list[dict[str, Any]]:
    """A graph's lifted constants as JSON records (their bytes in base64)."""
    if not consts:
        return []
    total = sum(t.numel() * t.element_size() for t in consts.tensors)
    if total > MAX_CONSTANT_BYTES:
        raise Uncacheable(f"graph holds {total} bytes of tensor constants (more than {MAX_CONSTANT_BYTES})")
    return [{"name": name, **tensor_spec(t), "data": base64.b64encode(compat.tensor_bytes(t)).decode()}
            for name, t in zip(consts.names, consts.tensors)]


def load_constants(records: list[dict[str, Any]]) -> Constants | None:
    """The graph's constants; None when it has none."""
    if not records:
        return None
    tensors = []
    for r in records:
        dtype = getattr(torch, r["dtype"])
        data = bytearray(base64.b64decode(r["data"]))
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        value = torch.empty_strided(r["size"], r["stride"], dtype=dtype, device=r["device"])
        value.copy_(flat.reshape(r["size"]))
        tensors.append(value)
    return Constants(tuple(r["name"] for r in records), tuple(tensors))


def input_record(x: Any) -> dict[str, Any]:
    """An aten graph's example input, as its part records it: a tensor's metadata (a symbolic size
    or stride as its text), or a size (``{"size_input": "s0"}``, or an int)."""
    if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool):
        return {"size_input": _dim(x)}
    if not isinstance(x, torch.Tensor):
        raise Uncacheable(f"a graph input is a {type(x).__name__}")
    return {"size": [_dim(s) for s in x.shape], "stride": [_dim(s) for s in x.stride()],
            "dtype": str(x.dtype).removeprefix("torch."), "device": str(x.device)}


def _dim(s: Any) -> int | str:
    n = compat.concrete_int(s)
    return n if n is not None else str(s)


def examples(records: list[dict[str, Any]]) -> Examples:
    """What the runtime reads of a part's inputs (``_input_record``): their devices, and whether a
    size is symbolic (then it keys its CUDA graphs by the sizes of each call)."""
    symbolic = any(isinstance(v, str) for r in records
                   for v in (r.get("size_input"), *r.get("size", ()), *r.get("stride", ())))
    examples = Examples.of_records([r for r in records if "device" in r])
    return dataclasses.replace(examples, symbolic=True) if symbolic else examples


def tensor_spec(x: Any) -> dict[str, Any]:
    if not isinstance(x, torch.Tensor) or any(not isinstance(s, int) for s in (*x.shape, *x.stride())):
        raise Uncacheable("a graph input is not a static-shape tensor")
    return {"size": list(x.shape), "stride": list(x.stride()),
            "dtype": str(x.dtype).removeprefix("torch."), "device": str(x.device)}
