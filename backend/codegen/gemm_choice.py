"""Which form each GEMM of a graph takes, chosen by timing the forms on the device (issue 44).

Two choices, each between forms that compute the same values:

- **Padded to aligned sizes.** cuBLAS runs its fast tensor-core kernels only where the GEMM's
  sizes and leading dimensions are multiples of 16 bytes. GPT-2's vocabulary (50257) breaks that
  for all three of the LM head's GEMMs, and cuBLAS runs ``align1`` kernels instead (H100, bfloat16:
  6.6, 4.5 and 4.3 ms a step). The padded form multiplies operands with zero rows and columns
  appended up to aligned sizes and reads its result through a slice (``gemm_padding``): a pad of a
  value our kernels compute is written by the kernel that computes it, a pad of an input or of a
  library call's result is a copy, and a padded result that leaves the graph is copied to its
  traced layout. Padding the leading dimension alone did not help the forward's or the input
  gradient's GEMM on the H100 (the unaligned size did), so the sizes are padded.
- **Bias in the epilogue or in the consumer.** A float32 ``addmm`` whose product feeds only our
  pointwise kernels may run as ``mm``, its bias added by those kernels (``lower_addmm``). cuBLAS
  picks its kernel per call: on [16,256] x [256,256] it gave ``addmm`` a 3 us gemv-like kernel and
  ``mm`` a 31 us tile (H100), so no fixed rule holds either way.

``gemm_decisions`` (config) says how: ``measure`` (the default) times both forms, copies
included, with ``gemm_timing``, and takes the rewritten one only where it is faster by more than
``MARGIN``: a choice never loses more than that to its alternative on the shape timed. Where
nothing can be timed (a CPU, the interpreter, a graph compiled during a capture) GEMMs stay as
traced. ``keep`` never rewrites; ``rewrite`` always does where a rewrite applies, ``align`` and
``unfuse`` only the one (tests of the rewritten forms). Each choice is a line of the generated
module's header and of ``CompiledGraph.gemm_choices``; the cache keeps the module, so a warm start
times nothing.

Padding applies to 2-D ``mm`` and ``addmm`` (a 1-D bias) with static sizes; batched products are
left as traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from cgtrees.codegen import compat, gemm_timing
from cgtrees.codegen.gemm_padding import TRANSPOSES, VIEWS
from cgtrees.codegen.lowering import is_library_op

aten = torch.ops.aten

MARGIN = 0.02  # a rewrite must be this much faster than the traced form
# mode -> (the alignment choice, the bias choice): "measure" times, "keep" never rewrites, "rewrite" always does
MODES = {"measure": ("measure", "measure"), "keep": ("keep", "keep"), "rewrite": ("rewrite", "rewrite"),
         "align": ("rewrite", "keep"), "unfuse": ("keep", "rewrite")}
GEMMS = frozenset({aten.mm.default, aten.addmm.default})
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
        self.pads: dict[str, tuple[int, int, int]] = {}  # GEMM node name -> (M, K, N) it is padded to
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
        if self._untimed or not _static(node):
            why = self._untimed or "symbolic sizes"
            self.choices.append(Choice(node.name, gemm, "addmm", (), why))
            return why
        product = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device="meta")
        timings = self._time({"addmm": _gemm_form(bias, a, b, product, self.device),
                              "mm": _gemm_form(None, a, b, product, self.device)})
        if timings is None:
            return self._note(node, gemm, "addmm", (), "too large to time")
        if timings["mm"] < timings["addmm"] * (1 - MARGIN):
            self._note(node, gemm, "mm, bias in its consumers", tuple(timings.items()), "timed")
            return None
        self._note(node, gemm, "addmm", tuple(timings.items()), "timed")
        return f"timed: addmm {timings['addmm']:.1f} us, mm {timings['mm']:.1f} us"

    # ------------------------------------------------------------------ for other timed choices
    def other_choice(self) -> tuple[str, str]:
        """How a choice outside this plan's two is made (``grouped_attention``): ("time", "") where
        its forms are timed, else ("rewrite" or "keep", why)."""
        if self.mode == "rewrite":
            return "rewrite", "gemm_decisions=rewrite"
        if self.mode != "measure":
            return "keep", f"gemm_decisions={self.mode}"
        return ("keep", self._untimed) if self._untimed else ("time", "")

    def time_forms(self, forms: dict[str, tuple[str, Callable[[], Callable[[], None]], int]], alone: bool = False
                   ) -> dict[str, float] | None:
        """Microseconds of each form (name -> (key, build, bytes)), or None where too large to time;
        ``alone``: each call after a kernel that has ended (``gemm_timing.time_us``)."""
        return self._time(forms, alone)

    def note(self, node: str, what: str, taken: str, timings: tuple = (), why: str = "timed") -> None:
        self.choices.append(Choice(node, what, taken, timings, why))

    def undo_pads(self, why: str) -> None:
        """The padded forms are not taken after all (``gemm_padding.NotPadded``)."""
        for i, c in enumerate(self.choices):
            if c.node in self.pads:
                self.choices[i] = Choice(c.node, c.gemm, "as traced", c.timings, f"not padded: {why}")
        self.pads.clear()

    def comment(self) -> list[str]:
        """The module header's lines for the choices."""
        if not self.choices:
            return []
        return [f"# GEMM choices ({'timed on ' + _gpu(self.device) if not self._untimed else self._untimed}):",
                *(f"#   {c.line()}" for c in self.choices)]

    def lines(self) -> tuple[str, ...]:
        return tuple(c.line() for c in self.choices)

    # ------------------------------------------------------------------------------------- padding
    def _align(self, node: torch.fx.Node) -> None:
        a_node, b_node = node.args[1:3] if node.target is aten.addmm.default else node.args[:2]
        a, b = a_node.meta["val"], b_node.meta["val"]
        to = padded_sizes(node)
        if to is None:
            return
        gemm = _gemm_text(node, a, b)
        if self._align_mode == "rewrite" or self._untimed:
            taken = "padded to " + _sizes_text(to) if self._align_mode == "rewrite" else "as traced"
            if self._align_mode == "rewrite":
                self.pads[node.name] = to
            self.choices.append(Choice(node.name, gemm, taken, (), self._untimed))
            return
        bias = node.args[0].meta["val"] if node.target is aten.addmm.default else None
        out = node.meta["val"]
        copies = tuple(_copied(x) for x in (a_node, b_node))
        leaves = _leaves_graph(node)
        padded_form = "padded to " + _sizes_text(to) + (" + copy out" if leaves else "")
        timings = self._time({
            "as traced": _gemm_form(bias, a, b, out, self.device),
            padded_form: _padded_form(bias, a, b, to, copies, leaves, self.device)})
        if timings is None:
            self._note(node, gemm, "as traced", (), "too large to time")
            return
        if timings[padded_form] < timings["as traced"] * (1 - MARGIN):
            self.pads[node.name] = to
            self._note(node, gemm, padded_form, tuple(timings.items()), "timed")
        else:
            self._note(node, gemm, "as traced", tuple(timings.items()), "timed")

    # -------------------------------------------------------------------------------------- timing
    def _time(self, forms: dict[str, tuple[str, Callable[[], Callable[[], None]], int]], alone: bool = False
              ) -> dict[str, float] | None:
        with compat.real_tensors():  # the compiler may be called under a fake mode
            free, _ = torch.cuda.mem_get_info(self.device)
            if sum(nbytes for _, _, nbytes in forms.values()) * 2 > free:
                return None
            try:
                return {name: gemm_timing.time_us(key, self.device, build, alone)
                        for name, (key, build, _) in forms.items()}
            finally:
                compat.clear_cublas_workspaces()  # the timing stream's, 32 MiB on an H100, kept by torch

    def _note(self, node: torch.fx.Node, gemm: str, taken: str, timings: tuple, why: str) -> str:
        self.choices.append(Choice(node.name, gemm, taken, timings, why))
        return why


