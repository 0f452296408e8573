"""Every compiled module's ``graph`` carries ``GraphFacts`` found in its aten graph at compile time
(R7's uncapturable op, R1's op behind each output): generated, aten and cached modules alike, and a
level-1 record keeps them, so the runtime never reads a module's source to learn them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from codegen_helpers import compile_fn, config, trace

from cgtrees import codegen
from cgtrees.aot import fx_code as fx_code_module
from cgtrees.aot.fx_code import fx_code
from cgtrees.aot.rebuild import load_module
from cgtrees.aot.recorder import part_module
from cgtrees.codegen.module import AtenModule
from cgtrees.compiled import AtenGraph, BadRecord, GraphFacts
from cgtrees.compiled_function import CompiledPart
from cgtrees.context import GraphContext
from cgtrees.runtime import skips
from cgtrees.runtime.examples import Examples


def test_generated_module_has_facts():
    x = torch.randn(4, 8)
    module = compile_fn(lambda t: (t.sin(), t.cos() + 1, t), x)
    facts = module.graph.facts
    assert facts.output_ops[:2] == ("aten.sin.default", "aten.add.Tensor"), facts
    assert facts.output_ops[2].startswith("input "), facts
    assert facts.output_op(7) == "an unknown op"


def test_uncapturable_op_is_a_reason_to_skip():
    x = torch.randn(6)
    gm = trace(lambda t: (t.nonzero(), t * 2), x)
    facts = GraphFacts.of(gm)
    assert facts.uncapturable is not None and "nonzero" in facts.uncapturable
    assert AtenModule(gm).graph.facts == facts
    ctx = GraphContext(config=config(), kind="inference", name="g0_inference")
    meta = torch.empty(6, device="meta")  # no CPU input: only the facts can give a reason
    reason, _ = skips.reason_to_skip(Examples.of([meta]), ctx, facts)
    assert reason == "inputs on meta"  # the device check comes first
    assert skips.reason_to_skip(Examples.of([meta]), ctx, GraphFacts())[0] == "inputs on meta"


def test_level1_records_keep_facts_for_both_formats():
    x = torch.randn(6)
    gm = trace(lambda t: (t.exp(), t.split(3)[1] * 2), x)
    ctx = GraphContext(config=config(), kind="inference", name="g0_inference")
    for module in (AtenModule(gm), codegen.compile_graph(gm, [x], ctx)):
        record = CompiledPart("inference", ctx.name, part_module(gm, module, ctx.config), ()).as_record()
        loaded = load_module(CompiledPart.from_record(record), ctx)
        assert loaded.graph.facts == GraphFacts.of(gm)
        assert loaded.graph.facts.output_ops == ("aten.exp.default", "aten.mul.Tensor")
        torch.testing.assert_close(loaded.call([x]), gm(x))
    record = CompiledPart("inference", ctx.name, part_module(gm, AtenModule(gm), ctx.config), ()).as_record()
    del record["module"]["facts"]  # a damaged record is a bad entry (the cache counts it corrupt), never a guess
    with pytest.raises(BadRecord):
        CompiledPart.from_record(record)


def test_aten_module_frees_inputs_at_last_use():
    """Boxed: the list is cleared and each input dies at its last use, not when the graph returns
    (a backward would otherwise hold all its saved activations to the end)."""
    a = torch.randn(1000)
    ref = weakref.ref(a)
    seen = []

    def probe(b):
        gc.collect()
        seen.append(ref() is None)
        return b.exp()

    graph = torch.fx.Graph()
    pa, pb = graph.placeholder("a"), graph.placeholder("b")
    sin = graph.call_function(torch.ops.aten.sin.default, (pa,))
    graph.output((sin, graph.call_function(probe, (pb,))))
    module = AtenModule(torch.fx.GraphModule(torch.nn.Module(), graph))
    args = [a, torch.randn(10)]
    del a
    out = module.call(args)
    assert args == [] and seen == [True]  # ``a`` was gone when ``probe`` ran
    assert out[0].shape == (1000,)


def test_cached_fx_module_is_boxed():
    gm = trace(lambda a, b: a.sin() + b, torch.randn(4), torch.randn(4))
    code = fx_code(gm)
    assert "args_list.clear()" in code, code
    x, y = torch.randn(4), torch.randn(4)
    args = [x, y]
    torch.testing.assert_close(fx_code_module.load(code, "g0", AtenGraph(GraphFacts.of(gm), 1)).call(args), x.sin() + y)
    assert args == []
