"""The real-size suite's report: a marked block of docs/benchmarks.md and a one-screen summary.

    python benchmarks/size_report.py benchmarks/results/real-size [MORE_FILES_OR_FOLDERS] --markdown docs/benchmarks.md

Reads the JSON files of ``size_run.py`` calls (a folder stands for its ``*.json``) and merges them:
per (model, backend), the row of the newest call (``meta["date"]``) wins, unless that call did not
measure it (not run, skipped) and an older one did. Smoke rows (tiny CPU configs) are kept apart
and reported only where no real row exists. ``--markdown`` rewrites only the block between
``BEGIN`` and ``END`` (added at the end of the file if missing); ``run.py --markdown`` keeps the
block as it is when it rewrites the rest of the page. The block holds:

- the table: per model its mode and sizes, each backend's median ms per step, cgtrees over
  Inductor, tokens (or images) per second, compile seconds and peak reserved GB per backend;
- errors against eager and memory, a line per row;
- for every compiled row slower than Inductor's (cgtrees or reduce-overhead), its profile beside
  Inductor's: ms per step by kernel category, busy and idle; then the top 10 kernels of each
  cgtrees row slower than Inductor's;
- the rows that were not measured, and why.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Callable

import real_sizes
import report

BEGIN, END = "<!-- real-size:begin -->", "<!-- real-size:end -->"
BACKENDS = ("eager", "inductor", "reduce-overhead", "cgtrees")
SHORT = {"eager": "eager", "inductor": "inductor", "reduce-overhead": "r-o", "cgtrees": "cgtrees"}
CATEGORY_LABELS = {"gemm": "GEMM and convolution", "attention": "attention", "generated": "generated kernels",
                   "copies": "copies and fills", "optimizer": "optimizer (fused, eager)",
                   "communication": "communication (NCCL)", "other": "other"}
MEASURED = ("ok", "error")  # a row of these statuses replaces an older one; not run / skipped do not

ABOUT = """\
The published sizes, random weights, one optimizer step per training step (`benchmarks/real_sizes.py`
has the configs): HF GPT-2 small (8 x 1024), BERT-base masked LM (16 x 512) and a 1.1B Llama (4 x 1024),
the loss inside the compiled model; timm ViT-B/16 (training at 32, bf16 inference at 64 images) and
torchvision ResNet-50 (training at 64 images channels-last, fp32 inference at 1), the loss outside;
GPT-2 small under `torch.compile(DDP(model))` on 2 GPUs. Training is bf16 autocast over fp32 weights with
a fused AdamW (SGD for ResNet-50) run eagerly for every backend. Each row is a fresh process with empty
caches. *ms/step*: the median of 20 steps, each synchronized, after 3 first and 5 warm-up steps;
*compile s*: the first 3 steps' wall time minus 3 median steps (compilation, warm-up runs, CUDA-graph
recording); *peak GB*: `max_memory_reserved` from before the first step (CUDA-graph pools counted;
*peak allocated*, `max_memory_allocated`, leaves out what a replay writes in its pool); errors: the
first step's loss (inference: output) and four parameters' gradients against an eager step from the same
weights in the same process, relative to the largest magnitude of eager's (at least 1e-3 of the largest
of the four, for gradients); eager's own row is its run-to-run noise, and bf16 against fp32 (eager, the
same weights) is the scale of bf16's rounding."""


# --- loading ---------------------------------------------------------------------------------------

def files(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for path in map(Path, paths):
        found += sorted(path.glob("*.json")) if path.is_dir() else [path]
    return found


def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """Merged rows (each with its call's ``commit`` and ``file``) and every call's meta, oldest first."""
    calls = []
    for path in files(paths):
        data = json.loads(path.read_text())
        if "rows" in data and all("model" in r for r in data["rows"]):  # not another suite's file
            calls.append((data.get("meta") or {}, path.name, data["rows"]))
    calls.sort(key=lambda c: (c[0].get("date", ""), c[1]))
    by_key: dict[tuple, dict] = {}
    for meta, name, rows in calls:
        for row in rows:
            key = (row["model"], row["backend"], bool(row.get("smoke")))
            if key not in by_key or row.get("status") in MEASURED or by_key[key].get("status") not in MEASURED:
                by_key[key] = {**row, "commit": meta.get("commit"), "file": name}
    order = {m: i for i, m in enumerate(real_sizes.MODELS)}
    rows = sorted(by_key.values(), key=lambda r: (r.get("smoke", False), order.get(r["model"], 99),
                                                  BACKENDS.index(r["backend"]) if r["backend"] in BACKENDS else 9))
    return rows, [{**m, "file": n} for m, n, _ in calls]


def shown(rows: list[dict]) -> list[dict]:
    """The real rows; the smoke rows where there is no real row at all."""
    real = [r for r in rows if not r.get("smoke")]
    return real or rows


# --- formatting ------------------------------------------------------------------------------------

def _row(rows: list[dict], model: str, backend: str) -> dict | None:
    return next((r for r in rows if r["model"] == model and r["backend"] == backend), None)


def _get(row: dict | None, key: str) -> float | None:
    v = None if row is None or not row.get("ok") else row.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v: float | None, fmt: str) -> str:
    return "-" if v is None else "inf" if math.isinf(v) else fmt.format(v)


