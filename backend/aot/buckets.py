"""Batch buckets (option ``batch_buckets``): an inference graph whose batch size B is symbolic runs at
the next bucket P >= B, so that a server that sees every batch size records one CUDA graph per
bucket (the runtime keys its graphs by input shape), not one per size.

At compile time (``plan``, then ``wrap``), for an inference graph only (a training graph is left
alone: its backward would need the padding rows' gradients taken out again):
1. The batch symbol: the first dimension of the first input whose first dimension is symbolic.
2. ``batch_rows.trace``: every op keeps the rows of the batch apart (padding rows never change
   the real rows' results); else the graph runs at its own sizes, and the reason is logged once.
3. Which inputs to pad (each dimension of size exactly B: inputs must be contiguous and not
   written in place), which size arguments are B, and which output dimensions to cut back to B
   (outputs must be the graph's own tensors, not views of an input).
4. The buckets every guard on the batch size allows (Dynamo's ``2 <= B`` rules out 1, a bound from
   a table's length rules out larger ones): checked once the graph is compiled, as codegen may add
   guards of its own.

Per call (``BucketedCall``, one table lookup when B is a bucket): the padded inputs are rows 0..B-1
of the input followed by copies of row 0. Copies, not zeros: the padding rows are then data the
model already handles, so they raise no error a real batch would not (a token id of 0 shifted to
-1, an out-of-range index, a device-side assert, which would end the CUDA context) and make no
inf or NaN a zero row could (log(0), a fully masked softmax, a zero norm). Each output is then a
view of its first B rows (no copy). A batch past the largest bucket runs at its own size (logged
once a graph). Cost: a padded call launches one ``index_select`` more (on an H200 host, a small
MLP's replay took 93-100 us padded against 65-69 us at a bucket's own size); the runtime's copy into
the graph's input slot could take the rows instead (a follow-up). Counters: ``bucketed_graphs``,
and ``bucket_shapes`` (each size a bucketed graph first runs at: the shapes it records graphs for).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx

from cgtrees import counters
from cgtrees.aot import compat
from cgtrees.aot.batch_rows import NotBucketable, Trace, expr, same, sizes, value
from cgtrees.logs import log_once

log = logging.getLogger("cgtrees.aot.buckets")
Boxed = Callable[[list[Any]], Any]


@dataclass(frozen=True)
class Plan:
    """What a call pads and cuts, found once at compile time."""

    symbol: sympy.Symbol
    buckets: tuple[int, ...]
    pad: tuple[tuple[int, int], ...]  # (input, dimension) of size B, padded to P
    size_args: tuple[int, ...]  # inputs that are B itself (a symbolic size argument)
    cut: tuple[tuple[int, int, bool], ...]  # (output, dimension, the batch folded into it), cut to B


def plan(gm: torch.fx.GraphModule, buckets: Sequence[int], name: str, static: Sequence[int] = (),
         output_kinds: Sequence[str] | None = None) -> Plan | None:
    """The plan for an inference graph; None where it has no symbolic batch or cannot be padded
    (the reason logged once). ``static``: inputs whose address the runtime keeps (never copied).
    ``output_kinds``: AOTAutograd's kind of each output (``non_alias``, ``alias_of_input``, ...);
    by default read from the graph being compiled, where there is one."""
    if not buckets:
        return None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    symbol = _batch_symbol(placeholders)
    if symbol is None:
        return None
    if output_kinds is None:
        meta = compat.fw_metadata()
        output_kinds = None if meta is None else [getattr(o.output_type, "name", "") for o in meta.output_info]
    try:
        return _plan(gm, placeholders, symbol, tuple(buckets), frozenset(static), output_kinds)
    except NotBucketable as exc:
        log_once(log, f"unbucketed:{name}", "cgtrees: %s runs without batch buckets: %s", name, exc)
    except Exception as exc:  # noqa: BLE001 - our bug must not fail the compile: the graph runs unpadded
        log_once(log, f"unbucketed:{name}", "cgtrees: %s runs without batch buckets: its analysis failed (%s: %s)",
                 name, type(exc).__name__, exc)
    return None


def _batch_symbol(placeholders: list[torch.fx.Node]) -> sympy.Symbol | None:
    for node in placeholders:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() and isinstance(expr(val.shape[0]), sympy.Symbol):
            return expr(val.shape[0])
    return None


def _plan(gm: torch.fx.GraphModule, placeholders: list[torch.fx.Node], symbol: sympy.Symbol,
          buckets: tuple[int, ...], static: frozenset[int], output_kinds: Sequence[str] | None) -> Plan:
    t = Trace(symbol)
    pad, size_args = _inputs(t, placeholders, static)
    for node in gm.graph.nodes:
        t.check(node)
    return Plan(symbol, buckets, pad, size_args, _outputs(t, gm, output_kinds))


def _inputs(t: Trace, placeholders: list[torch.fx.Node],
            static: frozenset[int]) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    pad, size_args = [], []
    for i, node in enumerate(placeholders):
        val = value(node)
        if isinstance(val, torch.SymInt):
            if val.node.expr == t.symbol:
                size_args.append(i)
            elif t.symbol in val.node.expr.free_symbols:
                raise NotBucketable(f"input {i} is a size computed from the batch size ({val.node.expr})")
        elif isinstance(val, torch.Tensor):
            b = t.dim(node)
            if b is None:
                continue
            if b.inner != 1:
                raise NotBucketable(f"input {i} holds the batch folded into dimension {b.dim}")
            if not _contiguous(val):
                raise NotBucketable(f"input {i} is not contiguous")
            if i in static:
                raise NotBucketable(f"input {i} is static (kept at its address), which a padded copy cannot be")
            pad.append((i, b.dim))
    return tuple(pad), tuple(size_args)


def _contiguous(val: torch.Tensor) -> bool:
    expected: sympy.Expr = sympy.Integer(1)
    for size, stride in reversed(list(zip(sizes(val), val.stride()))):
        if size != 1 and not same(expr(stride), expected):
            return False
        expected = expected * size
    return True


def _outputs(t: Trace, gm: torch.fx.GraphModule, kinds: Sequence[str] | None) -> tuple[tuple[int, int, bool], ...]:
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    if kinds is not None and len(kinds) != len(outs):
        raise NotBucketable("AOTAutograd adds outputs of its own (input mutations it applies, aliased intermediates)")
    cut = []
    for i, arg in enumerate(outs):
        if not isinstance(arg, torch.fx.Node):
            continue
        if t.involves(arg):
            raise NotBucketable(f"output {i} is the batch size or computed from it")
        b = t.dim(arg)
        if b is None:
            continue
        if arg.op == "placeholder" or (kinds is not None and kinds[i] not in ("non_alias", "unsafe_view_alias")):
            raise NotBucketable(f"output {i} is an input or a view of one, which the padded copy cannot be")
        cut.append((i, b.dim, b.inner != 1))
    return tuple(cut)


def usable_buckets(p: Plan, shape_env: Any, name: str) -> tuple[int, ...]:
    """The buckets that every guard and assertion on the batch size allows (the graph is correct
    for those sizes only); each bucket ruled out is logged once."""
    ranges = getattr(shape_env, "var_to_range", {}).get(p.symbol)
    facts = [g.expr for g in getattr(shape_env, "guards", ())]
    for asserts in getattr(shape_env, "deferred_runtime_asserts", {}).values():
        facts += [a.expr for a in asserts]
    replace = getattr(shape_env, "replace", lambda e: e)  # s54 -> s77 where a guard made them equal
    facts = [f for f in map(replace, facts) if p.symbol in f.free_symbols]
    kept = []
    for bucket in p.buckets:
        why = None
        if ranges is not None and bucket < ranges.lower:
            continue  # never chosen: every batch this graph runs is at least as large (Dynamo gives 1 a graph)
        if ranges is not None and bucket > ranges.upper:
            why = f"the graph is compiled for batch sizes up to {ranges.upper}"
        for fact in facts:
            if why is None and fact.subs(p.symbol, bucket) is not sympy.true:
                why = f"guard {fact}"
        if why is None:
            kept.append(bucket)
        else:
            log_once(log, f"bucket:{name}:{bucket}", "cgtrees: %s: batch bucket %d is not used (%s)", name,
                     bucket, why, level=logging.INFO)
    return tuple(kept)


def wrap(call: Boxed, p: Plan, shape_env: Any, name: str) -> Boxed:
    """``call`` (boxed) run at bucket sizes; ``call`` itself where no bucket is usable."""
    buckets = usable_buckets(p, shape_env, name)
    if not buckets or not p.pad:
        return call
    counters.bump("bucketed_graphs")
    log.debug("cgtrees: %s runs at batch buckets %s (pads inputs %s, cuts outputs %s)", name, buckets,
              [i for i, _ in p.pad], [i for i, _, _ in p.cut])
    return BucketedCall(call, p, buckets, name)


def note_training(name: str) -> None:
    log_once(log, f"training:{name}", "cgtrees: %s is a training graph: batch_buckets applies to inference "
             "graphs (no autograd), it runs at its own batch sizes", name, level=logging.INFO)


def shape_env_of(gm: torch.fx.GraphModule) -> Any:
    """The ShapeEnv behind the graph's symbolic sizes."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for s in val.shape if isinstance(val, torch.Tensor) else [val]:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


