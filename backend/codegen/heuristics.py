"""Block sizes and ``num_warps``: a fixed, documented heuristic (no autotuning yet).

Pointwise kernels: 1024 elements per program and 4 warps (8 elements per thread), which keeps
loads wide and is within a few percent of copy bandwidth on H100-class GPUs for large tensors;
small tensors use one block of the next power of two.

Reductions: a row of at most ``PERSISTENT_LIMIT`` elements is reduced in registers ("persistent",
one block of ``RBLOCK = next_pow2(row)`` columns; rows per program so that a block holds about 4096
elements); warps grow with the block (4 up to 2048 elements, 8 up to 8192, 16 beyond). Longer or
symbolic rows loop over ``RBLOCK = 1024`` columns. When the reduced dimension is not the innermost
in memory (a column reduction), programs take ``COLUMN_XBLOCK`` rows so that loads along the rows
coalesce; such a block stays persistent only while it holds at most ``PERSISTENT_LIMIT`` elements,
and otherwise loops over ``COLUMN_RBLOCK`` reduced elements at a time. (A [64, 8192] persistent
block, as a column sum over 8192 rows once got, spills every register: Triton then compiled it
for minutes.)

Split reductions: a reduction with few output rows and long rows (a BatchNorm statistic over
(N, H, W), a bias gradient summing 8192 rows) would run on a handful of programs and leave most of
the GPU idle. Such a reduction runs in two: the first stage reduces ``parts`` chunks of its
outermost splittable reduced dimension (one partial result per chunk), the second reduces the
partials. ``split_reduction`` chooses the fewest parts (a divisor of that dimension) that give at
least ``SPLIT_PROGRAMS`` programs, keeping chunks of at least ``SPLIT_MIN_CHUNK`` elements. Small
reductions (under ``SPLIT_MIN_NUMEL`` elements in all) stay one kernel: a second launch would cost
more than it saves.

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
LOOP_RBLOCK = 1024
COLUMN_XBLOCK = 32
COLUMN_RBLOCK = 64
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


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _concrete(n: sympy.Expr) -> int | None:
    n = sympy.sympify(n)
    return int(n) if n.is_number else None


def pointwise(numel: sympy.Expr, interpret: bool) -> Config:
    block = 4096 if interpret else 1024
    n = _concrete(numel)
    if n is not None:
        block = max(16, min(block, next_pow2(n)))
    return Config(block, 1, 4 if block >= 512 else max(1, block // 128))


def reduction(xnumel: sympy.Expr, rnumel: sympy.Expr, inner: bool, interpret: bool) -> Config:
    r, x = _concrete(rnumel), _concrete(xnumel)
    budget = 16384 if interpret else 4096
    column_xblock = COLUMN_XBLOCK if not interpret else 1
    if r is not None and r <= PERSISTENT_LIMIT and (inner or column_xblock * next_pow2(r) <= PERSISTENT_LIMIT):
        rblock = max(2, next_pow2(r))
        xblock = max(1, budget // rblock)
        if not inner:
            xblock = max(xblock, column_xblock)
        if x is not None:
            xblock = max(1, min(xblock, next_pow2(x)))
        elements = xblock * rblock
        warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
        return Config(xblock, rblock, warps, True)
    if inner:
        return Config(1, LOOP_RBLOCK * (4 if interpret else 1), 8, False)
    if interpret:
        return Config(64, 64, 8, False)
    return Config(COLUMN_XBLOCK, COLUMN_RBLOCK, 8, False)


def scan(xnumel: sympy.Expr, rnumel: sympy.Expr, interpret: bool) -> Config:
    """One block holds whole rows (the lowering checked ``rnumel <= SCAN_LIMIT``)."""
    r, x = _concrete(rnumel), _concrete(xnumel)
    assert r is not None and r <= SCAN_LIMIT, f"a scan over {rnumel} elements"
    rblock = max(2, next_pow2(r))
    xblock = max(1, (16384 if interpret else 4096) // rblock)
    if x is not None:
        xblock = max(1, min(xblock, next_pow2(x)))
    elements = xblock * rblock
    return Config(xblock, rblock, 4 if elements <= 2048 else 8 if elements <= 8192 else 16, True)


def split_reduction(size: tuple[sympy.Expr, ...], dims: tuple[int, ...]) -> tuple[int, int] | None:
    """``(dim, parts)``: reduce ``dims`` of ``size`` in two stages, splitting ``dim`` into ``parts``;
    None to reduce in one kernel (enough rows already, short rows, or symbolic sizes)."""
    sizes = [_concrete(n) for n in size]
    if not dims or any(n is None for n in sizes):
        return None
    rnumel = math.prod(sizes[d] for d in dims)
    xnumel = math.prod(n for d, n in enumerate(sizes) if d not in dims)
    inner = len(sizes) - 1 in dims  # the reduced elements of a row are adjacent (not a column sum)
    rows_per_program = 1 if inner else COLUMN_XBLOCK
    if rnumel < SPLIT_MIN_RNUMEL or rnumel * xnumel < SPLIT_MIN_NUMEL:
        return None
    if xnumel // rows_per_program >= SPLIT_PROGRAMS:
        return None
    wanted = -(-SPLIT_PROGRAMS * rows_per_program // max(xnumel, 1))
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
            return d, best
    return None
