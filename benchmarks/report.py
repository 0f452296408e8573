"""Turn result rows into tables, target checks and docs/benchmarks.md.

A row is what ``worker.run_row`` returns (one workload, backend, mode and phase). Every figure is
"lower is better". "Best other" is the best backend other than ours (cgtrees, cgtrees-pc) and the
raw-graph floor, among those without compiled autograd or Dynamo's caching precompile (issue 6's
targets); the ``-ca`` rows (``backend_names.py``) have issue 20's targets of their own: cgtrees-ca per
call no slower than inductor-ca, nor than cgtrees.

Warm starts (issue 19, ``warm_checks``): each of our backends with a warm row (cgtrees, and
cgtrees-pc, whose warm process installs Dynamo's saved guards and bytecode) has its first 3 outputs
warm at most 0.5x the best Inductor warm start (plain, or inductor-pc where that row ran and worked)
and at most 0.15x our best cold start (cgtrees or cgtrees-pc); a cgtrees-pc warm process must also
have compiled no graph and loaded its saved functions. Result files from before these backends
simply have fewer rows to compare.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import overview
from backend_names import base, is_ca, is_pc

ORDER = ("eager", "inductor", "inductor-ca", "inductor-pc", "reduce-overhead", "reduce-overhead-ca", "cudagraphs",
         "cgtrees", "cgtrees-ca", "cgtrees-pc", "raw_graph")
FLOOR = "raw_graph"
CA_TARGETS = (("cgtrees-ca", "inductor-ca"), ("cgtrees-ca", "cgtrees"))  # issue 20: (mine, no faster than)


@dataclass(frozen=True)
class Figure:
    label: str
    key: str
    phase: str  # which run it comes from: "cold" or "warm"
    scale: float
    fmt: str
    ratio: bool = True  # whether "cgtrees / best other" means anything


# A compiled-autograd row's counts (``worker.ca_figures``); "-" in every other row.
CA_FIGURES = (
    Figure("compiled-autograd captures", "ca_captures", "cold", 1.0, "{:.0f}", ratio=False),
    Figure("backward graphs compiled by cgtrees (compiled_autograd_graphs)", "compiled_autograd_graphs", "cold",
           1.0, "{:.0f}", ratio=False),
    Figure("replays of cgtrees's backward graphs", "backward_replays", "cold", 1.0, "{:.0f}", ratio=False),
)

# What a warm process reused (``worker.start_figures``): cgtrees's counts, Dynamo's cache hits (-pc rows).
START_FIGURES = (
    Figure("graphs compiled, warm (graphs_compiled)", "graphs_compiled", "warm", 1.0, "{:.0f}", ratio=False),
    Figure("saved functions loaded, warm (precompile_loaded)", "precompile_loaded", "warm", 1.0, "{:.0f}",
           ratio=False),
    Figure("Dynamo cache hits, warm (dynamo_cache_hit)", "dynamo_cache_hit", "warm", 1.0, "{:.0f}", ratio=False),
)

FIGURES = (
    Figure("first output, cold (s)", "first_s", "cold", 1.0, "{:.2f}"),
    Figure("first 3 outputs, cold (s)", "first3_s", "cold", 1.0, "{:.2f}"),
    Figure("first 3 outputs, warm (s)", "first3_s", "warm", 1.0, "{:.2f}"),
    Figure("per call (us)", "step_s", "cold", 1e6, "{:.1f}"),
    Figure("per call, warm process (us)", "step_s", "warm", 1e6, "{:.1f}"),
    Figure("peak allocated (MB)", "peak_alloc_mb", "cold", 1.0, "{:.1f}"),
    Figure("peak reserved (MB)", "peak_reserved_mb", "cold", 1.0, "{:.1f}"),
    Figure("max abs error vs eager", "max_err", "cold", 1.0, "{:.1e}", ratio=False),
    Figure("max abs error vs eager, warm", "max_err", "warm", 1.0, "{:.1e}", ratio=False),
    *CA_FIGURES,
    *START_FIGURES,
)


@dataclass(frozen=True)
class Check:
    workload: str
    mode: str
    figure: str  # Figure.label it is shown beside
    text: str  # e.g. "<= 0.5x inductor: 0.31x ok"
    ok: bool | None  # None: could not be checked (a row missing or failed)
    brief: str = ""  # the overview's cell, e.g. "0.31x inductor ok" (the target is stated above the table)


def groups(rows: list[dict]) -> list[tuple[str, str]]:
    """(workload, mode) pairs in the order they were run."""
    seen: dict[tuple[str, str], None] = {}
    for row in rows:
        seen.setdefault((row["workload"], row["mode"]), None)
    return list(seen)


def value(rows: list[dict], workload: str, mode: str, backend: str, fig: Figure) -> float | None:
    for row in rows:
        if (row["workload"], row["mode"], row["backend"], row.get("phase", "cold")) == \
                (workload, mode, backend, fig.phase):
            v = row.get(fig.key)
            return None if v is None or not row.get("ok") else v * fig.scale
    return None


def best_other(rows: list[dict], workload: str, mode: str, fig: Figure) -> tuple[str, float] | None:
    others = [b for b in ORDER if base(b) != "cgtrees" and b != FLOOR and not is_ca(b) and not is_pc(b)]
    return best_of(rows, workload, mode, others, fig)


def best_of(rows: list[dict], workload: str, mode: str, backends: list[str] | tuple[str, ...],
            fig: Figure) -> tuple[str, float] | None:
    """(backend, value) of the lowest ``fig`` among ``backends`` with a good row; None if none has one."""
    found = [(value(rows, workload, mode, b, fig), b) for b in backends]
    found = [(v, b) for v, b in found if v is not None]
    return None if not found else min(found)[::-1]


def _ratio_check(workload: str, mode: str, fig: Figure, num: float | None, den: float | None,
                 limit: float, against: str, mine: str = "cgtrees", short: str | None = None) -> Check:
    """``mine`` over ``against``, at most ``limit``; ``short`` names ``against`` in the brief form."""
    want = f"{'' if mine == 'cgtrees' else mine + ' '}<= {limit:g}x {against}"
    name = mine.removesuffix(" warm")
    who = "" if name == "cgtrees" else f"{name}: "
    if num is None or den is None or den <= 0:
        missing = mine if num is None else against
        return Check(workload, mode, fig.label, f"{want}: n/a ({missing} missing or failed)", None, f"{who}n/a")
    ratio = num / den
    ok = ratio <= limit
    verdict = "ok" if ok else f"MISS by {ratio / limit:.2f}x"
    brief = f"{who}{ratio:.2f}x {short or against} {'ok' if ok else 'MISS'}"
    return Check(workload, mode, fig.label, f"{want}: {ratio:.2f}x {verdict}", ok, brief)


def ran(rows: list[dict], workload: str, mode: str, backend: str, phase: str = "cold") -> bool:
    key = (workload, mode, backend, phase)
    return any((r["workload"], r["mode"], r["backend"], r.get("phase", "cold")) == key for r in rows)


FIG = {(f.key, f.phase): f for f in FIGURES}


def checks(rows: list[dict]) -> list[Check]:
    """The targets of issue 6, each read off the rows."""
    return [c for workload, mode in groups(rows) for c in _group_checks(rows, workload, mode)]


def _group_checks(rows: list[dict], workload: str, mode: str) -> list[Check]:
    """Targets of one (workload, mode); a target whose rows were not run at all is left out."""
    def compare(key: str, phase: str, limit: float, other: str) -> list[Check]:
        if not (ran(rows, workload, mode, "cgtrees", phase) and ran(rows, workload, mode, other, phase)):
            return []
        fig = FIG[(key, phase)]
        mine, theirs = (value(rows, workload, mode, b, fig) for b in ("cgtrees", other))
        return [_ratio_check(workload, mode, fig, mine, theirs, limit, other)]

    out = []
    step = FIG[("step_s", "cold")]
    best = best_other(rows, workload, mode, step)
    if ran(rows, workload, mode, "cgtrees"):
        out.append(_ratio_check(workload, mode, step, value(rows, workload, mode, "cgtrees", step),
                                best and best[1], 1.0, f"best other ({best[0]})" if best else "best other",
                                short=best[0] if best else "best other"))
    if (workload, mode) == ("mlp_small", "infer"):
        out += compare("step_s", "cold", 1.25, FLOOR)
    out += warm_checks(rows, workload, mode)
    out += compare("first3_s", "cold", 0.5, "inductor")
    out += compare("peak_alloc_mb", "cold", 1.0, "reduce-overhead")
    out += compare("peak_reserved_mb", "cold", 1.0, "reduce-overhead")  # counts graph pools too
    return out + ca_checks(rows, workload, mode, step)


def ca_checks(rows: list[dict], workload: str, mode: str, fig: Figure) -> list[Check]:
    """Issue 20's targets on ``fig`` (per call): cgtrees-ca no slower than inductor-ca, nor than
    cgtrees; each only where both rows were run."""
    out = []
    for mine, other in CA_TARGETS:
        if ran(rows, workload, mode, mine) and ran(rows, workload, mode, other):
            num, den = (value(rows, workload, mode, b, fig) for b in (mine, other))
            out.append(_ratio_check(workload, mode, fig, num, den, 1.0, other, mine))
    return out


OURS = ("cgtrees", "cgtrees-pc")
INDUCTOR_WARM = ("inductor", "inductor-pc")  # Inductor's warm starts: its caches, and its own precompile
WARM_VS_INDUCTOR, WARM_VS_COLD = 0.5, 0.15  # issue 19


def warm_checks(rows: list[dict], workload: str, mode: str) -> list[Check]:
    """Issue 19's targets for each of ``OURS`` with a warm row (see the module's docstring); a
    comparison whose other rows were not run at all is left out."""
    out = []
    for mine in OURS:
        if not ran(rows, workload, mode, mine, "warm"):
            continue
        out += _warm_ratio(rows, workload, mode, mine, INDUCTOR_WARM, "warm", WARM_VS_INDUCTOR, "best inductor warm")
        out += _warm_ratio(rows, workload, mode, mine, OURS, "cold", WARM_VS_COLD, "our best cold")
        if is_pc(mine):
            out.append(no_compile_check(rows, workload, mode, mine))
    return out


def _warm_ratio(rows: list[dict], workload: str, mode: str, mine: str, backends: tuple[str, ...], phase: str,
                limit: float, what: str) -> list[Check]:
    """``mine``'s first 3 outputs warm over the best first 3 outputs of ``backends`` in ``phase``
    (those that ran; [] if none did)."""
    warm = FIG[("first3_s", "warm")]
    present = [b for b in backends if ran(rows, workload, mode, b, phase)]
    if not present:
        return []
    best = best_of(rows, workload, mode, present, FIG[("first3_s", phase)])
    named = best[0] if best else " or ".join(present)
    short = "own cold" if phase == "cold" else named
    return [_ratio_check(workload, mode, warm, value(rows, workload, mode, mine, warm), best and best[1], limit,
                         f"{what} ({named})", f"{mine} warm", short)]


def no_compile_check(rows: list[dict], workload: str, mode: str, backend: str) -> Check:
    """A -pc warm process of ours compiled no graph (``graphs_compiled`` 0, in every warm process of
    the row) and loaded its saved functions (``precompile_loaded`` > 0): Dynamo installed its cache
    instead of tracing."""
    label = START_FIGURES[0].label
    row = next(r for r in rows if (r["workload"], r["mode"], r["backend"], r.get("phase", "cold"))
               == (workload, mode, backend, "warm"))
    compiled, loaded = row.get("graphs_compiled"), row.get("precompile_loaded")
    want = f"{backend} warm compiles no graph"
    if not row.get("ok") or compiled is None or loaded is None:
        return Check(workload, mode, label, f"{want}: n/a ({backend} warm failed or has no counters)", None,
                     f"{backend}: n/a")
    every = [c for c in row.get("graphs_compiled_runs") or [] if c is not None] or [compiled]  # each process
    ok = max(every) == 0 and loaded > 0
    runs = f" (per process: {', '.join(map(str, every))})" if len(every) > 1 and max(every) else ""
    counts = (f"graphs_compiled {compiled}{runs}, precompile_loaded {loaded}, "
              f"dynamo_cache_hit {row.get('dynamo_cache_hit')}, _miss {row.get('dynamo_cache_miss')}, "
              f"_error {row.get('dynamo_cache_error')}")
    return Check(workload, mode, label, f"{want}: {counts} {'ok' if ok else 'MISS'}", ok,
                 f"{backend}: compiled {max(every)} {'ok' if ok else 'MISS'}")


def precompile_notes(rows: list[dict]) -> list[str]:
    """Where a -pc backend's own path did not work: its cache not saved, or a warm process that did not
    install Dynamo's cache (its warm figure is then a plain warm start); one line per row."""
    notes = []
    for r in rows:
        if not is_pc(r["backend"]) or not r.get("ok"):
            continue  # a failed row is listed with the failures
        where = f"{r['workload']}/{r['mode']}/{r['backend']} ({r.get('phase', 'cold')})"
        saved = r.get("dynamo_cache_save")
        if saved not in (None, "ok"):
            notes.append(f"{where}: Dynamo's cache not saved: {saved}")
        if r.get("phase") == "warm" and not r.get("dynamo_cache_hit"):
            notes.append(f"{where}: Dynamo's cache was not used (hit {r.get('dynamo_cache_hit')}, miss "
                         f"{r.get('dynamo_cache_miss')}, error {r.get('dynamo_cache_error')}, caching_precompile "
                         f"{r.get('caching_precompile')}): a plain warm start")
    return notes


