"""GEMMs of few rows that read one input run as one ``cgtrees.grouped_mm`` launch, where timing says so.

A decode step's projections are ``mm(x, w.t())`` with x of a few rows (batch x new tokens) and w a
weight of thousands of rows in nn.Linear's layout [N, K]. cuBLAS runs each as a kernel of its own at
about 5 us however small; q, k and v (and gate and up) read the same x, so one kernel over their
weights saves two launches and reads x once (``grouped_gemv``: an H200, bf16, one row: q, k and v
15.5 us apart, 4.9 us in one). ``rewritten(gm, plan)`` groups such GEMMs by their input, up to
``grouped_gemv.MAX_WEIGHTS`` a group (a group of one is a skinny GEMM that a GEMV may still beat),
and times the group both ways on the device at compile time, as ``gemm_choice`` times a GEMM's
forms: cuBLAS as traced against the grouped kernel with each of a few block sizes. The grouped form
is taken where it is faster by more than ``gemm_choice.MARGIN``; ``gemm_decisions=rewrite`` always
takes it with the first block sizes (tests), ``keep`` never. Each choice is a line of the module's
header. A GEMM qualifies when its sizes are static, x is row-major with at most ``MAX_ROWS`` rows,
and w is a graph input (a parameter: its layout is the caller's) stored row-major [N, K].
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx

from cgtrees.codegen import fx_copy
from cgtrees.codegen.gemm_choice import MARGIN, random_like, span_bytes

if TYPE_CHECKING:
    from cgtrees.codegen.gemm_choice import GemmPlan

aten = torch.ops.aten

MAX_ROWS = 64  # past this many rows a GEMM is no longer bound by reading its weight once
_L2_BYTES = 50 << 20  # where the device does not say
MAX_WEIGHTS = 3  # grouped_gemv.MAX_WEIGHTS (not imported here: that module decorates Triton kernels)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (BLOCK_N, BLOCK_K, warps, SPLIT_K): one row (``gemv_row_kernel``), a few rows without tl.dot, with it
# one row: the best five of 196 on an H200 at TinyLlama's shapes, each within 5-15% of the best on all
# five of them (``benchmarks/probes/probe_gemv.py``); K split only where the rows are few and K long
_ONE_ROW_CONFIGS = ((2, 2048, 2, 1), (2, 1024, 4, 1), (1, 2048, 4, 1), (4, 2048, 8, 1), (2, 1024, 4, 4))
_ROW_CONFIGS = ((4, 512, 2, 1), (8, 512, 2, 1), (16, 512, 2, 1))
_DOT_CONFIGS = ((16, 256, 2, 1), (32, 256, 4, 1), (64, 128, 4, 1))


def rewritten(gm: torch.fx.GraphModule, plan: "GemmPlan") -> torch.fx.GraphModule:
    """``gm``, or a copy of it where the grouped form was chosen for some group of GEMMs."""
    groups = _groups(gm.graph)
    chosen = [(group, config) for group in groups if (config := _choose(group, plan)) is not None]
    if not chosen:
        return gm
    graph, copied = fx_copy.copied(gm)
    for group, config in chosen:
        _rewrite(graph, [copied[n.name] for n in group], config)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


# ------------------------------------------------------------------------------------------ finding
def weight(mm: torch.fx.Node) -> torch.fx.Node | None:
    """The graph input w of ``mm(x, w.t())``, where it qualifies, else None. The graph must not write w
    (``aten.copy_(w, ...)``): our GEMVs read their weights before waiting for the kernel before them
    (``codegen/pdl.py``)."""
    t = mm.args[1]
    if not isinstance(t, torch.fx.Node) or not (
            (t.target is aten.permute.default and list(t.args[1]) == [1, 0]) or t.target is aten.t.default):
        return None
    w = t.args[0]
    val = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
    if w.op != "placeholder" or val is None or val.dim() != 2 or val.stride() != (val.shape[1], 1):
        return None
    if any(u.target is aten.copy_.default and u.args[0] is w for u in w.users):
        return None
    return w


def qualifies(mm: torch.fx.Node) -> bool:
    x = mm.args[0]
    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    w = weight(mm)
    if xv is None or w is None or xv.dtype not in _DTYPES or w.meta["val"].dtype != xv.dtype:
        return False
    sizes = (*xv.shape, *xv.stride(), *w.meta["val"].shape)
    return all(isinstance(s, int) for s in sizes) and xv.dim() == 2 and xv.stride() == (xv.shape[1], 1) \
        and 0 < xv.shape[0] <= MAX_ROWS


def _groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The qualifying GEMMs, grouped by their input in graph order, at most ``MAX_WEIGHTS`` a group."""
    by_input: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for mm in graph.find_nodes(op="call_function", target=aten.mm.default):
        if qualifies(mm):
            by_input.setdefault(mm.args[0], []).append(mm)
    return [gemms[i:i + MAX_WEIGHTS] for gemms in by_input.values() for i in range(0, len(gemms), MAX_WEIGHTS)]


def _text(group: list[torch.fx.Node]) -> str:
    x = group[0].args[0].meta["val"]
    ns = "|".join(str(weight(mm).meta["val"].shape[0]) for mm in group)
    return f"mm {list(x.shape)} x {len(group)} weights [{ns}, {x.shape[1]}] {str(x.dtype).removeprefix('torch.')}"


# ------------------------------------------------------------------------------------------ choosing
def configs(rows: int, dtype: torch.dtype) -> tuple[tuple[int, int, int, int], ...]:
    if rows == 1:
        return _ONE_ROW_CONFIGS
    return _DOT_CONFIGS if dtype != torch.float32 else _ROW_CONFIGS


