"""The real-model suite's report: the "Real models" section of a page, its details and a one-screen summary.

The rows are the worker's (``worker.run_row``); ``flatten`` reads the counters each backend keeps
into flat keys, so the tables are ``report.table`` with this suite's figures and a ratio column of
cgtrees to reduce-overhead. The section (the suite's table and the reading of its misses) sits
between two markers: rewriting it leaves the rest of the file alone, and the own-suite report
(``report.markdown``) keeps it when it rewrites the file. ``details`` holds the full tables per model,
written beside the result files.
"""

from __future__ import annotations

import math
from pathlib import Path

import overview
import real_models
import report
from backend_names import base
from report import Figure

BEGIN, END = "<!-- real-models:begin -->", "<!-- real-models:end -->"
BACKENDS = "eager,cgtrees,reduce-overhead,inductor"  # run in this order: a spent --budget cuts Inductor first
AGAINST = "reduce-overhead"
COMPILED = ("inductor", "reduce-overhead", "cudagraphs", "cgtrees")

PER_CALL = Figure("per call (ms)", "step_s", "cold", 1e3, "{:.3f}")
FIGURES = (
    Figure("first 3 outputs, cold (s)", "first3_s", "cold", 1.0, "{:.2f}"),
    Figure("first 3 outputs, warm (s)", "first3_s", "warm", 1.0, "{:.2f}"),
    PER_CALL,
    Figure("per call, warm process (ms)", "step_s", "warm", 1e3, "{:.3f}"),
    Figure("peak allocated (MB)", "peak_alloc_mb", "cold", 1.0, "{:.0f}"),
    Figure("peak reserved (MB)", "peak_reserved_mb", "cold", 1.0, "{:.0f}"),
    Figure("rel. error vs eager, outputs", "rel_err_out", "cold", 1.0, "{:.1e}", ratio=False),
    Figure("rel. error vs eager, gradients", "rel_err_grad", "cold", 1.0, "{:.1e}", ratio=False),
    Figure("rel. error vs eager, outputs, warm", "rel_err_out", "warm", 1.0, "{:.1e}", ratio=False),
    Figure("rel. error vs eager, gradients, warm", "rel_err_grad", "warm", 1.0, "{:.1e}", ratio=False),
    Figure("graph breaks", "graph_breaks", "cold", 1.0, "{:.0f}", ratio=False),
    Figure("Dynamo graphs", "unique_graphs", "cold", 1.0, "{:.0f}", ratio=False),
    Figure("graph_fallbacks", "graph_fallbacks", "cold", 1.0, "{:.0f}", ratio=False),
    Figure("aten calls, all (aten_fallbacks)", "aten_calls", "cold", 1.0, "{:.0f}", ratio=False),
    Figure("aten calls that are gaps (aten_gaps)", "aten_gaps", "cold", 1.0, "{:.0f}", ratio=False),
    Figure("CUDA-graph skips", "cudagraph_skips", "cold", 1.0, "{:.0f}", ratio=False),
    Figure("cache hits, warm (cache_hit)", "cache_hit", "warm", 1.0, "{:.0f}", ratio=False),
    Figure("AOT-level cache hits, warm (cache_hit_aot)", "cache_hit_aot", "warm", 1.0, "{:.0f}", ratio=False),
    Figure("cache bypasses, cold (cache_bypass)", "cache_bypass", "cold", 1.0, "{:.0f}", ratio=False),
    Figure("cache bypasses, warm (cache_bypass)", "cache_bypass", "warm", 1.0, "{:.0f}", ratio=False),
    *report.CA_FIGURES,
    *report.START_FIGURES,
)

SUITE = """\
HF GPT-2, Llama (grouped-query attention) and BERT (masked LM), 4 layers at d=512, batch 8 x 128 tokens;
timm `vit_tiny_patch16_224` and `convnext_atto`, torchvision `resnet18` and `mobilenet_v3_small`, batch 32
at 224x224: random weights, fp32, no dropout (`benchmarks/real_models.py`). Inference runs under
`no_grad`; training is forward, cross-entropy, backward and an SGD step."""

