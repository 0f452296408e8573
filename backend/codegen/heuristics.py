"""Block sizes and ``num_warps``: a fixed, documented heuristic (no autotuning yet).

Pointwise kernels: 1024 elements per program and 4 warps (8 elements per thread), which keeps
loads wide and is within a few percent of copy bandwidth on H100-class GPUs for large tensors;
small tensors use one block of the next power of two.

A pointwise kernel of ``HEAVY_LOADS`` loads or more per element (an unrolled 5x5 or 7x7 depthwise
convolution: a window and a weight per tap) takes ``HEAVY_XBLOCK`` elements per program: Triton's
compile time grows with the unrolled loads times the elements each thread holds (a 7x7 window with a
fused GELU, sm_90: 2.4 s at 1024 elements, 1.2 s at 256; ``benchmarks/probes/probe_compile_time.py``), and
such a kernel has loads enough in flight at 2 elements a thread.

Reductions: a row of at most ``PERSISTENT_LIMIT`` elements is reduced in registers ("persistent",
one block of ``RBLOCK = next_pow2(row)`` columns; rows per program so that a block holds about 4096
elements, but fewer while that leaves under ``MIN_PROGRAMS`` programs: 16 rows of 256 were one
program on one SM, 4x slower than 16 programs of one row each); warps grow with the block (4 up
to 2048 elements, 8 up to 8192, 16 beyond). Longer or symbolic rows loop over ``RBLOCK = 2048``
columns with 16 warps, 4 elements a thread (``LOOP_RBLOCK``, ``LOOP_WARPS``): on an H200, over 8192 x
50257 logits, a float32 softmax took 1.54 ms a call against 2.00 at 1024 columns and 8 warps, 1.81
at 2048 and 8, 1.61 at 4096 and 16; a cross-entropy's forward and backward 1.17 ms against 1.25,
1.66 and 1.59 (Inductor: 1.61 and 1.38; ``tests/gpu/long_rows_probe.py``). At 8 elements a thread
the online softmax's statistics loop took twice as long (0.91 ms against 0.42 to 0.45).
When the reduced dimension is not the innermost
in memory (a column reduction), programs take ``COLUMN_XBLOCK`` rows so that loads along the rows
coalesce (the fastest lane index walks the adjacent outputs); such a block stays persistent only
while it holds at most ``PERSISTENT_LIMIT`` elements (narrowed as below where programs are few),
and otherwise loops over ``COLUMN_RBLOCK`` reduced elements at a time. (A [64, 8192] persistent
block, as a column sum over 8192 rows once got, spills every register: Triton then compiled it
for minutes.)

Split reductions: a reduction with few output rows and long rows (a BatchNorm statistic over
(N, H, W), a bias gradient summing 8192 rows) would run on a handful of programs and leave most of
the GPU idle. Such a reduction runs in two: the first stage reduces ``parts`` chunks of a reduced
dimension (one partial result per chunk), the second reduces the partials (``Split``). Whether the
reduced elements are the innermost in memory (a row) or not (a column) is read off the input's
strides by the lowering, not off its logical dimensions: a channels-last BatchNorm reduces N, H
and W, the last logical dims, but in memory its reduced elements are rows of C channels apart.

- Rows: ``split_reduction`` chooses the fewest parts (a divisor of the outermost splittable
  reduced dimension) that give at least ``SPLIT_PROGRAMS`` programs, keeping chunks of at least
  ``SPLIT_MIN_CHUNK`` elements. Small reductions (under ``SPLIT_MIN_NUMEL`` elements in all) stay
  one kernel: a second launch would cost more than it saves.
- Columns: a program reads ``COLUMN_XBLOCK`` adjacent outputs (32 float32: one 128-byte line per
  reduced row) and loops over its rows, one load round trip (~1 us) per ``COLUMN_RBLOCK`` rows, so
  a column reduction over many rows is split as soon as its programs are fewer than
  ``COLUMN_SPLIT_PROGRAMS`` and its rows at least ``COLUMN_SPLIT_MIN_RNUMEL``. Its parts may
  exceed one dimension: stage 1 keeps the outer reduced dims whole and splits the next one
  (N=32 kept, H=112 cut in 16: 512 parts), as few parts as reach ``COLUMN_SPLIT_PROGRAMS``
  programs, with at least ``COLUMN_MIN_CHUNK`` rows each and at most ``COLUMN_MAX_PARTS`` parts
  (the second stage stays one persistent block per ``COLUMN_MIN_XBLOCK`` outputs). The partials
  are laid out parts-outermost, so the second stage is a column reduction with adjacent outputs too.
- A column block with few programs (fewer than ``COLUMN_NARROW_PROGRAMS`` at ``COLUMN_XBLOCK``
  rows, the second stage of a split) may narrow to ``COLUMN_MIN_XBLOCK`` outputs (32 bytes, one
  memory sector) so that its reduced rows fit one persistent block: one load round trip, not one
  per ``COLUMN_RBLOCK`` rows. A persistent column block, too, narrows toward that width while it
  leaves under ``MIN_PROGRAMS`` programs (a bias gradient over 16 rows of 256 outputs: 32 programs
  of 8 outputs, not one of 256).

Scans (cumsum) hold a whole row in one block of ``RBLOCK = next_pow2(row)`` columns, rows of at
most ``SCAN_LIMIT`` elements (longer ones are scanned in chunks, then their totals: ``lower_scan``),
rows per program as for a persistent reduction, whether the scanned dimension is the innermost in memory or not.

Under Triton's interpreter every program costs Python time, so blocks are larger there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

PERSISTENT_LIMIT = 8192
HEAVY_LOADS = 48  # loads per element of a pointwise kernel that take HEAVY_XBLOCK (a 5x5 convolution's 50)
HEAVY_XBLOCK = 256
MIN_PROGRAMS = 128  # a persistent reduction's blocks shrink until this many programs (H100: 132 SMs)
LOOP_RBLOCK = 2048
LOOP_WARPS = 16
COLUMN_XBLOCK = 32  # adjacent outputs per column block: 32 float32, a 128-byte line per reduced row
COLUMN_RBLOCK = 64  # reduced rows per loop step of a [COLUMN_XBLOCK, COLUMN_RBLOCK] column block
COLUMN_WARPS = 8  # of a looped column block
COLUMN_MIN_XBLOCK = 8  # 32 bytes of float32: one memory sector per reduced row
COLUMN_NARROW_PROGRAMS = 128  # below this many programs a column block may narrow to COLUMN_MIN_XBLOCK
COLUMN_SPLIT_PROGRAMS = 1024  # stage-1 programs a split column reduction aims at (132 SMs, several each)
COLUMN_SPLIT_MIN_RNUMEL = 1024  # shorter columns loop at most 16 times: one kernel
COLUMN_SPLIT_MIN_NUMEL = 1 << 16  # 256 KB of float32: below, a second launch costs more
COLUMN_MIN_CHUNK = 64  # reduced rows per stage-1 program at least (one [32, 64] block)
COLUMN_MAX_PARTS = PERSISTENT_LIMIT // COLUMN_MIN_XBLOCK  # the partials of an output fit one block
SPLIT_MIN_RNUMEL = 8192
SPLIT_MIN_NUMEL = 1 << 18  # below this the one-kernel reduction is a few microseconds anyway
SPLIT_PROGRAMS = 1024
SPLIT_MIN_CHUNK = 256
SCAN_LIMIT = 1 << 14


@dataclass(frozen=True)
class Config:
    xblock: int
    rblock: int  # 1 for pointwise kernels
    num_warps: int
    persistent: bool = True


@dataclass(frozen=True)
class Split:
    """Reduce in two stages. Stage 1 cuts reduced dim ``dim`` into ``parts`` chunks and keeps the
    reduced dims ``keep`` (those before ``dim``) whole: one partial per part and kept index.
    Stage 2 reduces the partials. ``outer``: the partials are laid out parts, then ``keep``,
    outermost (a column reduction's: each part's outputs stay adjacent); otherwise ``parts``
    takes ``dim``'s place."""

    dim: int
    parts: int
    keep: tuple[int, ...] = ()
    outer: bool = False


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _concrete(n: sympy.Expr) -> int | None:
    n = sympy.sympify(n)
    return int(n) if n.is_number else None


