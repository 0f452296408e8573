"""Which form each GEMM of a graph takes, chosen by timing the forms on the device (issue 44).

Two choices, each between forms that compute the same values:

- **Aligned rows.** cuBLAS runs its fast tensor-core kernels only where each matrix's leading
  dimension is a multiple of 16 bytes. GPT-2's vocabulary (50257 columns) breaks that for all three
  of the LM head's GEMMs, and cuBLAS falls back to ``align1`` kernels (on the H200, 15.5 ms a
  training step against 2.4 ms aligned). The aligned form lays the unaligned matrices out with
  their rows padded to 16 bytes: the GEMM writes its result into a padded buffer (``mm.out``), and
  an operand that a kernel of ours writes (the loss's gradient) is written padded where it is
  computed, at no cost. Every reader goes through the buffer's own strides; only where a padded
  value leaves the graph is it copied to its traced layout, and that copy is timed with the form.
- **Bias in the epilogue or in the consumer.** A float32 ``addmm`` whose product feeds only our
  pointwise kernels may run as ``mm``, its bias added by those kernels (``lower_addmm``). cuBLAS
  picks its kernel per call: on [16,256] x [256,256] it gave ``addmm`` a 2.6 us gemv-like kernel and
  ``mm`` a 29 us tile, so no fixed rule holds either way.

``gemm_decisions`` (config) says how: ``measure`` (the default) times both forms with
``gemm_timing`` and takes the rewritten form only where it is faster by more than ``MARGIN``, so
a choice never loses more than that to its alternative on the shape timed; where nothing can be
timed (a CPU, the interpreter, a graph compiled during a capture) GEMMs stay as traced. ``keep``
never rewrites; ``rewrite`` always does where the rewrite applies, and ``align`` and ``unfuse`` only
the one choice (tests of the rewritten forms).
Each choice is a line of the generated module's header and of ``CompiledGraph.gemm_choices``: the
cache keeps the module, so a warm start times nothing.

Alignment applies to 2-D ``mm`` and ``addmm`` with static sizes; batched products are left as traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from backend.codegen import gemm_timing

aten = torch.ops.aten

MARGIN = 0.02  # a rewrite must be this much faster than the traced form
# mode -> (the alignment choice, the bias choice): "measure" times, "keep" never rewrites, "rewrite" always does
MODES = {"measure": ("measure", "measure"), "keep": ("keep", "keep"), "rewrite": ("rewrite", "rewrite"),
         "align": ("rewrite", "keep"), "unfuse": ("keep", "rewrite")}
GEMMS = frozenset({aten.mm.default, aten.addmm.default})
# views replayed on a padded buffer's strides (``replay``); a padded buffer has no other view
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
                   aten.t.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.default,
                   aten.squeeze.dim, aten.squeeze.dims})
_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
_ALIGN_BYTES = 16


@dataclass(frozen=True)
class Choice:
    """One GEMM's choice: what was timed and what was taken."""

    node: str
    gemm: str  # "mm [8192, 768] x [768, 50257] bfloat16"
    taken: str
    timings: tuple[tuple[str, float], ...]  # (form, microseconds) where timed
    why: str  # "timed", or why the forms were not timed

    def line(self) -> str:
        timed = ", ".join(f"{form} {us:.1f} us" for form, us in self.timings)
        return f"{self.node}: {self.gemm}: {self.taken} ({timed or self.why})"