MARKED = re.compile(r"<!-- ([\w-]+):begin -->.*?<!-- \1:end -->", re.S)


FIRST = ("real-size", "real-size-reading", "serving-section")  # the sizes users run open the page


def marked_blocks(text: str, first: bool | None = None) -> str:
    """Every block of ``text`` from ``<!-- name:begin -->`` to ``<!-- name:end -->``, verbatim, in
    order, each ending in a newline, a blank line between them ("" if none): the real-model section
    and hand-written ones (such as docs/warm_start.md's precompile section), which rewriting the own
    suite's report keeps. ``first``: only the blocks that open the page (``FIRST``), or only the
    others."""
    return "\n".join(m.group(0) + "\n" for m in MARKED.finditer(text)
                     if first is None or (m.group(1) in FIRST) == first)


def splice(text: str, block: str, begin: str, end: str) -> str:
    """``text`` with its block between the markers ``begin`` and ``end`` replaced by ``block``
    (which holds the markers), appended where it had none."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        return text.rstrip("\n") + "\n\n" + block
    rest = text[stop + len(end):].lstrip("\n")
    return text[:start] + block + ("\n" + rest if rest else "")


def _fmt(fig: Figure, v: float | None) -> str:
    return "-" if v is None else fig.fmt.format(v)


def table(rows: list[dict], workload: str, mode: str, all_checks: list[Check] | None,
          figures: tuple[Figure, ...] = FIGURES, against: str | None = None) -> str:
    """One markdown table: a line per figure, a column per backend, the ratio of cgtrees to
    ``against`` (default: to the best other backend) and, unless ``all_checks`` is None, the targets."""
    present = [b for b in ORDER if any(r["backend"] == b and (r["workload"], r["mode"]) == (workload, mode)
                                       for r in rows)]
    head = ["figure", *present, f"cgtrees / {against or 'best other'}", *(["target"] if all_checks is not None else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fig in figures:
        cells = [value(rows, workload, mode, b, fig) for b in present]
        if all(c is None for c in cells):
            continue
        mine = value(rows, workload, mode, "cgtrees", fig)
        if against:
            theirs = value(rows, workload, mode, against, fig)
            ratio = f"{mine / theirs:.2f}x" if fig.ratio and mine is not None and theirs else "-"
        else:
            best = best_other(rows, workload, mode, fig)
            ratio = f"{mine / best[1]:.2f}x ({best[0]})" if fig.ratio and best and mine and best[1] > 0 else "-"
        targets = [] if all_checks is None else ["; ".join(
            c.text for c in all_checks if (c.workload, c.mode, c.figure) == (workload, mode, fig.label))]
        lines.append("| " + " | ".join([fig.label, *(_fmt(fig, c) for c in cells), ratio, *targets]) + " |")
    return "\n".join(lines)


# Dynamo's compile-time phases shown in the start-up breakdown (seconds, summed over all frames).
START_PHASES = (("Dynamo total", "_compile.compile_inner"), ("tracing", "bytecode_tracing"),
                ("backend compiler", "OutputGraph.call_user_compiler"),
                ("AOTAutograd", "create_aot_dispatcher_function"), ("guards", "build_guards"))


OUTSIDE_DYNAMO = ("Phases are Dynamo's own compile-time counters, summed over all frames. \"Outside Dynamo\" "
                  "is the rest of the first 3 outputs: lazy imports, the backward's compile (it runs at the first "
                  "backward, after Dynamo returns), first runs, CUDA-graph warmup and recording.")


def _start_point(rows: list[dict]) -> str:
    """Where the first outputs' clock starts: rows that kept ``compile_call_s`` counted the
    ``torch.compile`` call, where Dynamo's caching precompile loads and installs a saved entry;
    earlier rows started at the first call, leaving that load out."""
    timed = [r for r in rows if r.get("first3_s") is not None]
    if timed and all("compile_call_s" in r for r in timed):
        return "the `torch.compile` call (where Dynamo's caching precompile loads a saved entry)"
    if any("compile_call_s" in r for r in timed):
        return ("the `torch.compile` call in rows that kept `compile_call_s`, from the first call in the others "
                "(a -pc warm row of those leaves out the load of Dynamo's saved entry)")
    return "the first call"


def runs_note(row: dict) -> str:
    """" (median of 0.81, 0.84, 0.90)" for a row kept out of several warm processes, else ""."""
    runs = row.get("first3_runs") or []
    if len(runs) < 2:
        return ""
    failed = row.get("runs", len(runs)) - len(runs)
    return f" (median of {', '.join(f'{v:.2f}' for v in runs)}" + (f"; {failed} failed)" if failed else ")")


def startup_table(rows: list[dict]) -> str:
    """Where the time to first 3 outputs goes, for the compiling backends (see OUTSIDE_DYNAMO)."""
    head = ["workload / mode", "backend", "run", "first 3 (s)", *(n for n, _ in START_PHASES), "outside Dynamo"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        phases = r.get("compile_phases") or {}
        if not r.get("ok") or not phases or r.get("first3_s") is None:
            continue
        cells = [phases.get(key) for _, key in START_PHASES]
        outside = r["first3_s"] - (cells[0] or 0.0)
        profiled = " (under cProfile)" if r.get("start_profile") else ""
        lines.append("| " + " | ".join([f"{r['workload']} / {r['mode']}", r["backend"], r.get("phase", "cold"),
                                        f"{r['first3_s']:.2f}{profiled}{runs_note(r)}",
                                        *("-" if c is None else f"{c:.2f}" for c in cells),
                                        f"{outside:.2f}"]) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def failures(rows: list[dict]) -> list[str]:
    return [f"{r['workload']}/{r['mode']}/{r['backend']} ({r.get('phase', 'cold')}): {r.get('error')}"
            for r in rows if not r.get("ok")]


def tables(rows: list[dict]) -> str:
    found = checks(rows)
    parts = []
    for workload, mode in groups(rows):
        parts += [f"### {workload} / {mode}", "", table(rows, workload, mode, found), ""]
    return "\n".join(parts)


def kernel_table(kernels: dict | None) -> str:
    if not kernels:
        return ""
    if kernels.get("error"):
        return f"Kernel report failed: {kernels['error']}\n"
    lines = [f"Device copy bandwidth: {kernels['copy_gbps']:.0f} GB/s "
             f"({kernels['copy_bytes'] / 2**20:.0f} MiB read + written).", "",
             "| kernel | backend | time (us) | minimal bytes (MiB) | GB/s | % of copy |",
             "|---|---|---|---|---|---|"]
    for k in kernels["kernels"]:
        if k.get("error"):
            lines.append(f"| {k['name']} | {k['backend']} | failed: {k['error'][:120]} | | | |")
            continue
        lines.append(f"| {k['name']} | {k['backend']} | {k['time_s'] * 1e6:.1f} | {k['bytes'] / 2**20:.0f} | "
                     f"{k['gbps']:.0f} | {k['pct_of_copy']:.0f}% |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict], kernels: dict | None = None) -> str:
    """A few lines: how many targets were met, each miss plainly, each failure."""
    found = checks(rows)
    met = sum(c.ok is True for c in found)
    missed, unknown = sum(c.ok is False for c in found), sum(c.ok is None for c in found)
    lines = [f"targets met: {met} of {len(found)} ({missed} missed, {unknown} not checkable)"]
    lines += [f"  MISS {c.workload}/{c.mode} {c.figure}: {c.text}" for c in found if c.ok is False]
    lines += [f"  n/a  {c.workload}/{c.mode} {c.figure}: {c.text}" for c in found if c.ok is None]
    lines += [f"  note {n}" for n in precompile_notes(rows)]
    fails = failures(rows)
    lines.append(f"rows: {len(rows)}, failed: {len(fails)}")
    lines += [f"  FAILED {f[:300]}" for f in fails]
    if kernels and not kernels.get("error"):
        for k in kernels["kernels"]:
            pct = "failed" if k.get("error") else f"{k['pct_of_copy']:.0f}% of copy bandwidth"
            lines.append(f"  kernel {k['name']} ({k['backend']}): {pct}")
    return "\n".join(lines)


def _warm_method(rows: list[dict]) -> str:
    """How the warm rows were measured: runners before --warm-runs kept one process, unprimed."""
    text = "a second process reusing them"
    if any(len(r.get("first3_runs") or []) > 1 for r in rows):
        text = ("later processes reusing them, the median of their first outputs (each run listed under "
                "'Where start-up time goes' in the details)")
    if rows and all(r.get("bytecode_primed") for r in rows):
        text += "; every process read Python byte code compiled beforehand, as an installed package has it"
    return text


OVERVIEW = tuple(FIG[k] for k in (("step_s", "cold"), ("first3_s", "cold"), ("first3_s", "warm"),
                                  ("peak_alloc_mb", "cold"), ("peak_reserved_mb", "cold")))
SHOWN_WITH = {START_FIGURES[0].label: FIG[("first3_s", "warm")].label}  # compiles-no-graph beside warm starts

SUITE = ("The workloads of `benchmarks/workloads.py`, fp32, fixed sizes: mlp_small (8 Linear-GELU-LayerNorm "
         "layers of width 256, batch 16: launch-bound), norm_act (LayerNorm, GELU, softmax over 8192 x 4096: "
         "bandwidth-bound), gpt_block (two GPT-2 blocks, 8 x 256 x 768, attention written out), convnet (a small "
         "ResNet, batch 32 at 64x64) and decode (one token through a 4-layer decoder with a static KV cache; "
         "inference only). Inference runs under `no_grad`; training is forward, loss, backward.")


def how_to_read(rows: list[dict]) -> str:
    """What the figures, backends and targets of the own suite's tables mean."""
    return "\n".join([
        "## How to read the tables",
        "",
        f"- *first 3 outputs*: seconds from {_start_point(rows)} to the third output, in a fresh process, "
        f"compilation included: *cold* with empty cache directories, *warm* in {_warm_method(rows)}.",
        "- *per call*: the median over windows of many calls, timed with CUDA events.",
        "- *peak allocated*: `torch.cuda.max_memory_allocated` over the steady-state calls. It leaves out what a "
        "CUDA-graph replay writes in its pool, so *peak reserved* (`max_memory_reserved`, pools included) stands "
        "beside it. *error*: the largest absolute difference from eager (outputs for inference; loss and "
        "gradients for training).",
        "- Backends: `inductor` is torch.compile's default, `reduce-overhead` Inductor with CUDA graphs, "
        "`cudagraphs` torch's CUDA-graph backend without compilation, `raw_graph` the per-call floor (the "
        "model captured as one `torch.cuda.CUDAGraph` and replayed). A `-pc` backend runs with Dynamo's caching "
        "precompile (`torch._dynamo.config.caching_precompile`; for cgtrees `CGTREES_PRECOMPILE_CACHE=1`): a "
        "warm process installs the saved guards and bytecode instead of tracing. A `-ca` backend runs the "
        "training step's backward under compiled autograd, compiled by the same backend and mode.",
        "- Targets (\"against target\": the ratio, what it is taken against, ok or MISS): per call no slower "
        "than the best other backend (compiled autograd and precompile rows left out; mlp_small inference "
        "also within 1.25x of raw_graph); first 3 outputs cold at most 0.5x Inductor's; peak allocated and "
        "peak reserved no more than reduce-overhead's; first 3 outputs warm, for cgtrees and cgtrees-pc, at "
        "most 0.5x the best Inductor warm start (inductor or inductor-pc) and at most 0.15x our best cold start "
        "(\"own cold\"); a cgtrees-pc warm process compiles no graph; cgtrees-ca per call no slower than "
        "inductor-ca, nor than cgtrees.",
        "",
    ])