# ------------------------------------------------------------------------------------------ sizes
def quantum(dtype: torch.dtype) -> int:
    """Elements in 16 bytes."""
    return max(1, _ALIGN_BYTES // dtype.itemsize)


def padded_sizes(node: torch.fx.Node) -> tuple[int, int, int] | None:
    """(M, K, N) of GEMM ``node`` padded where padding could help, or None where nothing needs it:
    K and N where they are not multiples of 16 bytes, and M where the first operand is
    column-major (M is then its leading dimension; a row-major operand's M only counts rows)."""
    a_node, b_node = node.args[1:3] if node.target is aten.addmm.default else node.args[:2]
    a, b = a_node.meta["val"], b_node.meta["val"]
    if node.target is aten.addmm.default and node.args[0].meta["val"].dim() != 1:
        return None
    q = quantum(a.dtype)
    (m, k), n = a.shape, b.shape[1]
    up = [-(-int(x) // q) * q for x in (m, k, n)]
    column_major = a.stride(0) == 1 and m > 1
    to = (up[0] if column_major else int(m), up[1], up[2])
    return None if to == (int(m), int(k), int(n)) else to


def _sizes_text(to: tuple[int, int, int]) -> str:
    return "x".join(map(str, to))


def _copied(operand: torch.fx.Node) -> bool:
    """Whether padding ``operand`` copies it (an input, or a library call's result, through
    transposes) rather than having the kernel that computes it write it padded."""
    while operand.target in TRANSPOSES:
        operand = operand.args[0]
    return operand.op != "call_function" or is_library_op(operand.target)


def _leaves_graph(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value, or a view of it, is a graph output (then copied to its layout)."""
    pending = [node]
    while pending:
        value = pending.pop()
        for user in value.users:
            if user.op == "output":
                return True
            if user.target in VIEWS:
                pending.append(user)
    return False


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
def layout_text(meta: torch.Tensor) -> str:
    """``[8192, 768]/[768, 1]``: a tensor's sizes and strides, for a timing key."""
    return f"{list(meta.shape)}/{list(meta.stride())}"


def random_like(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Random values from a generator of our own: timing must not move the user's random stream
    (a cold process would then draw other numbers than a warm one, which times nothing)."""
    t = torch.empty_strided(tuple(meta.shape), tuple(meta.stride()), dtype=meta.dtype, device=device)
    if not t.is_floating_point():
        return t.zero_()
    generator = torch.Generator(device).manual_seed(0)
    return t.normal_(generator=generator)


def span_bytes(*metas: torch.Tensor | None) -> int:
    total = 0
    for m in metas:
        if m is not None:
            extent = 1 + sum((n - 1) * s for n, s in zip(m.shape, m.stride()) if n > 0)
            total += extent * m.element_size()
    return total


def _gemm_form(bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
               device: torch.device) -> tuple[str, Callable[[], Callable[[], None]], int]:
    """The traced form: ``out = bias + a @ b`` on the traced layouts."""
    key = f"{'addmm' if bias is not None else 'mm'} {layout_text(a)} x {layout_text(b)} {a.dtype} {device}"

    def build() -> Callable[[], None]:
        ta, tb = random_like(a, device), random_like(b, device)
        tbias = random_like(bias, device) if bias is not None else None
        tc = torch.empty(tuple(out.shape), dtype=out.dtype, device=device)
        if tbias is not None:
            return lambda: torch.addmm(tbias, ta, tb, out=tc)
        return lambda: torch.mm(ta, tb, out=tc)

    return key, build, span_bytes(a, b, out, bias)


def _padded_form(bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, to: tuple[int, int, int],
                 copies: tuple[bool, bool], leaves: bool, device: torch.device):
    """The padded form: operands padded (a copy where ``copies`` says so, else written padded by
    their producer, for free), the product at the padded sizes, its slice copied out if ``leaves``."""
    m, k, n = to
    a_to, b_to = _padded_like(a, (m, k)), _padded_like(b, (k, n))
    key = f"padded {'addmm' if bias is not None else 'mm'} {layout_text(a)} x {layout_text(b)} to {to} copies " \
          f"{copies} out {leaves} {a.dtype} {device}"

    def build() -> Callable[[], None]:
        ta, tb = random_like(a_to, device), random_like(b_to, device)
        sources = [random_like(x, device) if copy else None for x, copy in zip((a, b), copies)]
        tbias = random_like(torch.empty(n, dtype=bias.dtype, device="meta"), device) if bias is not None else None
        tc = torch.empty((m, n), dtype=a.dtype, device=device)
        out = torch.empty(tuple(int(x) for x in (a.shape[0], b.shape[1])), dtype=a.dtype, device=device)

        def run() -> None:
            for src, dst in zip(sources, (ta, tb)):
                if src is not None:
                    dst[: src.shape[0], : src.shape[1]].copy_(src)
            if tbias is not None:
                torch.addmm(tbias, ta, tb, out=tc)
            else:
                torch.mm(ta, tb, out=tc)
            if leaves:
                out.copy_(tc[: out.shape[0], : out.shape[1]])

        return run

    return key, build, span_bytes(a_to, b_to, a, b) + 2 * m * n * a.element_size()


def _padded_like(meta: torch.Tensor, sizes: tuple[int, int]) -> torch.Tensor:
    """A meta matrix of ``sizes``, column-major where ``meta`` is (a transposed operand stays one)."""
    column_major = meta.stride(0) == 1 and meta.shape[0] > 1 and meta.stride(1) != 1
    strides = (1, sizes[0]) if column_major else (sizes[1], 1)
    return torch.empty_strided(sizes, strides, dtype=meta.dtype, device="meta")
