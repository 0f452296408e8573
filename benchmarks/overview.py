"""The table a suite's page opens with: every backend side by side, a line per (row, figure).

A line shows one figure of one (workload, mode) for every backend that ran it, the newest run of
each (``run.load`` merges result files so that a later file's row wins), and where those runs come
from: the GPU, torch and commit of the rows behind its cells. Runs of one line may come from
different calls; a column then names the value most of its cells share, and each other value
with the backends it belongs to (``H100; cgtrees-pc: H200``), so that no cell's origin is hidden.

No torch here: the reports import this on any machine.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

UNKNOWN_COMMIT = "not recorded"
_AT_COMMIT = re.compile(r"-at-([0-9a-f]{7,40})(?=[-.])")


def commit_of_file(name: str) -> str | None:
    """The commit a result file's name records (``...-at-d348de8.json``), or None."""
    found = _AT_COMMIT.search(name)
    return found.group(1) if found else None


def gpu(row: dict) -> str:
    """A device's short name: ``H100`` for "NVIDIA H100 80GB HBM3", ``cpu`` for the CPU."""
    words = str(row.get("device_name") or "?").removeprefix("NVIDIA ").split()
    return words[0] if words else "?"


FACTS = (("GPU", gpu), ("torch", lambda r: str(r.get("torch") or "?")),
         ("commit", lambda r: str(r.get("commit") or UNKNOWN_COMMIT)))


def origin(found: dict[str, dict]) -> list[str]:
    """One cell per fact of ``FACTS`` for the rows of a line (backend -> row): the value most rows
    share, then each other value with its backends."""
    cells = []
    for _, fact in FACTS:
        by_value: dict[str, list[str]] = {}
        for backend, row in found.items():
            by_value.setdefault(fact(row), []).append(backend)
        (common, _), *others = sorted(by_value.items(), key=lambda kv: -len(kv[1]))  # stable among equals
        cells.append(common + "".join(f"; {', '.join(backends)}: {v}" for v, backends in others))
    return cells


def good_row(rows: Iterable[dict], workload: str, mode: str, backend: str, fig: Any) -> dict | None:
    """The row behind one cell, if it measured ``fig`` (a failed row shows "-")."""
    for row in rows:
        if (row["workload"], row["mode"], row["backend"], row.get("phase", "cold")) == \
                (workload, mode, backend, fig.phase):
            return row if row.get("ok") and row.get(fig.key) is not None else None
    return None


def table(rows: list[dict], figures: Sequence[Any], order: Sequence[str], checks: Sequence[Any] = (),
          against: str | None = None, shown_with: dict[str, str] | None = None) -> str:
    """The suite's table: a line per (workload, mode) and figure of ``figures`` (``report.Figure``)
    that any backend measured; a column per backend of ``order`` that ran anything; ``cgtrees /
    against`` where both ran; the brief form of each check on that figure (``checks``:
    ``report.Check``; ``shown_with`` moves a check of one figure to another figure's line); then
    GPU, torch and commit."""
    shown_with = shown_with or {}
    present = [b for b in order if any(r["backend"] == b for r in rows)]
    if against not in present or "cgtrees" not in present:
        against = None  # no line could have the ratio
    head = ["workload / mode", "figure", *present, *([f"cgtrees / {against}"] if against else []),
            *(["against target"] if checks else []), *(name for name, _ in FACTS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seen: dict[tuple[str, str], None] = {}
    for row in rows:
        seen.setdefault((row["workload"], row["mode"]), None)
    for workload, mode in seen:
        first = True
        for fig in figures:
            found = {b: r for b in present if (r := good_row(rows, workload, mode, b, fig)) is not None}
            if not found:
                continue
            cells = ["-" if b not in found else fig.fmt.format(found[b][fig.key] * fig.scale) for b in present]
            if against:
                mine, theirs = (found.get(b, {}).get(fig.key) for b in ("cgtrees", against))
                cells.append(f"{mine / theirs:.2f}x" if fig.ratio and mine is not None and theirs else "-")
            if checks:
                cells.append("; ".join(c.brief for c in checks if (c.workload, c.mode) == (workload, mode)
                                       and shown_with.get(c.figure, c.figure) == fig.label))
            label = f"{workload} / {mode}" if first else ""
            lines.append("| " + " | ".join([label, fig.label, *cells, *origin(found)]) + " |")
            first = False
    return "\n".join(lines)