ABOUT = """\
The real-model suite: library models with random weights built from configs, fp32, sizes fixed in
`benchmarks/real_models.py`: HF GPT-2, HF Llama (grouped-query attention: 8 heads, 2 kv heads) and HF
BERT (masked LM), each 4 layers, d=512, 8 heads, vocabulary 8192, batch 8 x seq 128, `sdpa` attention, no
dropout; timm `vit_tiny_patch16_224` and `convnext_atto`, torchvision `resnet18` and `mobilenet_v3_small`
(its classifier dropout off), batch 32 at 224x224. cuDNN's TF32 is left on (torch's default), so the conv
nets' gradient errors are TF32 rounding on every backend. Backends side by side: eager, Inductor (default
mode), Inductor `reduce-overhead` and cgtrees; inference (`no_grad`) and training (forward, cross-entropy
against fixed labels, backward, SGD step). Every row is a fresh process: cold with empty cache
directories, warm in later processes reusing them. Training rows may add the compiled-autograd backends
(`cgtrees-ca`, `inductor-ca`, `reduce-overhead-ca`: the backward captured by compiled autograd and
compiled by the same backend and mode); the summary then checks cgtrees-ca's per call against
inductor-ca's and cgtrees's. Warm-start rows may add `cgtrees-pc` and `inductor-pc` (Dynamo's caching
precompile: a warm process installs the saved guards and bytecode instead of tracing); the summary then
checks, for cgtrees and cgtrees-pc, first 3 outputs warm at most 0.5x the best Inductor warm start
(inductor or inductor-pc) and at most 0.15x our best cold start, and that a cgtrees-pc warm process
compiled no graph.

Figures: per call is the median over windows of CUDA-event-timed calls; first 3 outputs include
compilation; peak memory is `torch.cuda.max_memory_allocated` (and `max_memory_reserved`) over the steady
calls. Relative error vs eager is, per tensor, the largest absolute difference over the largest magnitude
of eager's tensor, that magnitude taken as at least 1e-3 of the largest in its group (a gradient ~0 in
eager, such as attention's key bias, is rounding noise). Outputs are the model's output (and the loss, for
training); gradients, the worst parameter's (named under "Worst gradients"). Graph breaks and Dynamo graphs
are Dynamo's counters; `graph_fallbacks`, `aten_fallbacks` (every aten call in our kernel modules:
matmuls, convolutions, attention, and ops we do not lower) and `aten_gaps` (those aten calls that are gaps
in our lowering, not deliberate) are cgtrees's. Cache figures are cgtrees's `cache_hit`, `cache_hit_aot` and
`cache_bypass`; in Inductor's rows, its FX-graph plus AOTAutograd cache hits, the AOTAutograd hits, and
both caches' bypasses. The last column is cgtrees over reduce-overhead.

How to run: on a GPU machine, one model and mode per call of at most 9 minutes, each writing one file
under `--out-dir` (`--budget`: no row starts after that many seconds, and none runs past them; rows not
run are listed); the files go to `benchmarks/results/real/`, and the merge runs on any machine:

```
python benchmarks/run.py --suite real --models gpt2 --modes train --cold-warm --budget 480 --out-dir OUT
python benchmarks/run.py --suite real --models gpt2 --modes train --cold-warm --warm-runs 1 --budget 540 \\
    --backends eager,cgtrees,cgtrees-ca,inductor,inductor-ca,reduce-overhead,reduce-overhead-ca \\
    --out OUT/real-gpt2-train-ca.json     # compiled autograd
python benchmarks/run.py --suite real --models gpt2 --modes train --cold-warm --budget 540 \\
    --backends inductor,inductor-pc,cgtrees,cgtrees-pc --out OUT/real-gpt2-train-pc.json   # warm starts
python benchmarks/run.py --suite real --from-json benchmarks/results/real,benchmarks/results/real-h200-pc \\
    --markdown docs/benchmarks.md --details benchmarks/results/real/details.md \\
    --analysis benchmarks/results/real/misses.md
python benchmarks/run.py --suite real --smoke --out-dir OUT   # CPU: the HF models tiny, eager and cgtrees
```
"""


def flatten(row: dict) -> dict:
    """The row with its counters as flat keys; None where a figure does not apply to its backend."""
    backend, counters = base(row["backend"]), row.get("counters") or {}  # a -ca row counts as its base
    ours, inductor, aot = (counters.get(k) or {} for k in ("cgtrees", "inductor", "aot_autograd"))
    flat = dict.fromkeys(("graph_breaks", "unique_graphs", "graph_fallbacks", "aten_calls", "aten_gaps",
                          "cudagraph_skips", "cache_hit", "cache_hit_aot", "cache_bypass"))
    if backend in COMPILED and counters:
        flat.update(graph_breaks=counters.get("graph_breaks"), unique_graphs=counters.get("unique_graphs"))
    if backend == "cgtrees" and counters:
        flat.update({k: ours.get(k, 0) for k in ("graph_fallbacks", "cudagraph_skips", "cache_hit",
                                                  "cache_hit_aot", "cache_bypass")},
                    aten_calls=ours.get("aten_fallbacks", 0), aten_gaps=ours.get("aten_gaps"))
    elif backend in ("inductor", "reduce-overhead") and inductor:
        flat.update(cache_hit=inductor.get("fxgraph_cache_hit", 0) + aot.get("autograd_cache_hit", 0),
                    cache_hit_aot=aot.get("autograd_cache_hit", 0),
                    cache_bypass=inductor.get("fxgraph_cache_bypass", 0) + aot.get("autograd_cache_bypass", 0))
        if backend == "reduce-overhead":
            flat["cudagraph_skips"] = inductor.get("cudagraph_skips", 0)
    return {**row, **flat}


