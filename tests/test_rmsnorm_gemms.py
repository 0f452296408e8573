"""A residual add, the RMSNorm after it and the one-row GEMVs that read it as one launch: q/k/v as
``cgtrees.add_rmsnorm_grouped_mm``, the MLP's gate/up and SiLU-and-multiply as
``cgtrees.add_rmsnorm_mm_silu_mul`` (``backend/codegen/rmsnorm_gemms.py``, ``gemv_add_rmsnorm.py``)
on CPU, through Triton's interpreter: the op against eager (hidden 111, N 45: irregular, so masks
matter; float32 and 16-bit; the prologue exactly eager's, checked through identity weights, so every
rounding of eager's chain is checked); ``gemm_decisions=rewrite`` takes the fused form the GPU would
time, in a hand-written layer and in a real tiny Llama's decode step (tokens and logits those of the
unfused run); what does not match, and training graphs, stay unfused. Timing needs a GPU
(``tests/gpu/test_rmsnorm_gemms_gpu.py``)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, TimedPlan, compile_fn, config, context, trace

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

EPS = 1e-6


def rmsnorm(h, weight):
    """HF Llama's LlamaRMSNorm."""
    h32 = h.to(torch.float32)
    variance = h32.pow(2).mean(-1, keepdim=True)
    return weight * (h32 * torch.rsqrt(variance + EPS)).to(h.dtype)


def layer(residual, attn_out, norm_weight, wq, wk, wv):
    """The residual add and the input norm of a Llama layer, then its q, k and v projections."""
    h = residual + attn_out
    n = rmsnorm(h, norm_weight).view(-1, h.shape[-1])
    return n @ wq.t(), n @ wk.t(), n @ wv.t(), h


def mlp_layer(residual, attn_out, norm_weight, w_gate, w_up, w_down):
    """The residual add and the post-attention norm of a Llama layer, then its MLP."""
    h = residual + attn_out
    n = rmsnorm(h, norm_weight).view(-1, h.shape[-1])
    return (F.silu(n @ w_gate.t()) * (n @ w_up.t())) @ w_down.t(), h


def eager_silu_op(x, residual, norm_weight, w_gate, w_up):
    h = x + residual if residual is not None else x
    n = rmsnorm(h, norm_weight).view(1, -1)
    return [F.silu(n @ w_gate.t()) * (n @ w_up.t())] + ([h] if residual is not None else [])


def eager_op(x, residual, norm_weight, weights):
    h = x + residual if residual is not None else x
    n = rmsnorm(h, norm_weight).view(1, -1)
    return [n @ w.t() for w in weights] + ([h] if residual is not None else [])


def _rows(k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 1, k, generator=g).to(dtype), torch.randn(1, 1, k, generator=g).to(dtype),
            (1 + torch.randn(k, generator=g) / 4).to(dtype))


def _weights(k: int, ns: tuple[int, ...], dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype) for n in ns]


@pytest.fixture(autouse=True)
def _interpreter():
    from cgtrees.codegen import gemv_add_rmsnorm, interp  # noqa: F401 - registers the op

    interp.enable()  # as codegen does before it loads a module that calls the op (on a CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("add", [True, False])
def test_the_op_is_eager_add_rmsnorm_and_gemvs(add, dtype):
    """Hidden 111 (a block of 128, partly past the row), N 45|16|7 (no multiple of any block)."""
    x, residual, nw = _rows(111, dtype)
    residual = residual if add else None
    ws = _weights(111, (45, 16, 7), dtype)
    want = eager_op(x, residual, nw, ws)
    eps = torch.finfo(dtype).eps
    for form in ((2, 4), (1, 1), (8, 2)):
        got = torch.ops.cgtrees.add_rmsnorm_grouped_mm(x, residual, nw, EPS, ws, *form)
        assert len(got) == len(want) and [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            tol = (8 if dtype == torch.float32 else 2) * eps * w.float().abs().max().item()
            torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=tol)
        if add:
            assert torch.equal(got[-1], want[-1])  # the residual stream: one rounded add, eager's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("add", [True, False])
def test_the_prologue_rounds_where_eager_rounds(add, dtype):
    """Identity weights: the products are the norm itself, exactly. It equals eager's bit for bit only
    if the add is rounded to 16 bits, h * rsqrt(mean(h^2) + eps) is computed in float32 and rounded,
    and its product with the weight rounded again (one rounding at the end is not eager's)."""
    x, residual, nw = _rows(111, dtype, seed=2)
    residual = residual if add else None
    eye = torch.eye(111, dtype=dtype)
    want = eager_op(x, residual, nw, [eye, eye[:45]])
    h32 = (x + residual if add else x).float()
    once = (nw.float() * h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype).view(1, -1)
    assert not torch.equal(once, want[0])
    for form in ((2, 4), (4, 1)):
        got = torch.ops.cgtrees.add_rmsnorm_grouped_mm(x, residual, nw, EPS, [eye, eye[:45]], *form)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("add", [True, False])
