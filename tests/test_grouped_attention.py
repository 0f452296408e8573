"""SDPA over grouped KV heads (``backend/codegen/grouped_attention.py``) on CPU, through Triton's
interpreter: ``gemm_decisions=rewrite`` takes a form the GPU would time, and the module then calls
our ``decode_attention`` (a decode step's few query rows) or ``enable_gqa`` (more rows than it
takes) on the cache as it is, with no copy of K or V; values as eager's. The timing itself needs a
GPU (``tests/gpu/test_grouped_attention_gpu.py``)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, TimedPlan, compile_fn, config

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

B, HEADS, KV_HEADS, CACHE, DIM = 2, 6, 2, 23, 16  # 3 query heads a KV head, an odd cache length


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``."""
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def decode_attention(q, k_cache, v_cache, k_new, pos, mask):
    """One decode step's attention as a Llama layer writes it: the new K into the static cache,
    K and V expanded to the query heads, SDPA with the cache's mask, the heads merged."""
    k_cache = k_cache.index_copy(2, pos, k_new)
    groups = q.shape[1] // k_cache.shape[1]
    out = F.scaled_dot_product_attention(q, repeat_kv(k_cache, groups), repeat_kv(v_cache, groups), attn_mask=mask)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1), k_cache


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, 1, DIM, generator=g, dtype=dtype)
    k = torch.randn(B, KV_HEADS, CACHE, DIM, generator=g, dtype=dtype)
    v = torch.randn(B, KV_HEADS, CACHE, DIM, generator=g, dtype=dtype)
    k_new = torch.randn(B, KV_HEADS, 1, DIM, generator=g, dtype=dtype)
    mask = torch.arange(CACHE)[None, None, None, :] <= 17
    return q, k, v, k_new, torch.tensor([17]), mask.expand(B, 1, 1, CACHE)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, rtol=16 * eps, atol=16 * eps * max(want.abs().max().item(), 1.0))


def test_rewrite_calls_decode_attention_on_the_cache_as_it_is():
    inputs = _inputs()
    module = compile_fn(decode_attention, *inputs, cfg=config(gemm_decisions="rewrite"))
    assert "cgtrees.codegen.decode_attention.decode_attention_direct(" in module.source, module.source
    assert "aten.clone" not in module.source and "pw_fused_clone" not in module.source, module.source
    (choice,) = [c for c in module.graph.gemm_choices if "attention" in c]
    assert choice.endswith(f"attention q [{B}, {HEADS}, 1, {DIM}] kv [{B}, {KV_HEADS}, {CACHE}, {DIM}] x3 float32: "
                           "decode_attention 32/4 (gemm_decisions=rewrite)"), choice
    for got, want in zip(module.call(list(inputs)), decode_attention(*inputs)):
        _close(got, want)


def test_rewrite_calls_enable_gqa_where_a_program_would_hold_too_many_query_rows():
    """30 query positions x 3 heads a KV head: 90 rows, more than ``decode_attention`` takes."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, 30, DIM, generator=g)
    k, v = (torch.randn(B, KV_HEADS, CACHE, DIM, generator=g) for _ in range(2))

    def prefill(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3))

    module = compile_fn(prefill, q, k, v, cfg=config(gemm_decisions="rewrite"))
    assert "enable_gqa=True" in module.source and "decode_attention" not in module.source, module.source
    (choice,) = [c for c in module.graph.gemm_choices if "attention" in c]
    assert choice.endswith("x3 float32: enable_gqa (gemm_decisions=rewrite)"), choice
    _close(module.call([q, k, v])[0], prefill(q, k, v))


@pytest.mark.parametrize("mode", ["keep", "measure"])
def test_keep_and_measure_without_a_gpu_keep_the_traced_expansion(mode):
    inputs = _inputs()
    module = compile_fn(decode_attention, *inputs, cfg=config(gemm_decisions=mode))
    assert "enable_gqa" not in module.source
    (choice,) = [c for c in module.graph.gemm_choices if "attention" in c]
    why = "gemm_decisions=keep" if mode == "keep" else "no GPU to time on (cpu)"
    assert choice.endswith(f"as traced ({why})"), choice
    for got, want in zip(module.call(list(inputs)), decode_attention(*inputs)):
        _close(got, want)


def test_equal_heads_and_a_used_log_sum_exp_are_left_as_traced():
    """No expansion (as many KV heads as query heads): nothing to choose. A training forward saves
    the attention's log-sum-exp for its backward: the traced call stays, and gradients are eager's."""
    q, k, v, k_new, pos, mask = _inputs()
    module = compile_fn(lambda q, k, v: F.scaled_dot_product_attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1)),
                        q, k, v, cfg=config(gemm_decisions="rewrite"))
    assert not any("attention" in c for c in module.graph.gemm_choices)

    def train(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3)).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    comp = Compiler(config(gemm_decisions="rewrite"))
    torch._dynamo.reset()
    torch.compile(train, backend=comp.with_our_partition)(*leaves).backward()
    comp.check()
    assert all("enable_gqa" not in m.source for m in comp.modules)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    train(*eager).backward()
    for got, want in zip(leaves, eager):
        _close(got.grad, want.grad)


def test_a_llama_decode_step_with_grouped_heads_generates_eager_tokens(monkeypatch, tmp_path):
    """The whole path: a tiny Hugging Face Llama with 4 query heads on 2 KV heads, a static cache
    and a compiled decode step, the grouped form forced (``decode_attention``, the query's RoPE in
    it); greedy tokens as eager's."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("CGTREES_GEMM_DECISIONS", "rewrite")
    monkeypatch.setenv("CGTREES_INTERPRET", "1")  # as the rest of this process (codegen_helpers.INTERPRET)
    monkeypatch.setenv("CGTREES_DEBUG_DIR", str(tmp_path))
    monkeypatch.setenv("CGTREES_CACHE", "0")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(ids, disable_compile=True, **kwargs)
        torch._dynamo.reset()
        step = torch.compile(model.forward, backend="cgtrees", fullgraph=True)
        got = _greedy(model, step, ids, 6)
    assert torch.equal(got, want[:, ids.shape[1]:]), (got, want)
    sources = [p.read_text() for p in tmp_path.glob("*.py")]
    assert sources and all(s.count("decode_attention.decode_attention_direct(") == 2 and "repeat_kv" not in s
                           for s in sources)
    # q reaches the kernel unrotated, with cos and sin: the query's RoPE is the kernel's (codegen/rope.py)
    rotating = r"decode_attention_direct\((\w+, ){4}[\d.]+, \[[\d, ]+\], (\d+, ){3}\w+, \w+\)"
    assert all(len(re.findall(rotating, s)) == 2 for s in sources), sources
    # each layer writes its K and V cache entries in one kernel (scheduler: scatters side by side)
    assert all(len(re.findall(r"\ndef \w*index_put\w*\(", s)) == 2 for s in sources), sources