def real_rows(rows: list[dict]) -> list[dict]:
    """This suite's rows, flattened, in the suite's model order."""
    order = {name: i for i, name in enumerate(real_models.MODELS)}
    mine = [flatten(r) for r in rows if r["workload"] in order]
    return sorted(mine, key=lambda r: (order[r["workload"]], r["mode"] != "infer"))


def _cell(row: dict | None, key: str, scale: float, fmt: str) -> str:
    v = None if row is None or not row.get("ok") else row.get(key)
    return "-" if v is None else fmt.format(v * scale)


def _row(rows: list[dict], workload: str, mode: str, backend: str, phase: str) -> dict | None:
    return next((r for r in rows if (r["workload"], r["mode"], r["backend"], r.get("phase", "cold"))
                 == (workload, mode, backend, phase)), None)


def _ratio(rows: list[dict], workload: str, mode: str, key: str, phase: str) -> str:
    fig = Figure("", key, phase, 1.0, "")
    mine, theirs = (report.value(rows, workload, mode, b, fig) for b in ("cgtrees", AGAINST))
    return "-" if mine is None or not theirs else f"{mine / theirs:.2f}x"


def screen(rows: list[dict]) -> str:
    """The one-screen summary printed at the end of a call: a line per (model, mode, backend), the
    cgtrees / reduce-overhead ratios per (model, mode), then the failed rows."""
    rows = real_rows(rows)
    head = (f"{'model':9} {'mode':5} {'backend':15} {'cold3 s':>7} {'warm3 s':>7} {'call ms':>8} {'peak MB':>7} "
            f"{'rel out':>7} {'rel grad':>8} {'brk':>3} {'fb':>3} {'aten':>4} {'gaps':>4} {'hit/aot/byp':>11}")
    lines = [head, "-" * len(head)]
    for workload, mode in report.groups(rows):
        for backend in report.ORDER:
            cold, warm = (_row(rows, workload, mode, backend, p) for p in ("cold", "warm"))
            if cold is None and warm is None:
                continue
            hits = "-" if warm is None or warm.get("cache_hit") is None else \
                f"{warm['cache_hit']}/{warm['cache_hit_aot']}/{warm['cache_bypass']}"
            lines.append(
                f"{workload:9} {mode:5} {backend:15} {_cell(cold, 'first3_s', 1, '{:.2f}'):>7} "
                f"{_cell(warm, 'first3_s', 1, '{:.2f}'):>7} {_cell(cold, 'step_s', 1e3, '{:.3f}'):>8} "
                f"{_cell(cold, 'peak_alloc_mb', 1, '{:.0f}'):>7} {_cell(cold, 'rel_err_out', 1, '{:.0e}'):>7} "
                f"{_cell(cold, 'rel_err_grad', 1, '{:.0e}'):>8} {_cell(cold, 'graph_breaks', 1, '{}'):>3} "
                f"{_cell(cold, 'graph_fallbacks', 1, '{}'):>3} {_cell(cold, 'aten_calls', 1, '{}'):>4} "
                f"{_cell(cold, 'aten_gaps', 1, '{}'):>4} {hits:>11}")
        if report.ran(rows, workload, mode, "cgtrees") and report.ran(rows, workload, mode, AGAINST):
            lines.append(f"{'':31}cgtrees / {AGAINST}: per call {_ratio(rows, workload, mode, 'step_s', 'cold')}, "
                         f"first 3 cold {_ratio(rows, workload, mode, 'first3_s', 'cold')}, "
                         f"warm {_ratio(rows, workload, mode, 'first3_s', 'warm')}, "
                         f"peak {_ratio(rows, workload, mode, 'peak_alloc_mb', 'cold')}")
        found = report.ca_checks(rows, workload, mode, PER_CALL)
        if found:
            lines.append(f"{'':31}issue 20, per call: " + "; ".join(c.text for c in found))
        lines += [f"{'':31}issue 19: {c.text}" for c in report.warm_checks(rows, workload, mode)]
    lines += [f"  note {n}" for n in report.precompile_notes(rows)]
    fails = report.failures(rows)
    lines.append(f"rows: {len(rows)}, failed: {len(fails)}")
    lines += [f"  FAILED {f[:300]}" for f in fails]
    return "\n".join(lines)


