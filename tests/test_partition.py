"""Our partitioner saves no more than torch's default partition and stays within 10% of
functorch's min-cut rematerialization, on three models; gradients stay right (test_numerics)."""

import pytest
import torch
from models import GPT2, MLP, NormAct
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

from backend.aot.measure import measure
from backend.aot.partition import partition

CASES = {
    "mlp": lambda: (MLP(), (torch.randn(32, 64, requires_grad=True),)),
    "layernorm_gelu": lambda: (NormAct(), (torch.randn(64, 128, requires_grad=True),)),
    "gpt2_2layer": lambda: (GPT2(layers=2), (torch.randn(2, 16, 64, requires_grad=True),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_bounds(name):
    model, inputs = CASES[name]()
    ours = measure(model, inputs, partition)
    default = measure(model, inputs, default_partition)
    min_cut = measure(model, inputs, min_cut_rematerialization_partition)
    print(f"{name}: ours {ours} B, default {default} B, min-cut {min_cut} B")
    assert ours > 0
    assert ours <= default
    assert ours <= 1.10 * min_cut


def test_never_recomputes_matmul_or_random():
    from backend.aot.cost import is_recomputable

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    for op, recompute in [(aten.mm.default, False), (aten.convolution.default, False),
                          (aten.rand.default, False), (aten.native_dropout.default, False),
                          (aten.mul.Tensor, True), (aten.sum.dim_IntList, True), (aten.view.default, True)]:
        node = graph.call_function(op, (a, a))
        assert is_recomputable(node) is recompute, op


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
