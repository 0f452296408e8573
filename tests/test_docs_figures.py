"""docs/benchmarks.md: the sizes users run open the page, and the figures its prose cites are the
result files' (not typed by hand from an older run). Each check recomputes a sentence's figures from
the files behind it and looks for that sentence on the page."""

from __future__ import annotations

import json
import os
import re

from bench_helpers import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
NAMES = {"gpt2_small": "GPT-2", "bert_base": "BERT-base", "vit_b16_infer": "ViT-B/16 inference",
         "vit_b16_train": "ViT-B/16 training", "resnet50_train": "ResNet-50 training",
         "resnet50_infer": "ResNet-50 inference", "llama_1b": "Llama 1B", "gpt2_small_ddp": "GPT-2 DDP"}


def _page() -> str:
    return re.sub(r"\s+", " ", open(PAGE).read())  # the prose wraps anywhere


def _size_rows() -> list[dict]:
    rows, _ = bench("size_report").load([os.path.join(RESULTS, "real-size")])
    return bench("size_report").shown(rows)


def _ratio(rows: list[dict], model: str, key: str, backend: str, against: str) -> float:
    mine = next(r for r in rows if r["model"] == model and r["backend"] == backend)
    theirs = next(r for r in rows if r["model"] == model and r["backend"] == against)
    return mine[key] / theirs[key]


def test_page_opens_with_real_sizes_then_serving_then_the_own_suite():
    text = open(PAGE).read()
    order = [text.index(s) for s in ("## Real sizes", "## Serving (LLM decoding)", "## Own suite", "## Real models")]
    assert order == sorted(order), order
    assert text.index("| model | mode | sizes |") < len("\n".join(text.splitlines()[:12]))  # a table, not prose, first


