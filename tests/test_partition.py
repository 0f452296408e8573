"""Our partitioner saves no more for the backward than torch's default partition and functorch's
min-cut rematerialization, on transformer, MLP and conv-net graphs, and its partition gives
eager's outputs and gradients. All three partition the same joint graph in one trace."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET
from conv_models import BasicBlock, ConvBNReLU, ConvNeXtBlock, MobileBlock
from models import GPT2, MLP, NormAct
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from cgtrees.aot import compat
from cgtrees.aot.decompositions import decomposition_table
from cgtrees.aot.measure import measure, saved_activation_bytes
from cgtrees.aot.partition import partition

CASES = {
    "mlp": lambda: (MLP(), torch.randn(32, 64)),
    "layernorm_gelu": lambda: (NormAct(), torch.randn(64, 128)),
    "gpt2_2layer": lambda: (GPT2(layers=2), torch.randn(2, 16, 64)),
    "conv_bn_relu": lambda: (ConvBNReLU(), torch.randn(2, 3, 16, 16)),
    "resnet_basic_block": lambda: (BasicBlock(), torch.randn(2, 8, 16, 16)),
    "mobilenet_block": lambda: (MobileBlock(), torch.randn(2, 8, 16, 16)),
    "convnext_block": lambda: (ConvNeXtBlock(), torch.randn(2, 16, 8, 8)),
}
THEIRS = {"default": default_partition, "min_cut": min_cut_rematerialization_partition}


def partition_and_check(model: torch.nn.Module, x: torch.Tensor, decompositions: dict) -> dict[str, int]:
    """Trace ``model`` once; partition the joint graph with ours and torch's two; run ours and
    check outputs and gradients against eager. Returns the saved bytes of each partitioner."""
    eager = copy.deepcopy(model)
    saved = dict.fromkeys(["ours", *THEIRS], 0)

    def spy(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        kw.update(num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static_lifetime_input_indices)
        static = static_lifetime_input_indices or []
        for name, theirs in THEIRS.items():  # on a copy: a partitioner may edit the joint graph
            with warnings.catch_warnings():  # torch's pytree, copying the graph's output spec
                warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                        category=FutureWarning)
                joint_copy = copy.deepcopy(joint)
            fw, _ = theirs(joint_copy, joint_inputs, **kw)
            saved[name] += saved_activation_bytes(fw, num_fwd_outputs, static)
        fw, bw = partition(joint, joint_inputs, **kw)
        saved["ours"] += saved_activation_bytes(fw, num_fwd_outputs, static)
        return fw, bw

    def nop(gm, _):
        return compat.make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return compat.aot_module_simplified(gm, example_inputs, fw_compiler=nop, bw_compiler=nop,
                                            partition_fn=spy, decompositions=decompositions)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x_ours, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = compiled(x_ours), eager(x_eager)
    cotangent = torch.randn_like(out)
    out.backward(cotangent)
    expected.backward(cotangent)
    _assert_close(out, expected, "output")
    _assert_close(x_ours.grad, x_eager.grad, "grad of the input")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        _assert_close(p.grad, q.grad, f"grad of {name}")
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):  # batch norm's running statistics
        _assert_close(b, c, f"buffer {name}")
    return saved


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """float32, atol scaled to the largest value: batch norm's decomposition sums in another order
    than eager's kernel (every partitioner's gradients differ from eager's alike)."""
    atol = 1e-5 * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_bounds(name):
    model, x = CASES[name]()
    saved = partition_and_check(model, x, decomposition_table())
    print(f"{name}: ours {saved['ours']} B, default {saved['default']} B, min-cut {saved['min_cut']} B")
    assert 0 < saved["ours"] <= saved["default"]
    assert saved["ours"] <= saved["min_cut"]


def test_saved_bytes_bounds_whole_batch_norm():
    """Without decompositions batch norm stays one op (its outputs and statistics must be saved,
    and the ReLU's mask is read through detach): still no more than min-cut."""
    saved = partition_and_check(ConvBNReLU(), torch.randn(2, 3, 16, 16), {})
    print(f"whole batch norm: ours {saved['ours']} B, min-cut {saved['min_cut']} B")
    assert saved["ours"] <= saved["min_cut"]