def worst_gradients(rows: list[dict]) -> list[str]:
    """Where a compiled row's gradients are furthest from eager's: the parameter, per row."""
    return [f"- {r['workload']} / {r['mode']} / {r['backend']}: {r['rel_err_grad']:.1e} at `{r['worst_grad']}`"
            for r in rows if r.get("ok") and r.get("worst_grad") and r["backend"] != "eager"
            and r.get("phase", "cold") == "cold" and math.isfinite(r.get("rel_err_grad", 0.0))]


def break_reasons(rows: list[dict]) -> list[str]:
    """Dynamo's first graph-break reasons, once per (model, mode)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        reasons = (r.get("counters") or {}).get("graph_break_reasons") or []
        if reasons and r.get("phase", "cold") == "cold":
            seen.setdefault((r["workload"], r["mode"]), reasons)
    return [f"- {w} / {m}: " + "; ".join(f"`{x[:200]}`" for x in reasons) for (w, m), reasons in seen.items()]


OVERVIEW = (PER_CALL, FIGURES[0], FIGURES[1], FIGURES[4])  # per call, first 3 cold and warm, peak allocated


def checks(rows: list[dict]) -> list[report.Check]:
    """This suite's targets: warm starts, and compiled autograd's per call, per (model, mode)."""
    return [c for workload, mode in report.groups(rows)
            for c in (*report.warm_checks(rows, workload, mode), *report.ca_checks(rows, workload, mode, PER_CALL))]


def section(rows: list[dict], meta: dict) -> str:
    """The "Real models" section of a page, markers included: the suite's table, the reading of its
    misses (``meta["analysis"]``), and where the rest is (``details``); without rows it says how to run
    the suite."""
    rows = real_rows(rows)
    body = [BEGIN, "## Real models", "", SUITE, ""]
    if not rows:
        body += ["No results yet: the suite runs on a GPU machine (`benchmarks/run.py --suite real`).", END]
        return "\n".join(body) + "\n"
    found = checks(rows)
    met, fails = sum(c.ok is True for c in found), report.failures(rows)
    where = f"`{meta['details']}`" if meta.get("details") else "the result files' `meta`"
    body += [overview.table(rows, OVERVIEW, report.ORDER, found, against=AGAINST, shown_with=report.SHOWN_WITH),
             "", f"Targets met: {met} of {len(found)} (warm starts; compiled autograd's per call). Rows: "
             f"{len(rows)}, failed: {len(fails)}.", "",
             *([meta["analysis"].rstrip("\n"), ""] if meta.get("analysis") else []),
             "Figures as under \"How to read the tables\". Every figure per model (errors against eager, graph "
             "breaks, aten calls and gaps, cache hits), the worst gradients, start-up phases, and the runs and "
             f"commands behind this table: {where}. Each call of `benchmarks/run.py --suite real` runs one model "
             "and mode (`--models gpt2 --modes train --cold-warm --out-dir OUT`).", END]
    return "\n".join(body) + "\n"


def details(rows: list[dict], meta: dict) -> str:
    """What the section leaves out: the runs behind it, the one-screen summary, every figure per model,
    failed rows, worst gradients, graph breaks and where start-up time goes."""
    rows = real_rows(rows)
    body = [*report.provenance(meta, meta.get("title") or "Real models"), ABOUT, "## Summary", "", "```",
            screen(rows), "```", ""]
    for workload, mode in report.groups(rows):
        body += [f"### {workload} / {mode}", "",
                 report.table(rows, workload, mode, None, figures=FIGURES, against=AGAINST), ""]
    for title, lines in (("Failed rows", [f"- {f[:500]}" for f in report.failures(rows)]),
                         ("Worst gradients", worst_gradients(rows)), ("Graph breaks", break_reasons(rows))):
        if lines:
            body += [f"## {title}", "", *lines, ""]
    startup = report.startup_table(rows)
    if startup:
        body += ["## Where start-up time goes", "", report.OUTSIDE_DYNAMO, "", startup, ""]
    return "\n".join(body).rstrip() + "\n"


def splice(text: str, new_section: str) -> str:
    """``text`` with its real-model section replaced by ``new_section`` (appended if it had none)."""
    return report.splice(text, new_section, BEGIN, END)


def existing(text: str) -> str:
    """The real-model section of ``text``, markers included ("" if none)."""
    start, stop = text.find(BEGIN), text.find(END)
    return "" if start < 0 or stop < start else text[start:stop + len(END)] + "\n"


def write(path: str, rows: list[dict], meta: dict) -> None:
    """Rewrite only the real-model section of the markdown file at ``path`` (created if missing)."""
    file = Path(path)
    old = file.read_text() if file.exists() else ""
    file.write_text(splice(old, section(rows, meta)))