def test_the_silu_mul_op_is_eager_add_rmsnorm_and_mlp_gate_up(add, dtype):
    """Hidden 111, N 45; then identity weights: silu(n) * n equals eager's bit for bit (16-bit) only
    where the prologue and the epilogue both round where eager rounds."""
    x, residual, nw = _rows(111, dtype, seed=7)
    residual = residual if add else None
    wg, wu = _weights(111, (45, 45), dtype, seed=8)
    want = eager_silu_op(x, residual, nw, wg, wu)
    eps = torch.finfo(dtype).eps
    for form in ((2, 8), (1, 1), (8, 2)):
        got = torch.ops.cgtrees.add_rmsnorm_mm_silu_mul(x, residual, nw, EPS, wg, wu, *form)
        assert len(got) == len(want) and [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            tol = (8 if dtype == torch.float32 else 2) * eps * w.float().abs().max().item()
            torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=tol)
    if dtype != torch.float32:
        eye = torch.eye(111, dtype=dtype)[:45]
        want = eager_silu_op(x, residual, nw, eye, eye)
        got = torch.ops.cgtrees.add_rmsnorm_mm_silu_mul(x, residual, nw, EPS, eye, eye, 2, 4)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_unfused_forms_norm_kernel_is_eager_add_rmsnorm():
    from cgtrees.codegen import gemv_add_rmsnorm

    x, residual, nw = _rows(111, torch.bfloat16, seed=3)
    h, n = torch.full_like(x, float("nan")), torch.full((1, 111), float("nan"), dtype=torch.bfloat16)
    gemv_add_rmsnorm.launch_add_rmsnorm(x, residual, nw, EPS, h, n)
    assert torch.equal(h, x + residual) and torch.equal(n, rmsnorm(x + residual, nw).view(1, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewrite_runs_add_norm_and_qkv_in_one_launch_with_eager_values(dtype):
    """The add, the norm and q, k, v are one call: no kernel computes an rsqrt, nothing else reads
    the norm, the residual stream is the op's last output. Sizes of whole 16-byte rows (hidden 104,
    N 40|16|8): ``gemm_decisions=rewrite`` pads GEMMs of other sizes, which then group no more."""
    x, residual, nw = _rows(104, dtype, seed=4)
    args = (x, residual, nw, *_weights(104, (40, 16, 8), dtype, seed=5))
    module = compile_fn(layer, *args, cfg=config(gemm_decisions="rewrite"))
    name = str(dtype).removeprefix("torch.")
    line = next(c for c in module.graph.gemm_choices if "rmsnorm" in c)
    assert re.fullmatch(rf"add\w*/grouped_mm\w*: rmsnorm\(add\) \[1, 104\] x 3 weights \[40\|16\|8, 104\] {name}: "
                        r"add_rmsnorm_grouped_mm 2/4 \(gemm_decisions=rewrite\)", line), module.graph.gemm_choices
    call = module.source.split("\ndef call(")[1]
    assert len(re.findall(r"add_rmsnorm_grouped_mm_direct\(", call)) == 1, call
    assert "grouped_mm_direct(" not in call.replace("add_rmsnorm_grouped_mm_direct(", "")
    assert "rsqrt" not in module.source.split("\ndef call(")[0].split("import cgtrees.codegen")[-1], module.source
    assert "import cgtrees.codegen.gemv_add_rmsnorm" in module.source
    got = module.call(list(args))
    want = layer(*args)
    eps = torch.finfo(dtype).eps
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=8 * eps * w.float().abs().max().item())
    assert torch.equal(got[3], want[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewrite_runs_add_norm_and_gate_up_in_one_launch_with_eager_values(dtype):
    """The add, the norm, gate, up and the SiLU-and-multiply are one call; the down projection reads
    its product, the residual stream is its last output."""
    x, residual, nw = _rows(104, dtype, seed=9)
    wg, wu = _weights(104, (40, 40), dtype, seed=10)
    wd = _weights(40, (104,), dtype, seed=11)[0]
    args = (x, residual, nw, wg, wu, wd)
    module = compile_fn(mlp_layer, *args, cfg=config(gemm_decisions="rewrite"))
    name = str(dtype).removeprefix("torch.")
    line = next(c for c in module.graph.gemm_choices if "rmsnorm" in c)
    assert re.fullmatch(rf"add\w*/mm_silu_mul\w*: rmsnorm\(add\) \[1, 104\] x silu\(gate\) \* up \[40, 104\] {name}: "
                        r"add_rmsnorm_mm_silu_mul 2/8 \(gemm_decisions=rewrite\)", line), module.graph.gemm_choices
    call = module.source.split("\ndef call(")[1]
    assert len(re.findall(r"add_rmsnorm_mm_silu_mul_direct\(", call)) == 1, call
    assert "mm_silu_mul_direct(" not in call.replace("add_rmsnorm_mm_silu_mul_direct(", "")
    got = module.call(list(args))
    want = mlp_layer(*args)
    eps = torch.finfo(dtype).eps
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=8 * eps * w.float().abs().max().item())
    assert torch.equal(got[1], want[1])


def _norm_read_twice(residual, attn_out, norm_weight, wq, wk, wv):
    *qkv, h = layer(residual, attn_out, norm_weight, wq, wk, wv)
    return (*qkv, rmsnorm(h, norm_weight) * 2)


def _norm_over_another_dim(residual, attn_out, norm_weight, wq, wk, wv):
    h = (residual + attn_out).view(-1, 1)
    h32 = h.float()
    n = (h32 * torch.rsqrt(h32.pow(2).mean(0, keepdim=True) + EPS)).to(h.dtype).view(-1) * norm_weight
    n = n.view(1, -1)
    return n @ wq.t(), n @ wk.t(), n @ wv.t()


def _norm_without_weight(residual, attn_out, norm_weight, wq, wk, wv):
    h = residual + attn_out
    h32 = h.float()
    n = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype).view(1, -1)
    return n @ wq.t(), n @ wk.t(), n @ wv.t()


@pytest.mark.parametrize("fn", [_norm_read_twice, _norm_over_another_dim, _norm_without_weight])
def test_what_does_not_match_stays_unfused(fn):
    """The norm read by another op than the GEMMs (CSE makes it one value); a mean over another
    dimension; a norm without a weight: each keeps its values and stays unfused."""
    x, residual, nw = _rows(104, torch.bfloat16, seed=6)
    args = (x, residual, nw, *_weights(104, (40, 16, 8), torch.bfloat16))
    from torch._functorch.compile_utils import fx_graph_cse

    from cgtrees import codegen

    gm = trace(fn, *args)
    gm = torch.fx.GraphModule(gm, fx_graph_cse(gm.graph))
    module = codegen.compile_graph(gm, list(args), context(gm, config(gemm_decisions="rewrite"), "inference", "t"))
    assert "add_rmsnorm_grouped_mm" not in module.source, module.graph.gemm_choices
    for got, w in zip(module.call(list(args)), fn(*args)):
        torch.testing.assert_close(got.float(), w.float(), rtol=2e-2, atol=2e-2 * w.float().abs().max().item())


@pytest.mark.parametrize("rows, whole", [(1, True), (2, False)])
def test_a_slice_in_the_chain_is_one_that_keeps_everything(rows, whole):
    """The LM head reads the last token's norm: of a decode step's one token, all of it."""
    from cgtrees.codegen import rmsnorm_gemms

    gm = trace(lambda h: h[:, -1:].view(1, -1), torch.randn(1, rows, 104))
    (node,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)
    assert rmsnorm_gemms._whole_slice(node) == whole


@pytest.mark.parametrize("mode", ["keep", "measure"])
def test_keep_and_measure_without_a_gpu_stay_unfused(mode):
    x, residual, nw = _rows(104, torch.bfloat16)
    args = (x, residual, nw, *_weights(104, (40, 16, 8), torch.bfloat16))
    module = compile_fn(layer, *args, cfg=config(gemm_decisions=mode))
    assert "add_rmsnorm_grouped_mm" not in module.source.split("\ndef call(")[1]
    assert not any("rmsnorm" in c for c in module.graph.gemm_choices) or mode == "keep", module.graph.gemm_choices


def test_training_graphs_stay_unfused():
    """The op has no backward: a forward graph of training keeps the norm and the grouped GEMMs."""
    from cgtrees import codegen

    x, residual, nw = _rows(104, torch.float32)
    args = (x, residual, nw, *_weights(104, (40, 16, 8), torch.float32))
    gm = trace(layer, *args)
    module = codegen.compile_graph(gm, list(args), context(gm, config(gemm_decisions="rewrite"), "forward", "t"))
    assert "add_rmsnorm_grouped_mm" not in module.source and "grouped_mm" in module.source


def test_tiny_llama_decode_is_fused_and_generates_the_unfused_runs_tokens(tmp_path):
    """A real decode step (transformers' LlamaForCausalLM, bf16, random weights, generate's static
    cache and compile_config): each layer's input norm, with the residual add of layers past the
    first, is one op with q, k and v, its post-attention norm with the residual add one op with the
    MLP's gate and up, and the final norm (through a slice of the last token) one op with the LM
    head; tokens equal the unfused run's (and eager's), logits close."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(3, 160, (1, 7), generator=torch.Generator().manual_seed(1))
    greedy = dict(cache_implementation="static", do_sample=False, max_new_tokens=4, min_new_tokens=4,
                  output_logits=True, return_dict_in_generate=True)

    def generate(decisions: str, debug_dir: str):
        torch._dynamo.reset()
        options = dict(interpret=True, cache=False, gemm_decisions=decisions, debug_dir=debug_dir)
        compile_config = transformers.generation.CompileConfig(fullgraph=True, backend="cgtrees", mode=None,
                                                                  options=options)
        compile_config._compile_all_devices = True  # generate compiles on CPU only with this private flag
        with torch.no_grad():
            return model.generate(ids, compile_config=compile_config, **greedy)

    try:
        fused = generate("rewrite", str(tmp_path / "fused"))
        unfused = generate("keep", str(tmp_path / "unfused"))
    finally:
        torch._dynamo.reset()
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **greedy)
    (source,) = [p.read_text() for p in (tmp_path / "fused").glob("*inference*.py")]
    call = source.split("\ndef call(")[1]
    assert len(re.findall(r"add_rmsnorm_grouped_mm_direct\(", call)) == 3, call  # and the LM head's
    assert len(re.findall(r"add_rmsnorm_grouped_mm_direct\(\w+, None,", call)) == 1  # the first layer: no add
    assert len(re.findall(r"add_rmsnorm_mm_silu_mul_direct\(\w+, \w+,", call)) == 2, call
    assert "add_rmsnorm_grouped_mm" not in "".join(p.read_text() for p in (tmp_path / "unfused").glob("*.py"))
    assert torch.equal(fused.sequences, unfused.sequences) and torch.equal(fused.sequences, eager.sequences)
    for got, want in zip(fused.logits, unfused.logits):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("split_k", [1, 4, "mlp"])
@pytest.mark.parametrize("fused_us, taken", [(4.0, True), (4.95, False), (6.0, False)])
def test_the_fused_form_is_taken_only_where_it_beats_the_unfused_one_by_the_margin(fused_us, taken, split_k):
    """Unfused 5 us: fused 4 us is taken, 4.95 (within gemm_choice.MARGIN) and 6 are not, and the
    header line lists every form's time; every form runs. A ``grouped_mm`` split over K (the unfused
    form then is) matches too; ``mlp``: the gate/up side."""
    from cgtrees.codegen import gate_up_gemms, rmsnorm_gemms, shared_input_gemms

    x, residual, nw = _rows(104, torch.bfloat16)
    if split_k == "mlp":
        wg, wu = _weights(104, (40, 40), torch.bfloat16)
        gm = trace(mlp_layer, x, residual, nw, wg, wu, _weights(40, (104,), torch.bfloat16)[0])
        gm = gate_up_gemms.rewritten(gm, _Rewrite(), "inference")
        op, configs = "add_rmsnorm_mm_silu_mul", rmsnorm_gemms._SILU_CONFIGS
    else:
        gm = trace(layer, x, residual, nw, *_weights(104, (40, 16, 8), torch.bfloat16))
        gm = shared_input_gemms.rewritten(gm, _Rewrite())
        (node,) = [n for n in gm.graph.nodes if str(n.target) == "cgtrees.grouped_mm.default"]
        node.args = (*node.args[:-1], split_k)
        op, configs = "add_rmsnorm_grouped_mm", rmsnorm_gemms._CONFIGS
    (match,) = rmsnorm_gemms._matches(gm.graph)
    plan = TimedPlan({"unfused": 5.0, op: fused_us})
    config = rmsnorm_gemms._choose(match, plan)
    assert (config is not None) == taken
    (note,) = plan.notes
    assert note[2].startswith(op + " ") if taken else note[2] == "unfused"
    assert [name for name, _ in note[3]] == ["unfused", *(f"{op} {b}/{w}" for b, w in configs)]


class _Rewrite:
    """A plan that takes every grouped form (``gemm_decisions=rewrite``)."""

    def other_choice(self):
        return "rewrite", "gemm_decisions=rewrite"

    def note(self, *line, why="timed"):
        pass