def test_rebuilding_the_page_keeps_real_sizes_and_serving_first(tmp_path):
    """run.py --markdown rewrites the own suite's part and keeps the marked sections where they were."""
    page = tmp_path / "benchmarks.md"
    page.write_text(open(PAGE).read())
    own = [os.path.join(RESULTS, f) for f in sorted(os.listdir(RESULTS)) if re.match(r"1[1-8]-h100-.*\.json", f)]
    bench("run").main(["--from-json", ",".join(own), "--markdown", str(page)])
    before, after = open(PAGE).read(), page.read_text()
    for name in ("real-size", "real-size-reading", "serving-section", "real-models"):
        block = re.search(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->", before, re.S).group(0)
        assert after.count(block) == 1, name
    assert after.index("<!-- serving-section:end -->") < after.index("## Own suite") < after.index("## Real models")


def test_real_size_reading_cites_the_files_ratios():
    rows, page = _size_rows(), _page()
    models = sorted({r["model"] for r in rows})
    # Against Inductor, per model, as the reading's first paragraph names them.
    for model in models:
        assert f"{NAMES[model]} {_ratio(rows, model, 'step_ms', 'cgtrees', 'inductor'):.2f}x" in page, model
    # Against reduce-overhead: the range, and the rows at its top.
    against_ro = {m: _ratio(rows, m, "step_ms", "cgtrees", "reduce-overhead") for m in models}
    lo, hi = min(against_ro.values()), max(against_ro.values())
    assert f"cgtrees is {lo:.2f}x-{hi:.2f}x" in page, (lo, hi)
    over = sorted((m for m, v in against_ro.items() if round(v, 2) > 1.1), key=against_ro.get)
    assert f"({', '.join(f'{NAMES[m]} {against_ro[m]:.2f}x' for m in over)})" in page, over
    # Cold compile against Inductor's: the rows over it, each with its ratio.
    compile_ratio = {m: _ratio(rows, m, "compile_s", "cgtrees", "inductor") for m in models}
    slower = [m for m in models if round(compile_ratio[m], 2) > 1.0]
    listed = " and ".join(f"{NAMES[m]} ({compile_ratio[m]:.2f}x)" for m in slower)
    assert f"Cold compile is at most Inductor's except {listed}." in page, slower


def _serve(name: str, backend: str, cache: int | None = None, batch: int | None = None) -> dict:
    rows = json.load(open(os.path.join(RESULTS, "serving", name)))["rows"]
    return next(r for r in rows
                if r["backend"] == backend and cache in (None, r["cache"]) and batch in (None, r["batch"]))


def test_serving_reading_cites_the_files_ratios():
    page = _page()
    one, eight = "serve-loop-b1-c160_4096-h200-8206a89.json", "serve-llama_8b-loop-b1-c160-h200-8206a89.json"
    now, ab_again = "serve-loop-b1-c160-h200-a8cd1dd.json", "serve-loop-b1-c160-h200-a0b84cc.json"
    for file, cache, batch, said in (
            (now, 160, 1, "{1:.2f} ms a token against reduce-overhead's {2:.2f} ({0:.2f}x)"),
            ("serve-loop-b1-c160-h200-33474e1.json", 160, 1, "{1:.2f} against {2:.2f} ({0:.2f}x), 51% of HBM"),
            ("serve-loop-b1-c160-h200-e7ca5c1.json", 160, 1, "{1:.2f} ms a token against reduce-overhead's {2:.2f} "
                                                           "({0:.2f}x), 53% of HBM"),
            (one, 4096, 1, "{1:.2f} against {2:.2f} ms ({0:.1f}x), the cache split"),
            ("serve-loop-b1_32-c4096-h200-f6d0573.json", 4096, 32, "{1:.2f} against {2:.2f} ms ({0:.1f}x), attention"),
            (eight, 160, 1, "{1:.2f} ms against {2:.2f} ({0:.2f}x)")):
        ours, theirs = _serve(file, "cgtrees", cache, batch), _serve(file, "reduce-overhead", cache, batch)
        ratio = ours["tokens_s"] / theirs["tokens_s"]
        assert said.format(ratio, ours["ms_token"], theirs["ms_token"]) in page, (file, cache, batch, ratio)
    assert f"{_serve(eight, 'cgtrees')['hbm_fraction']:.0%} of HBM (target 80%" in page
    for file, said in (("serve-loop-b1-c160-h200-0be931c.json", "the step was the same {:.2f} (against {:.2f})"),
                       ("serve-loop-b1-c160-h200-02fc232.json", "{:.2f} against {:.2f} at 02fc232 too"),
                       ("serve-loop-b1-c160-h200-b5c66bd.json", "ran {:.2f} against {:.2f}")):
        assert said.format(_serve(file, "cgtrees")["ms_token"], _serve(file, "reduce-overhead")["ms_token"]) in page
    timed = json.load(open(os.path.join(RESULTS, "serving", "probe-attention-timing-h200-02fc232.json")))
    probe = timed["batch 1, cache 160"]["decode_attention 32/4 split 64"]["alone"]
    assert 4 <= probe <= 5 and "forms at 17.5-17.9 us that a probe times at 4-5" in page, probe
    choices = open(os.path.join(RESULTS, "serving", "gemm-attention-choices-h200-02fc232.txt")).read()
    assert "decode_attention 32/4 split 64 17.5 us" in choices
    choices = open(os.path.join(RESULTS, "serving", "gemm-attention-choices-h200-e7ca5c1.txt")).read()
    line = choices.split("attention q")[1].split("\n")[0]
    forms = [float(us) for us in re.findall(r"decode_attention [^(,]+? ([\d.]+) us", line)]
    assert f"forms timed {min(forms):.1f}-{max(forms):.1f} us" in page, forms
    ab = _serve("serve-loop-b1-c160-h200-2e91152.json", "cgtrees"), _serve("serve-loop-b1-c160-h200-2e91152.json",
                                                                       "cgtrees-nopdl")
    assert f"{ab[0]['ms_token']:.2f} against {ab[1]['ms_token']:.2f} ms with that off" in page
    again = [_serve(ab_again, b)["ms_token"] for b in ("cgtrees", "cgtrees-nopdl")]
    assert "the same A/B gave {:.2f} against {:.2f}".format(*again) in page
    eights = "serve-loop-b8-c160_4096-h200-7e94893.json"
    ours8, ro8 = _serve(eights, "cgtrees", 160), _serve(eights, "reduce-overhead", 160)
    assert f"{ours8['ms_token']:.2f} ms against reduce-overhead's {ro8['ms_token']:.2f} " \
        f"({ours8['tokens_s'] / ro8['tokens_s']:.2f}x) at 160 tokens" in page
    ours8, ro8 = _serve(eights, "cgtrees", 4096), _serve(eights, "reduce-overhead", 4096)
    ratio8 = ours8["tokens_s"] / ro8["tokens_s"]
    assert f"{ours8['ms_token']:.2f} against {ro8['ms_token']:.2f} ({ratio8:.2f}x) at 4096" in page
    # The HF path's two calls at df50452: the table's row and the log of the other lane.
    hf = _serve("serve-hf-b1-c160-df50452.json", "cgtrees"), _serve("serve-hf-b1-c160-df50452.json", "reduce-overhead")
    log = open(os.path.join(RESULTS, "serving", "h200x4-lane3-df50452.log")).read()
    ms = {b: float(re.search(rf"'path': 'hf', 'backend': '{b}'.*? ok in \d+s: ([\d.]+) ms/token", log).group(1))
          for b in ("cgtrees", "reduce-overhead")}
    ratios = ms["reduce-overhead"] / ms["cgtrees"], hf[1]["ms_token"] / hf[0]["ms_token"]
    assert "{:.2f}x and {:.2f}x in two calls".format(*ratios) in page
    rows = "serve-hf-b1_8-c160-h200-fbc3011.json"
    for batch, said in ((1, "{1:.2f} against {2:.2f} ms ({0:.2f}x) at batch 1"),
                        (8, "{1:.2f} against {2:.2f} ({0:.2f}x) at batch 8")):
        ours, theirs = _serve(rows, "cgtrees", batch=batch), _serve(rows, "reduce-overhead", batch=batch)
        assert said.format(ours["tokens_s"] / theirs["tokens_s"], ours["ms_token"], theirs["ms_token"]) in page, batch


def test_hf_host_reading_cites_the_probes():
    """The HF path's host split: each figure the serving reading gives, from the probe's files."""
    page, folder = _page(), os.path.join(RESULTS, "serving", "hf-host")
    split = {f: json.load(open(os.path.join(folder, f"probe-hf-host-{f}.json")))["split_us"]
             for f in ("cgtrees-0be931c", "inductor-0be931c", "parts-cgtrees-f899ec0", "parts-inductor-f899ec0")}
    ours = sorted(split[f]["ours"] / 1e3 for f in ("cgtrees-0be931c", "parts-cgtrees-f899ec0"))
    assert f"our call {ours[0]:.2f}-{ours[1]:.2f}" in page, ours
    rerecord = [split[f]["rerecord_ms_per_generation"] for f in ("parts-cgtrees-f899ec0", "parts-inductor-f899ec0",
                                                                 "cgtrees-0be931c", "inductor-0be931c")]
    assert "{:.1f} against reduce-overhead's {:.1f} ms in one call, {:.1f} against {:.1f} in another".format(
        *rerecord) in page, rerecord
    third = [json.load(open(os.path.join(folder, f"probe-hf-host-{b}-ecf9682.json"))) for b in ("cgtrees", "inductor")]
    ours, theirs = (t["split_us"] for t in third)
    assert (f"our call {ours['ours'] / 1e3:.2f} ms against reduce-overhead's {theirs['ours'] / 1e3:.2f}, the "
            f"re-recording {ours['rerecord_ms_per_generation']:.1f} against {theirs['rerecord_ms_per_generation']:.1f} "
            f"ms (target: smaller; met in that call), generate {third[0]['median']['generate_ms']:.2f} against "
            f"{third[1]['median']['generate_ms']:.2f} ms a token") in page


def test_memory_reading_cites_the_files():
    """The paragraph on the tree's warmup pool: the real-size row's figures."""
    page, folder = _page(), os.path.join(RESULTS, "memory")
    row_file = os.path.join(folder, "size-gpt2_small-inductor_cgtrees-8f48a76.json")
    rows = {r["backend"]: r for r in json.load(open(row_file))["rows"]}
    ours, theirs = rows["cgtrees"], rows["inductor"]
    peak = f"{ours['peak_reserved_gb']:.2f} GB against Inductor's {theirs['peak_reserved_gb']:.2f}"
    assert f"row then gave {peak} at {ours['step_ms']:.1f} ms against {theirs['step_ms']:.1f}" in page
    steady = f"{ours['steady_reserved_gb']:.2f} GB against {theirs['steady_reserved_gb']:.2f}"
    assert f"steady steps reserve {steady}" in page


def _warm_rows(name: str) -> list[dict]:
    with open(os.path.join(RESULTS, "warm", name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_warm_start_real_size_table_cites_the_files():
    """docs/warm_start.md's real-size rows: the newest table's warm starts, Dynamo's trace and backend
    call as the warm_real.py files have them, the earlier call's figures in its prose, and each ratio
    in the reading recomputed from them."""
    text = open(os.path.join(ROOT, "docs", "warm_start.md")).read()
    section = text[text.index("## Real sizes:"):text.index("<!-- real-sizes:end -->")]
    prose = re.sub(r"\s+", " ", section)
    files = {"Llama": ["warm_real-llama_1b-h200-d4126de.jsonl", "warm_real-llama_1b-pc-h200-d4126de.jsonl"],
             "GPT-2": ["warm_real-gpt2_small-h200-d4126de.jsonl"]}
    best = {}
    for workload, names in files.items():
        per_file = [_warm_rows(name) for name in names]
        for backend in dict.fromkeys(r["backend"] for rows in per_file for r in rows):
            mine = [r for r in [rows for rows in per_file if any(r["backend"] == backend for r in rows)][-1]
                    if r["backend"] == backend]  # the newest file's: cgtrees-pc came again in the next call
            best[workload, backend] = min(r["first_s"] for r in mine if r["label"] != "cold")
            assert f"{best[workload, backend]:.2f}" in prose, (workload, backend)
    gpt2 = best["GPT-2", "cgtrees"], best["GPT-2", "inductor"]
    assert "GPT-2 warm {:.2f} for cgtrees, {:.2f} for Inductor".format(*gpt2) in prose
    newest = {("Llama (2200225)", r["backend"]): r for r in _warm_rows("warm_real-llama_1b-sampled-h200-2200225.jsonl")
              if r["label"] != "cold"}
    newest.update({("GPT-2 (b5c66bd)", r["backend"]): r
                   for r in _warm_rows("warm_real-gpt2_small-h200-b5c66bd-partial.jsonl") if r["label"] != "cold"})
    for (workload, backend), r in newest.items():
        line = next(ln for ln in section.splitlines() if ln.startswith(f"| {workload} | {backend} "))
        assert f"| **{r['first_s']:.2f}** | {r['phases']['dynamo']:.2f} | {r['phases']['backend']:.2f} |" in line, line
    llama = {b: r["first_s"] for (w, b), r in newest.items() if w.startswith("Llama")}
    assert f"{llama['cgtrees'] / llama['reduce-overhead']:.2f}x reduce-overhead's warm start" in prose
    assert f"{llama['cgtrees'] / llama['inductor']:.2f}x Inductor's" in section
    ratios = [best["Llama", "cgtrees"] / best["Llama", "reduce-overhead"],
              best["Llama", "cgtrees"] / best["Llama", "inductor"],
              best["GPT-2", "cgtrees"] / best["GPT-2", "inductor"],
              best["Llama", "cgtrees-pc"] / best["Llama", "reduce-overhead"]]
    for ratio in ratios:
        assert f"{ratio:.2f}x" in prose, ratio


def test_real_size_reading_cites_the_earlier_calls():
    """The GPT-2 and BERT readings' figures from calls kept beside the table (`real-size/earlier/`)."""
    page, folder = _page(), os.path.join(RESULTS, "real-size", "earlier")

    def rows(name: str) -> dict:
        return {r["backend"]: r for r in json.load(open(os.path.join(folder, name)))["rows"]}

    before, after = (rows(f"{c}-size-gpt2_small-one-graph-inductor_cgtrees.json") for c in ("ecf9682", "d3e343b"))
    ours, theirs = before["cgtrees"]["step_ms"], before["inductor"]["step_ms"]
    assert f"{ours:.1f} against Inductor's {theirs:.1f} at ecf9682" in page
    kernel = {k["name"]: k["ms"] for k in after["cgtrees"]["profile"]["top_families"]}["pw_fused_log_scatter_sum_exp"]
    assert f"{kernel:.2f} ms, {after['cgtrees']['step_ms']:.1f} against {after['inductor']['step_ms']:.1f}" in page
    bert = rows("d3e343b-size-bert_base-inductor_cgtrees.json")
    ours, theirs = bert["cgtrees"]["step_ms"], bert["inductor"]["step_ms"]
    assert f"At d3e343b {ours:.1f} against {theirs:.1f} ({ours / theirs:.2f}x; Inductor idle " \
           f"{bert['inductor']['profile']['idle_ms']:.1f} ms)" in page
    noisy = rows("217c5b1-size-gpt2_small-inductor_cgtrees.json")
    ind = noisy["inductor"]
    assert f"gave {noisy['cgtrees']['step_ms']:.1f} against {ind['step_ms']:.1f} " \
           f"({noisy['cgtrees']['step_ms'] / ind['step_ms']:.2f}x), Inductor's steps " \
           f"{ind['step_ms_min']:.1f}-{ind['step_ms_max']:.1f}" in page


def test_bert_reading_cites_its_profile():
    """BERT-base's reading (2a2aa10: its attention no longer the float32 math path) against its file."""
    name = os.path.join(RESULTS, "real-size", "size-bert_base-inductor_cgtrees-2a2aa10.json")
    rows = {r["backend"]: r for r in json.load(open(name))["rows"]}
    ours, theirs = (rows[b]["profile"]["categories_ms"] for b in ("cgtrees", "inductor"))
    page = _page()
    assert f"cuDNN's flash attention runs ({ours['attention']:.1f} ms a step" in page
    assert f"GEMMs {ours['gemm']:.1f} ms against Inductor's {theirs['gemm']:.1f}" in page
    assert f"generated kernels {ours['generated']:.1f} against {theirs['generated']:.1f}" in page
    assert theirs["attention"] == 0  # Inductor's attention: the math path's GEMMs and softmax
    assert f"peak reserved {rows['cgtrees']['peak_reserved_gb']:.1f} GB against " \
           f"{rows['inductor']['peak_reserved_gb']:.1f}" in page