class GemmPlan:
    """The choices for one graph. Alignment is decided before lowering (an operand's producer must
    know its layout when it is written); the bias is decided when ``lower_addmm`` asks."""

    def __init__(self, gm: torch.fx.GraphModule, mode: str, device: torch.device) -> None:
        if mode not in MODES:
            raise ValueError(f"cgtrees: gemm_decisions={mode!r}; valid values: {', '.join(MODES)}")
        self.mode, self.device = mode, device
        self._align_mode, self._bias_mode = MODES[mode]
        self.choices: list[Choice] = []
        self.padded: dict[str, tuple[int, ...]] = {}  # node name -> strides of its padded buffer
        self._addmm: dict[str, str | None] = {}
        self._untimed = gemm_timing.unavailable(device) if mode == "measure" else f"gemm_decisions={mode}"
        if self._align_mode != "keep":
            for node in gm.graph.nodes:
                if node.target in GEMMS and _static(node):
                    self._align(node)

    @staticmethod
    def of(gm: torch.fx.GraphModule, mode: str) -> "GemmPlan":
        return GemmPlan(gm, mode, _device(gm))

    # ------------------------------------------------------------------------------ what lowering asks
    def padded_strides(self, node: torch.fx.Node) -> tuple[int, ...] | None:
        """The strides ``node``'s buffer takes in place of its traced ones, or None."""
        return self.padded.get(node.name)

    def keeps_addmm(self, node: torch.fx.Node) -> str | None:
        """None where addmm ``node`` (which ``lower_addmm`` could unfuse) runs as mm plus the bias in
        its consumers, else why it stays one addmm."""
        if node.name not in self._addmm:
            self._addmm[node.name] = self._decide_addmm(node)
        return self._addmm[node.name]

    def _decide_addmm(self, node: torch.fx.Node) -> str | None:
        if self._bias_mode == "keep":
            return f"gemm_decisions={self.mode}"
        bias, a, b = (x.meta["val"] for x in node.args[:3])
        gemm = _gemm_text(node, a, b)
        if self._bias_mode == "rewrite":
            self.choices.append(Choice(node.name, gemm, "mm, bias in its consumers", (), self._untimed))
            return None
        if self._untimed or not _static(node) or node.name in self.padded:
            why = self._untimed or ("symbolic sizes" if not _static(node) else "its result is aligned")
            self.choices.append(Choice(node.name, gemm, "addmm", (), why))
            return why
        product = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device="meta")
        timings = self._time({"addmm": _gemm_form(bias, a, b, product, False, self.device),
                              "mm": _gemm_form(None, a, b, product, False, self.device)})
        if timings is None:
            return self._note(node, gemm, "addmm", (), "too large to time")
        if timings["mm"] < timings["addmm"] * (1 - MARGIN):
            self._note(node, gemm, "mm, bias in its consumers", tuple(timings.items()), "timed")
            return None
        self._note(node, gemm, "addmm", tuple(timings.items()), "timed")
        return f"timed: addmm {timings['addmm']:.1f} us, mm {timings['mm']:.1f} us"

    def comment(self) -> list[str]:
        """The module header's lines for the choices."""
        if not self.choices:
            return []
        return [f"# GEMM choices ({'timed on ' + _gpu(self.device) if not self._untimed else self._untimed}):",
                *(f"#   {c.line()}" for c in self.choices)]

    def lines(self) -> tuple[str, ...]:
        return tuple(c.line() for c in self.choices)

    # ----------------------------------------------------------------------------------- alignment
    def _align(self, node: torch.fx.Node) -> None:
        out = node.meta["val"]
        a_node, b_node = node.args[1:3] if node.target is aten.addmm.default else node.args[:2]
        padded: dict[str, tuple[int, ...]] = {}
        aligned = []
        for operand in (a_node, b_node):
            meta = operand.meta["val"]
            if _aligned(meta):
                aligned.append(meta)
                continue
            found = self._pad_operand(operand)
            if found is None:
                aligned.append(meta)
                continue
            views, operand_meta = found
            padded.update(views)
            aligned.append(operand_meta)
        copy = False
        out_aligned = out
        if not _aligned(out):
            metas = _padded_views(node, allow_output=True)
            if metas is not None:
                out_aligned, copy = metas[node], any(u.op == "output" for m in metas for u in m.users)
                padded.update(_strides(metas))
        if not padded:
            return
        gemm = _gemm_text(node, a_node.meta["val"], b_node.meta["val"])
        if self._align_mode == "rewrite":
            self.padded.update(padded)
            self.choices.append(Choice(node.name, gemm, "aligned rows", (), self._untimed))
            return
        if self._untimed:
            self.choices.append(Choice(node.name, gemm, "rows as traced", (), self._untimed))
            return
        bias = node.args[0].meta["val"] if node.target is aten.addmm.default else None
        traced = _gemm_form(bias, a_node.meta["val"], b_node.meta["val"], out, False, self.device)
        rewritten = _gemm_form(bias, *aligned, out_aligned, copy, self.device)
        timings = self._time({"rows as traced": traced, "aligned rows" + (" + copy out" if copy else ""): rewritten})
        if timings is None:
            self._note(node, gemm, "rows as traced", (), "too large to time")
            return
        (_, traced_us), (form, aligned_us) = timings.items()
        if aligned_us < traced_us * (1 - MARGIN):
            self.padded.update(padded)
            self._note(node, gemm, form, tuple(timings.items()), "timed")
        else:
            self._note(node, gemm, "rows as traced", tuple(timings.items()), "timed")

    def _pad_operand(self, operand: torch.fx.Node) -> tuple[dict[str, tuple[int, ...]], torch.Tensor] | None:
        """The strides that align ``operand``: of the node it views (through views) and of every
        view of that node (whichever of them is written to memory takes its padded strides), and
        the operand's meta under them; None where its storage cannot take padded rows."""
        storage = operand
        while storage.target in VIEWS:
            storage = storage.args[0]
        if storage.op != "call_function" or not isinstance(storage.meta.get("val"), torch.Tensor):
            return None
        metas = _padded_views(storage, allow_output=storage.target in GEMMS)
        if metas is None or operand not in metas or not _aligned(metas[operand]):
            return None
        return _strides(metas), metas[operand]

    # -------------------------------------------------------------------------------------- timing
    def _time(self, forms: dict[str, tuple[str, Callable[[], Callable[[], None]], int]]) -> dict[str, float] | None:
        free, _ = torch.cuda.mem_get_info(self.device)
        if sum(nbytes for _, _, nbytes in forms.values()) * 2 > free:
            return None
        out = {}
        for name, (key, build, _) in forms.items():
            run = build()
            out[name] = gemm_timing.time_us(key, self.device, run)
            del run
        return out

    def _note(self, node: torch.fx.Node, gemm: str, taken: str, timings: tuple, why: str) -> str:
        self.choices.append(Choice(node.name, gemm, taken, timings, why))
        return why