def test_never_recomputes_matmul_or_random():
    from cgtrees.aot.cost import is_recomputable

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    for op, recompute in [(aten.mm.default, False), (aten.convolution.default, False),
                          (aten.rand.default, False), (aten.native_dropout.default, False),
                          (aten.mul.Tensor, True), (aten.view.default, True), (aten.detach.default, True)]:
        node = graph.call_function(op, (a, a))
        assert is_recomputable(node) is recompute, op


@pytest.mark.parametrize("op, dims, recompute", [
    (torch.ops.aten.var_mean.correction, [3], True),  # layer norm's statistics: a row reduction
    (torch.ops.aten.amax.default, [-1], True),  # softmax's max
    (torch.ops.aten.var_mean.correction, [0, 2, 3], False),  # batch norm's: over N, H, W
    (torch.ops.aten.sum.dim_IntList, [0], False),  # a bias gradient's kind of sum
    (torch.ops.aten.sum.default, None, False),  # everything: 2**18 elements, past ROW_LIMIT
    (torch.ops.aten.mean.dim, [2, 3], True),  # global average pooling: 256 per output
])
def test_recomputes_only_row_reductions(op, dims, recompute):
    from cgtrees.aot.cost import is_recomputable

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(64, 16, 16, 16)
    node = graph.call_function(op, (x,) if dims is None else (x, dims))
    assert is_recomputable(node) is recompute


def test_backward_recomputes_pointwise():
    """On the LayerNorm/GELU block, the backward recomputes the cheap chain instead of saving it."""
    saved_names = []

    def spy(joint, joint_inputs, **kw):
        fw, bw = partition(joint, joint_inputs, **kw)
        saved_names.extend(n.name for n in bw.graph.find_nodes(op="placeholder"))
        assert any(n.op == "call_function" and "erf" in str(n.target) for n in bw.graph.nodes)
        return fw, bw

    measure(NormAct(), (torch.randn(64, 128, requires_grad=True),), spy)
    assert saved_names