class BucketedCall:
    """Pads the batch to its bucket, runs the graph, cuts each output back to the real rows (a view)."""

    _boxed_call = True

    def __init__(self, call: Boxed, p: Plan, buckets: tuple[int, ...], name: str) -> None:
        self.call, self.name = call, name
        self.first = p.pad[0]
        self.pad, self.size_args, self.cut = p.pad, p.size_args, p.cut
        self.largest = buckets[-1]
        # bucket_of[b]: the bucket for batch size b (b itself for a size no bucket is above, and for 0)
        self.bucket_of = [0] + [next(x for x in buckets if x >= b) for b in range(1, self.largest + 1)]
        self.seen: set[int] = set()
        self.rows: dict[tuple[int, torch.device], torch.Tensor] = {}  # (B, device) -> 0..B-1, then 0s

    def __call__(self, args: list[Any]) -> Any:
        i, d = self.first
        b = args[i].shape[d]
        p = self.bucket_of[b] if b <= self.largest else self._past(b)
        if p not in self.seen:
            self.seen.add(p)
            counters.bump("bucket_shapes")
        if p == b:
            return self.call(args)
        for i, d in self.pad:  # one index_select each: ~2.5 us of CPU, where a cat into a new tensor is 7
            x = args[i]
            rows = self.rows.get((b, x.device))
            if rows is None:
                rows = self.rows[b, x.device] = padded_rows(b, p, x.device)
            args[i] = x.index_select(d, rows)
        for i in self.size_args:
            args[i] = p
        outs = self.call(args)
        outs = outs if type(outs) is list else list(outs)
        for i, d, folded in self.cut:
            out = outs[i]
            n = out.shape[d] // p * b if folded else b
            outs[i] = out[:n] if d == 0 else out.narrow(d, 0, n)
        return outs

    def _past(self, b: int) -> int:
        log_once(log, f"past:{self.name}", "cgtrees: %s: batch size %d is past the largest batch bucket (%d): "
                 "such sizes run unpadded, each its own CUDA graph", self.name, b, self.largest)
        return b


def padded_rows(b: int, p: int, device: torch.device) -> torch.Tensor:
    """The rows of a batch of ``b`` padded to ``p``: 0..b-1, then row 0 again."""
    return torch.tensor([*range(b), *[0] * (p - b)], dtype=torch.long, device=device)