def _rate(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.1f}"


def ratio(rows: list[dict], model: str, backend: str = "cgtrees", against: str = "inductor") -> float | None:
    mine, theirs = (_get(_row(rows, model, b), "step_ms") for b in (backend, against))
    return None if mine is None or not theirs else mine / theirs


def models(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["model"] for r in rows))


def _per_backend(rows: list[dict], model: str, key: str, fmt: Callable[[float | None], str],
                 backends: tuple[str, ...] = BACKENDS) -> str:
    return " / ".join(fmt(_get(_row(rows, model, b), key)) for b in backends)


def _where(rows: list[dict], model: str) -> tuple[str, str, str]:
    """GPU, torch and commit of a model's rows (each value once)."""
    mine = [r for r in rows if r["model"] == model and r.get("status") in MEASURED]

    def once(key: str, short: Callable[[str], str] = str) -> str:
        return ", ".join(dict.fromkeys(short(str(r.get(key))) for r in mine if r.get(key))) or "-"
    return once("device_name", lambda n: n.replace("NVIDIA ", "")), once("torch"), once("commit")


def main_table(rows: list[dict]) -> str:
    ms = [f"{SHORT[b]} ms" for b in BACKENDS]
    slash = " / ".join(SHORT[b] for b in BACKENDS)
    compiled = tuple(b for b in BACKENDS if b != "eager")
    head = ["model", "mode", "sizes", *ms, "cgtrees / inductor", f"tokens or images/s ({slash})",
            f"compile s ({' / '.join(SHORT[b] for b in compiled)})", f"peak reserved GB ({slash})", "GPU", "torch",
            "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models(rows):
        any_row = next(r for r in rows if r["model"] == model)
        r = ratio(rows, model)
        unit = "img/s" if any_row.get("unit") == "images" or "img" in any_row.get("sizes", "") else "tok/s"
        sizes = "tiny (smoke)" if any_row.get("smoke") else any_row.get("sizes", "?")
        cells = [model, any_row.get("mode", "?"), sizes,
                 *(_fmt(_get(_row(rows, model, b), "step_ms"), "{:.1f}") for b in BACKENDS),
                 _fmt(r, "{:.2f}x"), _per_backend(rows, model, "throughput", _rate) + f" {unit}",
                 _per_backend(rows, model, "compile_s", lambda v: _fmt(v, "{:.1f}"), compiled),
                 _per_backend(rows, model, "peak_reserved_gb", lambda v: _fmt(v, "{:.1f}")), *_where(rows, model)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def error_table(rows: list[dict]) -> str:
    """A line per model: errors against eager (relative and absolute, per backend; the worst
    gradient of cgtrees named), memory, cgtrees's spread of steps, and graph breaks."""
    slash = " / ".join(SHORT[b] for b in BACKENDS)
    compiled = tuple(b for b in BACKENDS if b != "eager")
    head = ["model", f"loss or output rel. error ({slash})", f"loss or output abs. error ({slash})",
            f"gradient rel. error, worst ({slash})", "cgtrees's worst gradient",
            "eager bf16 against fp32, rel. (loss / gradient)", f"peak allocated GB ({slash})",
            f"steady reserved GB ({slash})", "cgtrees ms/step min-max",
            f"graph breaks ({' / '.join(SHORT[b] for b in compiled)})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models(rows):
        mode = next(r for r in rows if r["model"] == model).get("mode")
        key = "loss" if mode == "train" else "out"
        cg = _row(rows, model, "cgtrees")
        worst = (cg or {}).get("worst_grad") if _get(cg, "grad_rel_err") is not None else None
        spread = "-" if _get(cg, "step_ms_min") is None else \
            f"{_get(cg, 'step_ms_min'):.1f}-{_get(cg, 'step_ms_max'):.1f}"
        cells = [model, _per_backend(rows, model, f"{key}_rel_err", _err),
                 _per_backend(rows, model, f"{key}_abs_err", _err), _per_backend(rows, model, "grad_rel_err", _err),
                 f"`{worst}`" if worst else "-", _autocast(_row(rows, model, "eager")),
                 _per_backend(rows, model, "peak_allocated_gb", _gb),
                 _per_backend(rows, model, "steady_reserved_gb", _gb), spread,
                 " / ".join(_breaks(_row(rows, model, b)) for b in compiled)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _autocast(eager: dict | None) -> str:
    """bf16 autocast's own error against an fp32 step (the eager row measures it): the scale of rounding."""
    loss, grad = (_get(eager, f"autocast_{k}_rel_err") for k in ("loss", "grad"))
    return "-" if loss is None else f"{_err(loss)} / {_err(grad)}"


def _err(v: float | None) -> str:
    return _fmt(v, "{:.0e}")


def _gb(v: float | None) -> str:
    return _fmt(v, "{:.1f}")


def _breaks(row: dict | None) -> str:
    n = ((row or {}).get("counters") or {}).get("graph_breaks") if row and row.get("ok") else None
    return "-" if n is None else str(n)


TARGET = 0.9  # cgtrees's step against Inductor's (issue 44)


def misses(rows: list[dict]) -> list[tuple[str, str, float]]:
    """(model, backend, ratio) of every cgtrees row over ``TARGET`` x Inductor's step."""
    return [(m, "cgtrees", r) for m in models(rows) if (r := ratio(rows, m, "cgtrees")) is not None and r > TARGET]


def profile_tables(rows: list[dict], found: list[tuple[str, str, float]]) -> str:
    """Each miss's profile beside Inductor's, a line each (ms per step by kernel category, busy, idle),
    then the top 10 kernels of each cgtrees miss."""
    kinds = list(CATEGORY_LABELS)
    head = ["model / backend", "ms/step", *(CATEGORY_LABELS[k] for k in kinds), "busy", "idle"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, backend, slower in found:
        for b, label in (("inductor", "inductor"), (backend, f"{backend} ({slower:.2f}x)")):
            r = _row(rows, model, b) or {}
            p = r.get("profile") or {}
            if not p:
                lines.append(f"| {model} / {label} | {_fmt(_get(r, 'step_ms'), '{:.1f}')} | no profile: "
                             f"{_clean(r.get('profile_error') or 'none in the row')[:150]} |")
                continue
            cells = [_fmt(p.get("categories_ms", {}).get(k), "{:.2f}") for k in kinds]
            lines.append(f"| {model} / {label} | {_fmt(_get(r, 'step_ms'), '{:.1f}')} | {' | '.join(cells)} | "
                         f"{_fmt(p.get('busy_ms'), '{:.2f}')} | {_fmt(p.get('idle_ms'), '{:.2f}')} |")
    top = ["| model | ms/step | launches/step | category | kernel |", "|---|---|---|---|---|"]
    for model, backend, _ in found:
        if backend == "cgtrees":
            p = (_row(rows, model, backend) or {}).get("profile") or {}
            for k in (p.get("top_families") or p.get("top", []))[:10]:
                top.append(f"| {model} | {k['ms']:.3f} | {k['launches']:g} | {k['category']} | "
                           f"`{_clean(k['name'])[:100]}` |")
    if len(top) > 2:
        lines += ["", "The top 10 kernels of each cgtrees miss (a generated kernel's family: summed over the layers):",
                  "", *top]
    return "\n".join(lines)


def _clean(text: str) -> str:
    """Text for a table cell: one line, no '|', no directories (a page names no machine's paths)."""
    text = re.sub(r"(?<![\w.-])/(?:[\w.+-]+/)+", "", str(text))
    return text.replace("\n", " ").replace("|", "\\|")


def not_measured(rows: list[dict]) -> list[str]:
    lines = []
    for r in (r for r in rows if not r.get("ok")):
        status, error = str(r.get("status")), _clean(r.get("error"))[:300]
        lines.append(f"- {r['model']} / {r['backend']}: {error if error.startswith(status) else f'{status}: {error}'}")
    return lines


def block(rows: list[dict]) -> str:
    """The marked block, markers included; without rows, a line saying how it is filled."""
    body = [BEGIN, "## Real sizes", ""]
    rows = shown(rows)
    if not rows:
        body += ["No results yet: the table is filled by `benchmarks/size_report.py` from the results of "
                 "`benchmarks/size_run.py` (GPU), whose docstring has the commands.", END]
        return "\n".join(body) + "\n"
    if all(r.get("smoke") for r in rows):
        body += ["**Smoke rows**: tiny configs on a CPU, which check the plumbing, not speed.", ""]
    body += [main_table(rows), "", ABOUT, "", "### Errors against eager, memory", "", error_table(rows), ""]
    found = misses(rows)
    body += [f"### Where cgtrees takes more than {TARGET}x Inductor's step", ""]
    if found:
        body += ["Per step, from `torch.profiler` over 5 steps: device ms by kernel category; busy: the union "
                 "of the kernels' intervals; idle: the median step less busy.", "", profile_tables(rows, found), ""]
    elif any(ratio(rows, m) is not None for m in models(rows)):
        body += [f"None: every cgtrees row is at most {TARGET}x Inductor's step.", ""]
    else:
        body += ["No row has an Inductor row beside it to compare with.", ""]
    gone = not_measured(rows)
    if gone:
        body += ["### Rows not measured", "", *gone, ""]
    body.append(END)
    return "\n".join(body) + "\n"


def splice(text: str, new_block: str) -> str:
    """``text`` with its real-size block replaced by ``new_block`` (appended if it had none)."""
    return report.splice(text, new_block, BEGIN, END)


def write(path: str, rows: list[dict]) -> None:
    file = Path(path)
    old = file.read_text() if file.exists() else ""
    file.write_text(splice(old, block(rows)))


# --- the screen --------------------------------------------------------------------------------------

def progress(row: dict) -> str:
    """One line per row as a call measures it."""
    def f(key: str, fmt: str) -> str:
        return _fmt(_get(row, key), fmt)

    tail = "" if row.get("ok") else f"  {str(row.get('status')).upper()}: {str(row.get('error'))[:240]}"
    return (f"{row['model']:15} {row['backend']:15} step {f('step_ms', '{:.1f}')} ms "
            f"({f('step_ms_min', '{:.1f}')}-{f('step_ms_max', '{:.1f}')})  compile {f('compile_s', '{:.1f}')}s  "
            f"peak {f('peak_reserved_gb', '{:.1f}')} GB  [process {_fmt(row.get('process_s'), '{:.0f}')}s]{tail}")


def screen(rows: list[dict]) -> str:
    """The summary printed at the end of a call: a line per row, cgtrees / inductor per model, what failed."""
    head = f"{'model':15} {'backend':15} {'ms/step':>8} {'min':>8} {'max':>8} {'x ind':>6} {'rate/s':>8} " \
           f"{'compile s':>9} {'peak GB':>7} {'loss rel':>8} {'grad rel':>8} status"
    lines = [head, "-" * len(head)]
    for model in models(rows):
        for r in (r for r in rows if r["model"] == model):
            key = "loss" if r.get("mode") == "train" else "out"
            lines.append(f"{model:15} {r['backend']:15} {_fmt(_get(r, 'step_ms'), '{:.1f}'):>8} "
                         f"{_fmt(_get(r, 'step_ms_min'), '{:.1f}'):>8} {_fmt(_get(r, 'step_ms_max'), '{:.1f}'):>8} "
                         f"{_fmt(ratio(rows, model, r['backend']), '{:.2f}'):>6} {_rate(_get(r, 'throughput')):>8} "
                         f"{_fmt(_get(r, 'compile_s'), '{:.1f}'):>9} "
                         f"{_fmt(_get(r, 'peak_reserved_gb'), '{:.1f}'):>7} "
                         f"{_fmt(_get(r, f'{key}_rel_err'), '{:.0e}'):>8} {_fmt(_get(r, 'grad_rel_err'), '{:.0e}'):>8} "
                         f"{r.get('status')}")
        r = ratio(rows, model)
        if r is not None:
            lines.append(f"{'':31}cgtrees / inductor: {r:.2f}x")
    lines += [f"  {line[2:]}" for line in not_measured(rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="result files or folders of size_run.py")
    p.add_argument("--markdown", help="rewrite the real-size block of this file (e.g. docs/benchmarks.md)")
    args = p.parse_args(argv)
    rows, _ = load(args.paths)
    print(screen(shown(rows)))
    if args.markdown:
        write(args.markdown, rows)
        print(f"wrote the real-size block of {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