def _partitioned(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """Our partition of ``model``'s training graph: forward, backward, the forward's output count."""
    got: list = []

    def spy(joint, joint_inputs, *, num_fwd_outputs, **kw):
        fw, bw = partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        got.append((fw, bw, num_fwd_outputs))
        return fw, bw

    from cgtrees.aot.measure import run_partitioned

    run_partitioned(model, (x.requires_grad_(),), spy)
    return got[0]


class SinThenLinear(torch.nn.Module):
    """sin's backward reads x, from which the product's operand sin(x) could be recomputed for
    free in saved bytes: the smallest case of a LayerNorm's output and its input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.sin(x))


@pytest.mark.parametrize("name", ["sin_then_linear", *CASES])
def test_what_a_backward_library_call_reads_is_saved_not_recomputed(name):
    """A matmul or convolution of the backward reads its operands whole from memory: recomputing
    one (a LayerNorm's or an activation's output) would write it again there. Each operand, seen
    through views, is a saved value or a gradient."""
    from cgtrees.aot.cost import is_view, reads_from_memory

    case = (lambda: (SinThenLinear(), torch.randn(8, 32))) if name == "sin_then_linear" else CASES[name]
    _, bw, _ = _partitioned(*case())
    gradients = {n for n in bw.graph.nodes if compat.is_tangent(n)}
    for node in bw.graph.nodes:
        if any(a in gradients for a in node.all_input_nodes):
            gradients.add(node)
    calls = [n for n in bw.graph.nodes if reads_from_memory(n)]
    assert calls or name == "layernorm_gelu"
    for call in calls:
        for value in reads_from_memory(call):
            assert is_view(value) or value.op == "placeholder" or value in gradients, (call.name, value.name)


def test_a_tie_goes_to_the_value_a_library_call_wrote():
    """GELU's backward reads either its input or its derivative, the same bytes. The input is what
    fc1's GEMM writes anyway; the derivative would be one more write in the forward."""
    class GeluMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    fw, _, outputs = _partitioned(GeluMLP(), torch.randn(4, 8, 32))
    saved = list(fw.graph.find_nodes(op="output"))[0].args[0][outputs:]
    bases = {(n.args[0] if n.target == torch.ops.aten.view.default else n).target for n in saved}
    assert torch.ops.aten.addmm.default in bases, [n.format_node() for n in saved]
    # the derivative, x * exp(-x*x/2) / sqrt(2*pi) + ..., is not computed in the forward
    assert not fw.graph.find_nodes(op="call_function", target=torch.ops.aten.exp.default), fw.code


class _PreNorm(torch.nn.Module):
    """A pre-norm residual block: ``h + fc(norm(h))``; under autocast ``fc``'s output is bf16, the
    residual stream float32."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc(self.norm(h))


def _autocast_step_against_eager(model: torch.nn.Module, x: torch.Tensor) -> tuple:
    """One bf16-autocast training step of ``model`` compiled with our partition and codegen, and one of
    an eager copy from the same weights: the compiler (its modules checked) and, per step, the output
    and the parameters' gradients."""
    from codegen_helpers import Compiler

    eager, comp = copy.deepcopy(model), Compiler()
    compiled = torch.compile(model, backend=comp.with_our_partition, fullgraph=True)
    outs = []
    for fn, module in ((compiled, model), (eager, eager)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        out.float().pow(2).mean().backward()
        outs.append((out.detach(), [p.grad for p in module.parameters()]))
    comp.check()
    return comp, outs


@pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")
def test_the_backward_does_not_rebuild_a_residual_stream_from_its_increments():
    """Six pre-norm blocks under bf16 autocast. The increments (bf16) are half the residual sums'
    bytes (float32), so a plain min cut saves them and has the backward add them up again: its
    first kernel (the last block's norm backward) writes every block's partial sum, which the
    forward had written already. The cut pins the sums (``partition._spread_in_backward``): the
    backward rebuilds no chain of them, and the gradients are eager's."""
    import re

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(_PreNorm() for _ in range(6)))
    comp, outs = _autocast_step_against_eager(blocks, torch.randn(3, 11, 24))
    backward = comp.modules[1].source
    # The last block's sum may be recomputed from the one before it (both read in one kernel);
    # a chain of them would be the stream rebuilt (five sums without the pin).
    rebuilt = re.findall(r"#   (add_\d+) = aten\.add\.Tensor\(add_\d+, view_\d+\)", backward)
    assert len(rebuilt) <= 1, backward
    (out, grads), (want, want_grads) = outs
    torch.testing.assert_close(out, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * max(1.0, w.abs().max().item()))


@pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")
def test_a_convolutions_float32_copy_for_batch_norm_is_not_saved():
    """Under bf16 autocast, batch norm reads a convolution's output cast to float32, and only its
    statistics' reduction reads that cast in the forward: the reduction reads the bf16 output and
    casts it in its own kernel, so the cast is in no buffer there (``partition._written_anyway``
    takes a kernel-splitting node's reads before the boundary it makes). The backward recomputes
    the cast from the saved bf16 output: ResNet-50 wrote and saved a float32 copy of every
    convolution's output (a 76 us kernel a copy at 64 x 256 x 56 x 56 on an H200)."""
    import re

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                                torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1, bias=False),
                                torch.nn.BatchNorm2d(16), torch.nn.ReLU()).to(memory_format=torch.channels_last)
    comp, outs = _autocast_step_against_eager(block, torch.randn(4, 8, 12, 12).to(memory_format=torch.channels_last))
    forward = comp.modules[0].source.split("\ndef call(")[1]
    full = re.findall(r"torch\.empty_strided\(\(4, 16, 12, 12\), [^)]*\), dtype=torch\.(\w+)", forward)
    assert "float32" not in full, forward
    (out, grads), (want, want_grads) = outs
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * max(1.0, w.abs().max().item()))
