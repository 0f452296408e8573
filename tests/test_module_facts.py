"""The runtime reads the graph behind a kernel module that keeps no ``gm`` (a generated module, a
cached FX module) from its aten listing: its ops for R7, the op behind each output for R1."""

from __future__ import annotations

import torch
from codegen_helpers import compile_fn, trace

from backend.cache.modules import FxModule, fx_code
from backend.runtime import skips


class _Owner:
    def __init__(self, source: str | None = None, code: str | None = None) -> None:
        self.source, self.code = source, code

    def call(self, args):
        return args


def test_generated_module_outputs_and_ops():
    x = torch.randn(4, 8)
    module = compile_fn(lambda t: (t.sin(), t.cos() + 1, t), x)
    assert skips.graph_of(module.call) is None  # a generated module keeps no graph
    listing = skips.listing_of(module.call)
    assert listing is not None
    assert listing.outputs[:2] == ["aten.sin.default", "aten.add.Tensor"], module.source
    assert listing.outputs[2].startswith("input "), listing.outputs
    assert {str(op) for op in listing.ops} >= {"aten.sin.default", "aten.cos.default", "aten.add.Tensor"}
    assert skips.listing_reason(listing) is None


def test_cached_fx_module_outputs():
    x = torch.randn(6)
    gm = trace(lambda t: (t.exp(), t.split(3)[1] * 2), x)
    listing = skips.listing_of(FxModule(fx_code(gm), "g0_inference").call)
    assert listing is not None
    assert listing.outputs == ["aten.exp.default", "aten.mul.Tensor"], fx_code(gm)


def test_uncapturable_op_in_listing_is_a_reason():
    source = "\n".join([
        "import torch", "", "def call(args):", "    return call_aten(args)", "",
        "def call_aten(args):", "    arg0_1, = args", "    args.clear()",
        "    nonzero = aten.nonzero.default(arg0_1)", "    getitem = nonzero[0]",
        "    local = torch.ops.aten._local_scalar_dense.default(arg0_1)",
        "    return (getitem, arg0_1, 2)", "", "def run(*args):", "    return call(list(args))", ""])
    listing = skips.listing_of(_Owner(source=source).call)
    assert listing.outputs == ["aten.nonzero.default", "input arg0_1", "a constant"]
    assert [str(op) for op in listing.ops] == ["aten.nonzero.default", "aten._local_scalar_dense.default"]
    assert skips.listing_reason(listing) == "op aten.nonzero.default cannot be captured in a CUDA graph"


def test_unreadable_listing_is_none():
    assert skips.listing_of(_Owner(source="def call_aten(args):\n    return (").call) is None
    assert skips.listing_of(_Owner(source="def call(args):\n    return args\n").call) is None
    assert skips.listing_of(_Owner().call) is None
    assert skips.listing_of(lambda args: args) is None
    assert skips.listing_reason(None) is None