def _greedy(model, step, ids, new: int) -> torch.Tensor:
    """Eager prefill into a static cache, then ``new`` - 1 compiled decode steps."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new)
    # transformers renamed ``past_key_values`` to ``cache`` (5.24 warns of the old name)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = model(input_ids=ids, use_cache=True, **{name: cache}).logits
    tokens = [logits[:, -1].argmax(-1, keepdim=True)]
    for i in range(new - 1):
        pos = torch.tensor([ids.shape[1] + i])
        logits = step(input_ids=tokens[-1], position_ids=pos[None], use_cache=True, **{name: cache}).logits
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1)


def test_a_float_mask_made_from_a_boolean_one_is_given_as_the_boolean():
    """SDPA converts a boolean mask to ``where(keep, 0, -inf)`` inside the traced graph; the grouped
    call takes ``keep`` itself (SDPA converts it the same way), and the conversion goes."""
    inputs = _inputs()
    module = compile_fn(decode_attention, *inputs, cfg=config(gemm_decisions="rewrite"))
    call = module.source.split("\ndef call(")[1]
    (line,) = [x for x in call.splitlines() if "decode_attention_direct(" in x]
    assert ", mask_1," in line, line  # the boolean input itself, not a float ``where`` of it
    assert "-inf" not in module.source, call
    for got, want in zip(module.call(list(inputs)), decode_attention(*inputs)):
        _close(got, want)


@pytest.mark.parametrize("us, taken", [
    ({"as traced": 10.0, "enable_gqa": 6.0, "decode_attention": 4.0}, "decode_attention 32/4"),
    ({"as traced": 10.0, "enable_gqa": 3.0, "decode_attention": 4.0}, "enable_gqa"),
    ({"as traced": 4.05, "enable_gqa": 6.0, "decode_attention": 4.0}, "as traced")])
def test_the_fastest_form_is_taken_where_it_beats_the_traced_one_by_the_margin(us, taken):
    """Every form runs on the traced layouts; the fastest is taken unless the traced one is within
    ``gemm_choice.MARGIN`` of it; no split configuration where the cache is shorter than a slice; the
    forms are timed one call at a time (``gemm_timing``'s ``alone``)."""
    from codegen_helpers import trace

    from cgtrees.codegen import grouped_attention, interp

    interp.enable()
    gm = trace(decode_attention, *_inputs(torch.bfloat16))
    (node,) = [n for op in grouped_attention.SDPA_OPS for n in gm.graph.find_nodes(op="call_function", target=op)]
    plan = TimedPlan(us)
    assert grouped_attention._choose(grouped_attention._grouped(node), plan) == taken
    assert plan.alone == [True]  # each call after a kernel that has ended, as in a step
    (note,) = plan.notes
    assert [name for name, _ in note[3]] == ["as traced", "enable_gqa", "decode_attention 32/4",
                                             "decode_attention 64/4", "decode_attention 128/4"]  # no slice: 23 cached