def _choose(group: list[torch.fx.Node], plan: "GemmPlan") -> tuple[int, int, int, int] | None:
    """The block sizes of the grouped form where it is taken, else None."""
    names = "/".join(mm.name for mm in group)
    x = group[0].args[0].meta["val"]
    candidates = configs(x.shape[0], x.dtype)
    how, why = plan.other_choice()
    if how != "time":
        taken = f"grouped_mm {config_text(candidates[0])}" if how == "rewrite" else "as traced"
        plan.note(names, _text(group), taken, (), why)
        return candidates[0] if how == "rewrite" else None
    forms = {"as traced": _cublas_form(group, plan.device)}
    forms.update({f"grouped_mm {config_text(c)}": _grouped_form(group, c, plan.device) for c in candidates})
    timings = plan.time_forms(forms)
    if timings is None:
        plan.note(names, _text(group), "as traced", (), "too large to time")
        return None
    best = min((t, name) for name, t in timings.items() if name != "as traced")
    if best[0] < timings["as traced"] * (1 - MARGIN):
        plan.note(names, _text(group), best[1], tuple(timings.items()))
        return candidates[[f"grouped_mm {config_text(c)}" for c in candidates].index(best[1])]
    plan.note(names, _text(group), "as traced", tuple(timings.items()))
    return None


def config_text(config: tuple[int, int, int, int]) -> str:
    """``BLOCK_N x BLOCK_K / warps``, and ``/split SPLIT_K`` where K is split."""
    block_n, block_k, warps, split_k = config
    return f"{block_n}x{block_k}/{warps}" + (f"/split{split_k}" if split_k > 1 else "")


def _cublas_form(group: list[torch.fx.Node], device: torch.device) -> tuple[str, Callable, int]:
    x, ws = _metas(group)

    def build() -> Callable[[], None]:
        tx, sets, outs = operands(x, ws, device)
        turn = iter(range(1 << 62))

        def run() -> None:
            for w, out in zip(sets[next(turn) % len(sets)], outs):
                torch.mm(tx, w.t(), out=out)
        return run

    return f"mms {_shapes(x, ws)} {device} rotating", build, operand_bytes(x, ws, device)


def _grouped_form(group: list[torch.fx.Node], config: tuple[int, int, int, int], device: torch.device
                  ) -> tuple[str, Callable, int]:
    x, ws = _metas(group)

    def build() -> Callable[[], None]:
        from cgtrees.codegen import grouped_gemv

        tx, sets, outs = operands(x, ws, device)
        turn = iter(range(1 << 62))
        return lambda: grouped_gemv.launch(tx, sets[next(turn) % len(sets)], outs, *config)

    return f"grouped_mm {_shapes(x, ws)} {config} {device} rotating", build, operand_bytes(x, ws, device)


def _metas(group: list[torch.fx.Node]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return group[0].args[0].meta["val"], [weight(mm).meta["val"] for mm in group]


def operands(x: torch.Tensor, ws: list[torch.Tensor], device: torch.device):
    """Random x, copies of the weights (of the traced layouts) that the timed calls take in turn,
    and the products' buffers. A decode step reads each weight once, from device memory: a weight
    read again while it sits in the L2 cache (an 8 MB q projection does; H100 and H200 keep 50 MB)
    would time the cache, so the copies together are larger than it, twice over."""
    outs = [torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=device) for w in ws]
    sets = [[random_like(w, device) for w in ws] for _ in range(_copies(ws, device))]
    return random_like(x, device), sets, outs


def _copies(ws: list[torch.Tensor], device: torch.device) -> int:
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if device.type == "cuda" else 0
    return max(1, -(-2 * (l2 or _L2_BYTES) // span_bytes(*ws)))


def _shapes(x: torch.Tensor, ws: list[torch.Tensor]) -> str:
    return f"{list(x.shape)} x {[list(w.shape) for w in ws]} {x.dtype}"


def operand_bytes(x: torch.Tensor, ws: list[torch.Tensor], device: torch.device) -> int:
    """What a form allocates: the weights' copies, x and the products."""
    return span_bytes(x) + _copies(ws, device) * span_bytes(*ws) + sum(x.shape[0] * w.shape[0] * x.element_size()
                                                                        for w in ws)


# ------------------------------------------------------------------------------------------ rewriting
def _rewrite(graph: torch.fx.Graph, group: list[torch.fx.Node], config: tuple[int, int, int, int]) -> None:
    """One ``cgtrees.grouped_mm`` call before the group's first GEMM; each GEMM's readers read its
    item of the result, and the GEMMs and their weights' transposes go."""
    from cgtrees.codegen import grouped_gemv  # noqa: F401 - registers the op (its kernel is decorated lazily)

    x = group[0].args[0]
    weights = [weight(mm) for mm in group]
    with graph.inserting_before(group[0]):
        call = graph.call_function(torch.ops.cgtrees.grouped_mm.default, (x, weights, *config))
        call.meta["val"] = [mm.meta["val"] for mm in group]
        call.meta["stack_trace"] = group[0].meta.get("stack_trace")
        items = []
        for i, mm in enumerate(group):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta.update(mm.meta)
            items.append(item)
    for mm, item in zip(group, items):
        transpose = mm.args[1]
        mm.replace_all_uses_with(item)
        graph.erase_node(mm)
        if not transpose.users:
            graph.erase_node(transpose)
