"""Hugging Face's two ways of compiling LLM decoding with ``backend="cgtrees"`` (issue 45), on CPU,
our generated Triton kernels run by Triton's interpreter:

1. the documented path: ``model.generate(ids, cache_implementation="static", compile_config=
   CompileConfig(fullgraph=True, backend="cgtrees"))``; generate runs the prefill eagerly and
   compiles its decode step;
2. the older path: ``model.forward = torch.compile(model.forward, backend="cgtrees")``, then
   ``generate(..., cache_implementation="static", disable_compile=True)``: prefill and decode compiled.

Each path runs in a fresh process (``CGTREES_INTERPRET=1`` before anything compiles, a private
``CGTREES_CACHE_DIR``) on tiny random-weight models: a Llama with grouped-query attention (4 heads,
2 KV heads), and on path 1 a Gemma with multi-query attention (1 KV head) whose heads are wider than
hidden / heads (head_dim 32, hidden 64). Greedy tokens must equal eager's (the same generate call,
``disable_compile=True``) exactly: float32, and the argmax over logits that match to rounding. No graph
falls back to aten, none bypasses the cache, Dynamo breaks nothing and compiles a known number of
graphs over 10 new tokens. Then a second process on the same cache: the same tokens, every graph a
cache hit at both levels, no kernel generated. The processes import a snapshot of the backend taken
once per module: the cache key hashes our source, and the tree may be edited while the tests run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from snapshot_helpers import backend_snapshot, keep_log
from subprocess_env import clean_env

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

NEW_TOKENS = 10

WORKER = keep_log("cgtrees.cache") + r'''  # keep: every cache event, a miss with its reason
import json, logging, sys
import torch
import transformers
from torch._dynamo.utils import counters
from cgtrees import counters as cgtrees_counters


VOCAB = 160
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)

def build(arch):
    torch.manual_seed(0)
    if arch == "llama":  # grouped-query attention: 4 heads, 2 KV heads of 16
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **COMMON))
    else:  # multi-query attention, heads of 32 (q is 128 wide for a hidden size of 64), GELU, scaled embeddings
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(num_key_value_heads=1, head_dim=32, **COMMON))
    return model.float().eval()

def generate(arch, path, new):
    for table in ("cgtrees", cgtrees_counters.GAP_OPS, "stats", "graph_break"):
        counters[table].clear()
    keep.messages.clear()
    torch._dynamo.reset()
    model = build(arch)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    # min_new_tokens: a random model may pick the EOS id; every run makes all its steps
    greedy = dict(cache_implementation="static", do_sample=False, max_new_tokens=new, min_new_tokens=new)
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **greedy)
        if path == "compile_config":
            config = transformers.generation.CompileConfig(fullgraph=True, backend="cgtrees")
            # generate compiles its decode step only on accelerators (cuda, xpu, ...) unless this
            # private flag is set: without it, on CPU, generate would run eagerly and test nothing
            config._compile_all_devices = True
            out = model.generate(ids, compile_config=config, **greedy)
        else:
            model.forward = torch.compile(model.forward, backend="cgtrees")
            out = model.generate(ids, disable_compile=True, **greedy)
    return {"arch": arch, "tokens": out.tolist(), "eager": eager.tolist(), "counters": cgtrees_counters.snapshot(),
            "gap_ops": cgtrees_counters.gap_ops(), "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": dict(counters["graph_break"]), "cache_log": list(keep.messages)}

args = json.loads(sys.argv[1])
print(json.dumps([generate(arch, args["path"], args["new"]) for arch in args["archs"]]))
'''


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return backend_snapshot(tmp_path_factory.mktemp("snapshot"), WORKER)


def _run(snapshot: Path, cache_dir: Path, path: str, archs: list[str], decisions: str = "measure") -> list[dict]:
    """One process, the archs one after another (each a fresh Dynamo and cleared counters).
    ``decisions``: ``CGTREES_GEMM_DECISIONS`` (``rewrite``: the forms a GPU would time, taken)."""
    env = clean_env()
    env.update(CGTREES_CACHE_DIR=str(cache_dir), PYTHONPATH=str(snapshot), CGTREES_INTERPRET="1",
               CGTREES_GEMM_DECISIONS=decisions, CGTREES_DEBUG_DIR=str(cache_dir.parent / "modules"))
    args = json.dumps({"path": path, "archs": archs, "new": NEW_TOKENS})
    proc = subprocess.run([sys.executable, str(snapshot / "worker.py"), args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_cold(run: dict, graphs: int) -> None:
    """Tokens equal eager's, ``graphs`` Dynamo graphs, each compiled by us into generated kernels."""
    what, c = f"{run['arch']} (cold)", run["counters"]
    assert run["tokens"] == run["eager"], what
    assert len(run["tokens"][0]) == 7 + NEW_TOKENS, what
    assert run["graph_breaks"] == {}, what
    assert run["unique_graphs"] == graphs, (what, run["unique_graphs"])  # a recompile would add one
    assert c["graphs_compiled"] == graphs, (what, c)
    assert c["graph_fallbacks"] == 0 and c["cache_bypass"] == 0 and c["cache_corrupt"] == 0, (what, c, run["cache_log"])
    assert c["aten_gaps"] == 0, (what, run["gap_ops"])
    assert c.get("cache_miss_aot", 0) == graphs and c["cache_hit"] == 0, (what, c)  # an empty cache
    assert c["kernels_generated"] > 0, (what, c)


