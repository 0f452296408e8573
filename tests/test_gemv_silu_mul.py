"""A Llama MLP's ``silu(x @ w_gate.t()) * (x @ w_up.t())`` as one ``cgtrees.mm_silu_mul`` launch
(``backend/codegen/gate_up_gemms.py``, ``gemv_silu_mul.py``) on CPU, through Triton's interpreter:
the op against eager (irregular K and N, one row and a few, float32 and 16-bit; exactly eager's
where the sums are exact, so every rounding of eager's chain is checked); ``gemm_decisions=rewrite``
takes the fused form the GPU would time; what does not match stays unfused. Timing needs a GPU
(``tests/gpu/test_gemv_silu_mul_gpu.py``)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, compile_fn, config, context, trace

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: a few ulps of the largest value (the sums' order differs from eager's mm); 16-bit: two
    roundings of each value (a product one ulp apart from eager's may round the SiLU the other way)."""
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().max().item()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=8 * eps * scale)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps * scale)


def eager(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ wg.t()) * (x @ wu.t())


def mlp(h, w_gate, w_up, w_down):
    """Llama's MLP on a decode step's rows."""
    x = h.view(-1, h.shape[-1])
    return (F.silu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()


def _operands(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    return x, *((torch.randn(n, k, generator=g) / k ** 0.5).to(dtype) for _ in range(2))


@pytest.fixture(autouse=True)
def _interpreter():
    from cgtrees.codegen import gemv_silu_mul, interp  # noqa: F401 - registers the op

    interp.enable()  # as codegen does before it loads a module that calls the op (on a CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("k", [111, 96])
def test_the_op_is_eager_silu_mul(k, rows, dtype):
    """K = 3 x 37 (the last block partly past K) or whole blocks; N = 45, not a multiple of any block."""
    x, wg, wu = _operands(rows, k, 45, dtype)
    want = eager(x, wg, wu)
    for form in ((4, 32, 2), (1, 64, 4), (16, 16, 1)):
        got = torch.ops.cgtrees.mm_silu_mul(x, wg, wu, *form)
        assert got.shape == (rows, 45) and got.dtype == dtype
        _close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
def test_rounds_where_eager_rounds(rows, dtype):
    """Small integers: every sum is exact, so the gate and up products are eager's exactly, and the
    result equals eager's bit for bit only if the SiLU is computed in float32 from the rounded gate,
    rounded to 16 bits, and multiplied by the rounded up product with one rounding."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (rows, 37), generator=g).to(dtype)
    wg, wu = (torch.randint(-3, 4, (53, 37), generator=g).to(dtype) for _ in range(2))
    want = eager(x, wg, wu)
    gate, up = (x.float() @ wg.float().t()), (x.float() @ wu.float().t())
    unrounded = (F.silu(gate) * up).to(dtype)  # one rounding at the end: not eager's
    assert (unrounded != want).any()
    for form in ((4, 16, 2), (1, 64, 1)):
        assert torch.equal(torch.ops.cgtrees.mm_silu_mul(x, wg, wu, *form), want)


def test_the_unfused_forms_pointwise_kernel_is_eager_silu_mul():
    from cgtrees.codegen import gemv_silu_mul

    gate, up = (torch.randn(3, 1100, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (4, 5))
    out = torch.full_like(gate, float("nan"))
    gemv_silu_mul.launch_silu_mul(gate, up, out)
    assert torch.equal(out, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
def test_rewrite_runs_gate_up_and_silu_mul_in_one_launch_with_eager_values(rows, dtype):
    """The MLP's gate, up and SiLU-and-multiply are one ``mm_silu_mul`` call: no pointwise kernel of
    a sigmoid, the down projection reads its result."""
    x, wg, wu = _operands(rows, 40, 120, dtype)
    wd = (torch.randn(24, 120, generator=torch.Generator().manual_seed(9)) / 11).to(dtype)
    args = (x.view(1, rows, 40), wg, wu, wd)
    module = compile_fn(mlp, *args, cfg=config(gemm_decisions="rewrite"))
    name = str(dtype).removeprefix("torch.")
    form = {1: "1x2048/4"}.get(rows, "16x256/2" if dtype != torch.float32 else "4x512/2")
    assert re.fullmatch(rf"mm/mm_1/mul(_\d+)?: silu\(mm\) \* mm \[{rows}, 40\] x gate, up \[120, 40\] {name}: "
                        rf"mm_silu_mul {form} \(gemm_decisions=rewrite\)", module.graph.gemm_choices[0]), \
        module.graph.gemm_choices
    call = module.source.split("\ndef call(")[1]
    assert len(re.findall(r"gemv_silu_mul\.mm_silu_mul_direct\(", call)) == 1, call
    assert "sigmoid" not in module.source and "aten.mm" not in call, call
    assert "import cgtrees.codegen.gemv_silu_mul" in module.source
    (got,) = module.call(list(args))
    want = mlp(*args)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=8 * eps * want.float().abs().max().item())


def test_hugging_face_llama_mlp_is_fused():
    """transformers' LlamaMLP (bf16: its silu decomposes to float32 casts around x * sigmoid(x))."""
    transformers = pytest.importorskip("transformers")
    from torch._functorch.compile_utils import fx_graph_cse
    from torch.func import functional_call

    from cgtrees import codegen

    cfg = transformers.LlamaConfig(hidden_size=40, intermediate_size=120, num_attention_heads=4, num_key_value_heads=2)
    block = transformers.models.llama.modeling_llama.LlamaMLP(cfg).to(torch.bfloat16).eval()
    params = dict(block.named_parameters())
    h = torch.randn(1, 1, 40, generator=torch.Generator().manual_seed(6)).bfloat16()

    def fn(h, *weights):
        return functional_call(block, dict(zip(params, weights)), (h,))

    args = (h, *params.values())
    with torch.no_grad():
        gm = trace(fn, *args)
        gm = torch.fx.GraphModule(gm, fx_graph_cse(gm.graph))  # one view of h, as AOTAutograd's CSE leaves it
        module = codegen.compile_graph(gm, list(args), context(gm, config(gemm_decisions="rewrite"), "inference", "t"))
        want = fn(*args)
    assert "mm_silu_mul 1x2048/4" in module.graph.gemm_choices[0], module.graph.gemm_choices
    assert "sigmoid" not in module.source
    (got,) = module.call(list(args))
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=8 * 2 ** -7 * want.float().abs().max().item())


@pytest.mark.parametrize("mode", ["keep", "measure"])
def test_keep_and_measure_without_a_gpu_stay_unfused(mode):
    args = (*_operands(1, 40, 120, torch.bfloat16), torch.randn(24, 120).bfloat16())
    module = compile_fn(mlp, *args, cfg=config(gemm_decisions=mode))
    assert "mm_silu_mul" not in module.source.split("\ndef call(")[1]
    why = "gemm_decisions=keep" if mode == "keep" else "no GPU to time on (cpu)"
    assert module.graph.gemm_choices[0].endswith(f"unfused ({why})"), module.graph.gemm_choices


def _gate_read_twice(x, wg, wu):
    gate = x @ wg.t()
    return F.silu(gate) * (x @ wu.t()), gate


def _two_inputs(x, wg, wu):
    return F.silu(x @ wg.t()) * ((x * 2) @ wu.t())


def _silu_rounded_in_16_bits(x, wg, wu):
    gate = x @ wg.t()
    return gate * torch.sigmoid(gate) * (x @ wu.t())


@pytest.mark.parametrize("fn", [_gate_read_twice, _two_inputs, _silu_rounded_in_16_bits])
def test_what_does_not_match_stays_unfused(fn):
    """A gate product read elsewhere; gate and up of different inputs; a SiLU whose sigmoid is
    rounded to bf16 (not eager's ``silu``): each keeps its values and stays unfused."""
    args = _operands(1, 40, 120, torch.bfloat16)
    module = compile_fn(fn, *args, cfg=config(gemm_decisions="rewrite"))
    assert "mm_silu_mul" not in module.source, module.graph.gemm_choices
    want = fn(*args)
    for got, w in zip(module.call(list(args)), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(got.float(), w.float(), rtol=2e-2, atol=2e-2 * w.float().abs().max().item())


def test_training_graphs_stay_unfused():
    """The op has no backward: a forward graph of training keeps the traced chain."""
    from cgtrees import codegen

    args = (*_operands(1, 40, 120, torch.float32), torch.randn(24, 120))
    gm = trace(mlp, *args)
    module = codegen.compile_graph(gm, list(args), context(gm, config(gemm_decisions="rewrite"), "forward", "t"))
    assert "mm_silu_mul" not in module.source and "grouped_mm" in module.source