def pointwise(numel: sympy.Expr, interpret: bool, loads: int = 1) -> Config:
    block = 4096 if interpret else 1024 if loads < HEAVY_LOADS else HEAVY_XBLOCK
    n = _concrete(numel)
    if n is not None:
        block = max(16, min(block, next_pow2(n)))
    return Config(block, 1, 4 if block >= 512 else max(1, block // 128))


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def reduction(xnumel: sympy.Expr, rnumel: sympy.Expr, inner: bool, interpret: bool) -> Config:
    r, x = _concrete(rnumel), _concrete(xnumel)
    budget = 16384 if interpret else 4096
    if not inner:
        return _column(x, r, budget, interpret)
    if r is not None and r <= PERSISTENT_LIMIT:
        rblock = max(2, next_pow2(r))
        xblock = max(1, budget // rblock)
        if x is not None:
            xblock = _spread(max(1, min(xblock, next_pow2(x))), x, 1, interpret)
        return Config(xblock, rblock, _warps(xblock * rblock), True)
    return Config(1, LOOP_RBLOCK * (4 if interpret else 1), LOOP_WARPS, False)


def _spread(xblock: int, x: int, least: int, interpret: bool) -> int:
    """``xblock`` halved (not below ``least``) while ``x`` outputs in blocks of it make fewer than
    ``MIN_PROGRAMS`` programs: a small reduction on one SM waits on one SM's bandwidth. Not under
    the interpreter, where each program costs Python time."""
    if interpret:
        return xblock
    while xblock > least and -(-x // xblock) < MIN_PROGRAMS:
        xblock //= 2
    return xblock


def _column(x: int | None, r: int | None, budget: int, interpret: bool) -> Config:
    """A column reduction: blocks of adjacent outputs (the fastest lane index walks them)."""
    least = 1 if interpret else column_min_xblock(x)
    if r is not None and r <= PERSISTENT_LIMIT and least * next_pow2(r) <= PERSISTENT_LIMIT:
        rblock = max(2, next_pow2(r))
        xblock = max(least, budget // rblock)
        if x is not None:
            xblock = _spread(max(1, min(xblock, next_pow2(x))), x, least, interpret)
        return Config(xblock, rblock, _warps(xblock * rblock), True)
    if interpret:
        return Config(64, 64, 8, False)
    xblock = COLUMN_XBLOCK if x is None else min(COLUMN_XBLOCK, next_pow2(x))
    return Config(xblock, COLUMN_XBLOCK * COLUMN_RBLOCK // xblock, COLUMN_WARPS, False)


def column_min_xblock(x: int | None) -> int:
    """The fewest adjacent outputs a compiled column block holds: ``COLUMN_XBLOCK``, or one sector's
    worth when that many would leave the GPU mostly idle anyway (a split's second stage)."""
    if x is not None and -(-x // COLUMN_XBLOCK) < COLUMN_NARROW_PROGRAMS:
        return min(COLUMN_MIN_XBLOCK, next_pow2(x))
    return COLUMN_XBLOCK


def scan(xnumel: sympy.Expr, rnumel: sympy.Expr, interpret: bool) -> Config:
    """One block holds whole rows (the lowering checked ``rnumel <= SCAN_LIMIT``)."""
    r, x = _concrete(rnumel), _concrete(xnumel)
    assert r is not None and r <= SCAN_LIMIT, f"a scan over {rnumel} elements"
    rblock = max(2, next_pow2(r))
    xblock = max(1, (16384 if interpret else 4096) // rblock)
    if x is not None:
        xblock = max(1, min(xblock, next_pow2(x)))
    return Config(xblock, rblock, _warps(xblock * rblock), True)


def split_reduction(size: tuple[sympy.Expr, ...], dims: tuple[int, ...], inner: bool) -> Split | None:
    """How to reduce ``dims`` of ``size`` in two stages; None for one kernel (enough programs
    already, short rows, or symbolic sizes). ``inner``: the reduced elements are adjacent in
    memory (a row reduction), else the outputs are (a column reduction)."""
    sizes = [_concrete(n) for n in size]
    if not dims or any(n is None for n in sizes):
        return None
    rnumel = math.prod(sizes[d] for d in dims)
    xnumel = math.prod(n for d, n in enumerate(sizes) if d not in dims)
    if inner:
        return _split_rows(sizes, dims, rnumel, xnumel)
    return _split_columns(sizes, dims, rnumel, xnumel)


def _split_rows(sizes: list[int], dims: tuple[int, ...], rnumel: int, xnumel: int) -> Split | None:
    """The fewest parts of one dimension that give ``SPLIT_PROGRAMS`` rows."""
    if rnumel < SPLIT_MIN_RNUMEL or rnumel * xnumel < SPLIT_MIN_NUMEL or xnumel >= SPLIT_PROGRAMS:
        return None
    wanted = -(-SPLIT_PROGRAMS // max(xnumel, 1))
    for d in dims:
        best = None
        for parts in range(2, sizes[d] + 1):
            if sizes[d] % parts:
                continue
            if rnumel // parts < SPLIT_MIN_CHUNK:
                break
            best = parts
            if parts >= wanted:
                break
        if best is not None:
            return Split(d, best)
    return None


def _split_columns(sizes: list[int], dims: tuple[int, ...], rnumel: int, xnumel: int) -> Split | None:
    """The fewest parts that give ``COLUMN_SPLIT_PROGRAMS`` programs of ``COLUMN_XBLOCK`` outputs:
    a divisor of the first reduced dim, else that dim kept whole times a divisor of the next, ..."""
    if rnumel < COLUMN_SPLIT_MIN_RNUMEL or rnumel * xnumel < COLUMN_SPLIT_MIN_NUMEL:
        return None
    if -(-xnumel // COLUMN_XBLOCK) >= COLUMN_SPLIT_PROGRAMS:
        return None
    wanted = -(-COLUMN_SPLIT_PROGRAMS * COLUMN_XBLOCK // max(xnumel, 1))
    best, whole = None, 1  # ``whole``: the parts that the dims kept whole make
    for k, d in enumerate(dims):
        for cut in range(2, sizes[d] + 1):
            if sizes[d] % cut:
                continue
            parts = whole * cut
            if parts > COLUMN_MAX_PARTS or rnumel // parts < COLUMN_MIN_CHUNK:
                return best  # parts only grow from here
            best = Split(d, cut, dims[:k], outer=True)
            if parts >= wanted:
                return best
        whole *= sizes[d]
    return best
