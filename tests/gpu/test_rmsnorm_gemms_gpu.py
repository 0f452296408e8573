"""A Llama layer's residual add, its RMSNorm and the GEMVs that read it (q/k/v; gate/up with the
SiLU-and-multiply), fused or not by timing on the GPU (``backend/codegen/rmsnorm_gemms.py``,
``gemv_add_rmsnorm.py``), at a 1.1B Llama's decode shapes (TinyLlama: bf16, hidden 2048, q/k/v
2048|256|256, gate/up 5632): the compiled ops match eager (the residual stream bit for bit, the
products to bf16 rounding) with each of their block sizes; the header line holds both forms'
timings and the form taken is within ``gemm_choice.MARGIN`` of the fastest; under
``gemm_decisions=rewrite`` a real decode graph (transformers' LlamaForCausalLM at TinyLlama's widths,
two layers) calls the ops for each layer's two norms and the final one (with the LM head)."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

HIDDEN, QKV, INTERMEDIATE, EPS = 2048, (2048, 256, 256), 5632, 1e-5


def rmsnorm(h, weight):
    h32 = h.to(torch.float32)
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)


def layer(residual, attn_out, norm_weight, wq, wk, wv):
    h = residual + attn_out
    n = rmsnorm(h, norm_weight).view(-1, h.shape[-1])
    return n @ wq.t(), n @ wk.t(), n @ wv.t(), h


def mlp_layer(residual, attn_out, norm_weight, w_gate, w_up, w_down):
    h = residual + attn_out
    n = rmsnorm(h, norm_weight).view(-1, h.shape[-1])
    return (F.silu(n @ w_gate.t()) * (n @ w_up.t())) @ w_down.t(), h


def _mlp_args(seed: int = 0):
    g = torch.Generator("cuda").manual_seed(seed)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    return (torch.randn(1, 1, HIDDEN, **kw), torch.randn(1, 1, HIDDEN, **kw), 1 + torch.randn(HIDDEN, **kw) / 4,
            torch.randn(INTERMEDIATE, HIDDEN, **kw) / 45, torch.randn(INTERMEDIATE, HIDDEN, **kw) / 45,
            torch.randn(HIDDEN, INTERMEDIATE, **kw) / 75)


def _args(seed: int = 0):
    g = torch.Generator("cuda").manual_seed(seed)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    return (torch.randn(1, 1, HIDDEN, **kw), torch.randn(1, 1, HIDDEN, **kw), 1 + torch.randn(HIDDEN, **kw) / 4,
            *(torch.randn(n, HIDDEN, **kw) / 45 for n in QKV))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("add", [True, False])
def test_compiled_op_matches_eager_at_tinyllama_shapes(add):
    from cgtrees.codegen import gemv_add_rmsnorm, rmsnorm_gemms

    x, residual, nw, *ws = _args()
    residual = residual if add else None
    h = x + residual if add else x
    n = rmsnorm(h, nw).view(1, -1)
    want = [n @ w.t() for w in ws]
    n_kernel = torch.full_like(n, float("nan"))  # the unfused form's norm kernel: the same prologue
    gemv_add_rmsnorm.launch_add_rmsnorm(x, residual, nw, EPS, torch.empty_like(x) if add else None, n_kernel)
    _close(n_kernel, n)
    eye = torch.eye(HIDDEN, device="cuda", dtype=torch.bfloat16)
    for config in rmsnorm_gemms._CONFIGS:
        got = torch.ops.cgtrees.add_rmsnorm_grouped_mm(x, residual, nw, EPS, ws, *config)
        assert len(got) == 3 + add
        for g, w in zip(got, want):
            _close(g, w)
        if add:
            assert torch.equal(got[3], h), config
        (normed, *_) = torch.ops.cgtrees.add_rmsnorm_grouped_mm(x, residual, nw, EPS, [eye], *config)
        # the fused prologue is the norm kernel's (its float32 sum of squares in another order: a bf16 ulp)
        torch.testing.assert_close(normed.float(), n_kernel.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("add", [True, False])
def test_compiled_silu_mul_op_matches_eager_at_tinyllama_shapes(add):
    from cgtrees.codegen import gemv_add_rmsnorm, gemv_silu_mul, rmsnorm_gemms

    x, residual, nw, wg, wu, _ = _mlp_args()
    residual = residual if add else None
    h = x + residual if add else x
    n = rmsnorm(h, nw).view(1, -1)
    want = F.silu(n @ wg.t()) * (n @ wu.t())
    n_kernel = torch.empty_like(n)
    gemv_add_rmsnorm.launch_add_rmsnorm(x, residual, nw, EPS, torch.empty_like(x) if add else None, n_kernel)
    unfused = torch.empty_like(want)  # the unfused form's mm_silu_mul on the norm kernel's n
    gemv_silu_mul.launch(n_kernel, wg, wu, unfused, 1, 2048, 8)
    for config in rmsnorm_gemms._SILU_CONFIGS:
        got = torch.ops.cgtrees.add_rmsnorm_mm_silu_mul(x, residual, nw, EPS, wg, wu, *config)
        assert len(got) == 1 + add
        _close(got[0], want)
        _close(got[0], unfused)
        if add:
            assert torch.equal(got[1], h), config


@pytest.mark.parametrize("fn", ["qkv", "mlp"])
def test_add_norm_gemvs_are_timed_both_ways(fn):
    from codegen_helpers import compile_fn, config

    f, args, op = (layer, _args(1), "add_rmsnorm_grouped_mm") if fn == "qkv" else \
        (mlp_layer, _mlp_args(1), "add_rmsnorm_mm_silu_mul")
    module = compile_fn(f, *args, cfg=config(gemm_decisions="measure"))
    choice = next((c for c in module.graph.gemm_choices if "rmsnorm(add)" in c), None)
    if choice is None:  # cuBLAS kept: nothing read the norm through grouped_mm or mm_silu_mul
        pytest.skip(f"no grouped_mm or mm_silu_mul taken: {module.graph.gemm_choices}")
    print(choice)
    timings = dict((name, float(us)) for name, us in re.findall(
        rf"(unfused|{op} \S+) ([\d.]+) us", choice))
    assert "unfused" in timings and any(n.startswith("add_rmsnorm") for n in timings), choice
    taken = choice.split(": ")[2].split(" (")[0]
    if taken == "unfused":
        assert min(timings.values()) >= timings["unfused"] * 0.97, choice
    else:
        assert timings[taken] <= min(timings.values()) * 1.05, choice
    call = module.source.split("\ndef call(")[1]
    assert (op in call) == (taken != "unfused"), call
    for got, want in zip(module.call(list(args)), f(*args)):
        _close(got, want)


def test_rewrite_fuses_a_tinyllama_decode_graph(tmp_path):
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                   num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                                   rms_norm_eps=EPS, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 1000, (1, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    greedy = dict(cache_implementation="static", do_sample=False, max_new_tokens=4, min_new_tokens=4,
                  output_logits=True, return_dict_in_generate=True)
    options = dict(cache=False, gemm_decisions="rewrite", debug_dir=str(tmp_path))
    compile_config = transformers.generation.CompileConfig(fullgraph=True, backend="cgtrees", mode=None,
                                                           options=options)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = model.generate(ids, disable_compile=True, **greedy)
            fused = model.generate(ids, compile_config=compile_config, **greedy)
    finally:
        torch._dynamo.reset()
    sources = [p.read_text() for p in tmp_path.glob("*inference*.py")]
    calls = [s.split("\ndef call(")[1] for s in sources]
    assert any(len(re.findall(r"add_rmsnorm_grouped_mm_direct\(", c)) == 3 and
               len(re.findall(r"add_rmsnorm_mm_silu_mul_direct\(", c)) == 2 for c in calls), \
        [p.name for p in tmp_path.iterdir()]
    _close(fused.logits[1], eager.logits[1])  # the first decode step's (generate runs the prefill eagerly)