def reproduce(meta: dict) -> str:
    """How the rows were run and how the page is rebuilt, in a few lines (the commands: the details)."""
    where = f"`{meta['details']}`" if meta.get("details") else "the result files' `meta`"
    return "\n".join([
        "## How to reproduce",
        "",
        "On a GPU machine, one workload per call of `benchmarks/run.py`, every row in a fresh process: "
        "`python benchmarks/run.py --models gpt_block --modes infer,train --cold-warm --out gpt_block.json` "
        "(`--backends` picks backends, `-pc` and `-ca` ones included; `--budget` bounds a call). "
        "`--from-json FILES --markdown PAGE --details FILE --analysis FILE` rebuilds a page from result files "
        "on any machine, and `python benchmarks/run.py --smoke` runs every workload at tiny sizes on the CPU. "
        f"The files behind this page, the command of each run and the page's own rebuild command: {where}.",
        "",
    ])


def markdown(rows: list[dict], kernels: dict | None, meta: dict, kept: str = "", opening: str = "") -> str:
    """The own suite's page: ``opening`` first (the marked real-size and serving sections of the page it
    replaces: the sizes users run), then the own suite's table, the reading of its misses
    (``meta["analysis"]``), ``kept`` (the page's other marked blocks, such as the real-model section),
    how to read and reproduce it, and every figure per workload. The runs' commands, start-up phases and profiles
    go to ``details``."""
    found = checks(rows)
    met, fails = sum(c.ok is True for c in found), failures(rows)
    head = [
        f"# {meta.get('title') or 'Benchmarks'}",
        "",
        "Every backend that ran, side by side, in fresh processes on one GPU; lower is better. Each line is the "
        "newest run of its row and names the GPU, torch and commit it ran on. The reading of each miss follows "
        "its table; readings of earlier runs, superseded results and the commands of every run lie beside the "
        "result files in `benchmarks/results/`.",
        "",
        *([opening.rstrip("\n"), ""] if opening else []),
        "## Own suite",
        "",
        SUITE,
        "",
        overview.table(rows, OVERVIEW, ORDER, found, shown_with=SHOWN_WITH),
        "",
        f"Targets met: {met} of {len(found)}. Rows: {len(rows)}, failed: {len(fails)}.",
        "",
        *([meta["analysis"].rstrip("\n"), ""] if meta.get("analysis") else []),
        *([kept.rstrip("\n"), ""] if kept else []),
        how_to_read(rows),
        reproduce(meta),
        "## Every figure, per workload",
        "",
        tables(rows),
    ]
    if fails:
        head += ["### Failed rows", "", *(f"- {f[:500]}" for f in fails), ""]
    if kernels:
        head += ["## Kernels", "", kernel_table(kernels)]
    return "\n".join(head).rstrip() + "\n"