# ------------------------------------------------------------------------------------------ layouts
def replay(view: torch.fx.Node, source: torch.Tensor) -> torch.Tensor | None:
    """View op ``view`` applied to ``source`` (a meta tensor with the strides its buffer really has),
    or None where those strides do not allow it without a copy."""
    try:
        if view.target in _RESHAPES:
            return source.view(view.args[1])
        return view.target(source, *view.args[1:], **view.kwargs)
    except RuntimeError:
        return None


def strided(meta: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """A meta-device tensor of ``meta``'s sizes and dtype with ``strides``."""
    return torch.empty_strided(tuple(meta.shape), strides, dtype=meta.dtype, device="meta")


def padded_meta(meta: torch.Tensor) -> torch.Tensor | None:
    """A meta tensor as ``meta`` (contiguous) with its rows padded to 16 bytes; None where the rows
    are aligned already or ``meta`` is not contiguous."""
    if meta.dim() < 2 or not meta.is_contiguous() or meta.storage_offset() != 0:
        return None
    quantum = max(1, _ALIGN_BYTES // meta.element_size())
    n = int(meta.shape[-1])
    if n % quantum == 0 or n == 1:
        return None
    row = -(-n // quantum) * quantum
    strides, step = [], 1
    for size in reversed([*meta.shape[:-1], row]):
        strides.append(step)
        step *= int(size)
    strides.reverse()
    return strided(meta, tuple(strides))


def _padded_views(storage: torch.fx.Node, allow_output: bool) -> dict[torch.fx.Node, torch.Tensor] | None:
    """``storage`` with padded rows and every view of it (through ``VIEWS``) as replayed on them;
    None where its rows need no padding, a view cannot be replayed, another kind of view reads it,
    or (unless ``allow_output``) it or a view of it is a graph output."""
    start = padded_meta(storage.meta["val"])
    if start is None:
        return None
    metas, pending = {storage: start}, [storage]
    while pending:
        node = pending.pop()
        for user in node.users:
            if user.op == "output":
                if not allow_output:
                    return None
            elif user.target in VIEWS:
                meta = replay(user, metas[node])
                if meta is None:
                    return None
                metas[user] = meta
                pending.append(user)
            elif _is_view(user.target):
                return None
    return metas


def _strides(metas: dict[torch.fx.Node, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {node.name: tuple(int(s) for s in meta.stride()) for node, meta in metas.items()}


def _is_view(target: object) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _aligned(meta: torch.Tensor) -> bool:
    """Whether a 2-D operand's leading dimension and address are multiples of 16 bytes."""
    if meta.dim() != 2:
        return True
    quantum = max(1, _ALIGN_BYTES // meta.element_size())
    s0, s1 = (int(s) for s in meta.stride())
    n0, n1 = (int(n) for n in meta.shape)
    lead = s0 if s1 == 1 else s1 if s0 == 1 else None
    if lead is None or (s1 == 1 and n0 == 1) or (s0 == 1 and s1 != 1 and n1 == 1):
        return True  # not a BLAS layout (aten copies it) or a single row: nothing to align
    return lead % quantum == 0 and int(meta.storage_offset()) % quantum == 0


def _static(node: torch.fx.Node) -> bool:
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
    return all(isinstance(v, torch.Tensor) and all(isinstance(x, int) for x in (*v.shape, *v.stride())) for v in vals)


def _device(gm: torch.fx.GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


def _gpu(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _gemm_text(node: torch.fx.Node, a: torch.Tensor, b: torch.Tensor) -> str:
    op = "addmm" if node.target is aten.addmm.default else "mm"
    return f"{op} {list(a.shape)} x {list(b.shape)} {str(a.dtype).removeprefix('torch.')}"


# -------------------------------------------------------------------------------------------- forms
def _describe(meta: torch.Tensor) -> str:
    return f"{list(meta.shape)}/{list(meta.stride())}"


def _tensor(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.empty_strided(tuple(meta.shape), tuple(meta.stride()), dtype=meta.dtype, device=device)
    return t.normal_() if t.is_floating_point() else t.zero_()


def _nbytes(*metas: torch.Tensor | None) -> int:
    total = 0
    for m in metas:
        if m is not None:
            extent = 1 + sum((n - 1) * s for n, s in zip(m.shape, m.stride()) if n > 0)
            total += extent * m.element_size()
    return total


def _gemm_form(bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, copy: bool,
               device: torch.device) -> tuple[str, Callable[[], Callable[[], None]], int]:
    """A timed form: ``out = bias + a @ b`` into ``out``'s layout, plus a copy to a contiguous
    tensor where ``copy``."""
    key = f"{'addmm' if bias is not None else 'mm'} {_describe(a)} x {_describe(b)} -> {_describe(out)} " \
          f"{a.dtype} {device}{' copy' if copy else ''}"

    def build() -> Callable[[], None]:
        ta, tb, tc = _tensor(a, device), _tensor(b, device), _tensor(out, device)
        tbias = _tensor(bias, device) if bias is not None else None
        contiguous = torch.empty(tuple(out.shape), dtype=out.dtype, device=device) if copy else None

        def run() -> None:
            if tbias is not None:
                torch.addmm(tbias, ta, tb, out=tc)
            else:
                torch.mm(ta, tb, out=tc)
            if contiguous is not None:
                contiguous.copy_(tc)

        return run

    return key, build, _nbytes(a, b, out, bias) + (_nbytes(out) if copy else 0)