def _check_warm(run: dict, cold: dict, graphs: int) -> None:
    """The same tokens, and every graph loaded from both cache levels: nothing traced or generated."""
    what, c = f"{run['arch']} (warm)", run["counters"]
    assert run["tokens"] == cold["tokens"] == run["eager"], what
    assert run["graph_breaks"] == {} and run["unique_graphs"] == graphs, (what, run["unique_graphs"])
    assert c["graph_fallbacks"] == 0 and c["cache_bypass"] == 0, (what, c, run["cache_log"])
    assert c["cache_miss"] == 0, (what, c, run["cache_log"])
    assert c.get("cache_hit_aot", 0) == c.get("cache_hit_module", 0) == graphs, (what, c, run["cache_log"])
    assert c["kernels_generated"] == 0, (what, c)


@pytest.mark.parametrize("decisions", ["measure", "rewrite"])
def test_generate_with_compile_config_matches_eager_in_one_graph_and_warm_starts(snapshot, tmp_path, decisions):
    """Path 1: one Dynamo graph, the decode step (generate runs the prefill eagerly), for all 10 tokens.
    ``rewrite`` takes the decode forms a GPU chooses by timing (nothing is timed on a CPU): q, k and v
    in one ``cgtrees.grouped_mm`` launch, attention over the grouped cache by ``cgtrees.decode_attention``;
    a warm process loads modules that call our ops."""
    from transformers.generation import CompileConfig

    if not hasattr(CompileConfig, "_compile_all_devices"):
        pytest.skip(f"transformers {transformers.__version__}: CompileConfig has no _compile_all_devices, "
                    "so generate never compiles on CPU")
    archs = ["llama", "gemma"] if decisions == "measure" else ["llama"]
    cold = _run(snapshot, tmp_path / "cache", "compile_config", archs, decisions)
    warm = _run(snapshot, tmp_path / "cache", "compile_config", archs, decisions)
    for first, second in zip(cold, warm):
        _check_cold(first, graphs=1)
        _check_warm(second, first, graphs=1)
    modules = [p.read_text() for p in (tmp_path / "modules").glob("*.py")]
    rewritten = {("grouped_gemv.grouped_mm_direct(" in m, "decode_attention.decode_attention_direct(" in m)
                 for m in modules}
    assert rewritten == {(True, True) if decisions == "rewrite" else (False, False)}, rewritten


def test_compiled_forward_in_generate_matches_eager_in_two_graphs_and_warm_starts(snapshot, tmp_path):
    """Path 2: two Dynamo graphs, the prefill (7 tokens a sequence) and the decode step (1 token).
    The decode call passes an ``attention_mask`` (4-D, over the static cache) that the prefill does
    not, and ``input_ids`` of length 1, so Dynamo recompiles once; it marks the length dynamic, but
    Dynamo specializes a size of 1, so the decode graph is static and serves every later token."""
    cold = _run(snapshot, tmp_path / "cache", "compiled_forward", ["llama"])
    warm = _run(snapshot, tmp_path / "cache", "compiled_forward", ["llama"])
    _check_cold(cold[0], graphs=2)
    _check_warm(warm[0], cold[0], graphs=2)