def runs(meta: dict) -> list[str]:
    """A line per result file behind a report: its name, date, commit and command (paths shortened to
    their last part: where a run wrote its file on the GPU machine says nothing here)."""
    lines = []
    for f in meta.get("files") or []:
        command = re.sub(r"(?<=\s)/\S*/([^/\s]+)", r"\1", f.get("command") or "?")
        lines.append(f"- `{f['name']}` ({f.get('date') or '?'}, commit {f.get('commit') or overview.UNKNOWN_COMMIT}):"
                     f" `{command}`")
    return lines


def provenance(meta: dict, title: str) -> list[str]:
    """The head of a details file: what it details, how it was rebuilt, and the runs behind it."""
    return [f"# Details: {title}", "",
            "Written by `benchmarks/run.py` beside the page it details; every figure here comes from the files "
            "listed below, merged in that order (a later file's row replaces an earlier one's).", "",
            *([f"Rebuilt with: `{meta['rebuild']}`", ""] if meta.get("rebuild") else []),
            *([f"Note: {meta['note']}", ""] if meta.get("note") else []),
            "## Runs", "", *(runs(meta) or [f"- {meta.get('date', '?')}: `{meta.get('command', '?')}`"]), ""]


def details(rows: list[dict], kernels: dict | None, meta: dict) -> str:
    """What the own suite's page leaves out: the runs behind it, every target checked, where start-up
    time goes, and the profiles."""
    body = [*provenance(meta, meta.get("title") or "Benchmarks"),
            "## Targets", "", "```", summary(rows, kernels), "```", ""]
    startup = startup_table(rows)
    if startup:
        body += ["## Where start-up time goes", "", OUTSIDE_DYNAMO, "", startup, ""]
    for r in rows:
        title = f"{r['workload']} / {r['mode']} / {r['backend']}"
        if r.get("profile"):
            earlier = f" (an earlier run: {r['profile_from']})" if r.get("profile_from") else ""
            body += [f"## Profile of steady state: {title}{earlier}", "", "```", r["profile"].rstrip(), "```", ""]
        if r.get("start_profile"):
            body += [f"## Profile of the first 3 calls: {title}", "", "```", r["start_profile"].rstrip(), "```", ""]
    return "\n".join(body).rstrip() + "\n"
