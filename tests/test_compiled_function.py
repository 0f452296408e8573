"""The level-1 value (``cgtrees.compiled_function``): a ``CompiledFunction`` goes through its JSON
record unchanged, the cache's record names a module that level 2 holds by its digest, and a record
that does not parse is a ``BadRecord`` (a corrupt entry), never a guess."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from codegen_helpers import compile_fn, config, trace

from cgtrees.aot import records
from cgtrees.aot.rebuild import load_module
from cgtrees.aot.recorder import part_module
from cgtrees.codegen.module import AtenModule
from cgtrees.compiled import BadRecord, CompiledGraph, GraphFacts
from cgtrees.compiled_function import (
    AtenCode,
    BackwardGraph,
    CompiledFunction,
    CompiledPart,
    Level2Ref,
    Origin,
    RuntimePlan,
    SizeInput,
    TangentFormat,
    TensorSpec,
)
from cgtrees.context import Constants, GraphContext


def _round_trip(function: CompiledFunction, refer_to_level_2: bool = False) -> CompiledFunction:
    return CompiledFunction.from_record(json.loads(json.dumps(function.as_record(refer_to_level_2))))


def _function() -> CompiledFunction:
    x = torch.randn(37, 13)
    graph = compile_fn(lambda t: t.sin() * 2, x).graph
    consts = Constants(("c0",), (torch.arange(9.0).reshape(3, 3).t(),))
    forward = CompiledPart("forward", "g3_forward", graph, (records.input_record(x), SizeInput("s0")),
                           records.constant_records(consts), static_inputs=(0,), saved_from=1, level_2="ab" * 32)
    backward = CompiledPart("backward", "g3_backward", AtenCode("def forward(self, args_list): ...",
                                                                GraphFacts(None, ("aten.mul.Tensor",)), 2),
                            (TensorSpec(("s0", 13), (13, 1), "float32", "cpu"),), mutated_inputs=(0,),
                            runtime_kind="backward")
    formats = (TangentFormat("channels_last"), TangentFormat(None, (3,), (1,)))
    plan = RuntimePlan(num_inputs=2, num_outputs=1, dynamic_dims=((0, (0,)),), bump_versions=(1,),
                       tangent_outputs=(0,), tangent_formats=formats, deterministic=False, dynamic_saved=((0, (0, 1)),))
    bw_graph = BackwardGraph("def forward(self): ...", (TensorSpec((2,), (1,), "int64", "cpu"),), (0,))
    return CompiledFunction(Origin("2.13.0", "3.6.0", "f00d", "cpu"), plan, (forward, backward), detach=(1,),
                            backward_graph=bw_graph, aot_metadata="bWV0YQ==", guards="L['s0'] >= 2")


def test_a_compiled_function_goes_through_its_record_unchanged():
    function = _function()
    loaded = _round_trip(function)
    assert loaded == function
    assert loaded.part("forward").constants[0].data == function.part("forward").constants[0].data
    assert loaded.kinds == {"forward", "backward"} and loaded.part("inference") is None


def test_the_cache_record_names_a_module_level_2_holds_by_its_digest():
    function = _function()
    stored = _round_trip(function, refer_to_level_2=True)
    forward = stored.part("forward")
    assert forward.module == Level2Ref("ab" * 32, function.part("forward").module.facts)
    assert b'"source"' not in json.dumps(function.as_record(True)["parts"][0]).encode()
    assert stored.part("backward") == function.part("backward")  # an aten graph's code has no level-2 entry


@pytest.mark.parametrize("damage", ["no_plan", "bad_kind", "bad_int", "no_facts"])
def test_a_record_that_does_not_parse_is_a_bad_record(damage):
    record = _function().as_record()
    if damage == "no_plan":
        del record["plan"]
    elif damage == "bad_kind":
        record["parts"][0]["kind"] = "sideways"
    elif damage == "bad_int":
        record["plan"]["num_inputs"] = "many"
    else:
        del record["parts"][1]["module"]["facts"]
    with pytest.raises(BadRecord):
        CompiledFunction.from_record(record)


def test_a_part_loads_its_module_back_with_its_constants():
    x = torch.randn(9, 23)
    gm = trace(lambda t: (t.exp(), t * 3), x)
    ctx = GraphContext(config=config(), kind="inference", name="g0_inference")
    for module in (AtenModule(gm), compile_fn(lambda t: (t.exp(), t * 3), x)):
        kept = part_module(gm, module, ctx.config)
        assert isinstance(kept, AtenCode if isinstance(module, AtenModule) else CompiledGraph)
        part = CompiledPart.from_record(json.loads(json.dumps(
            CompiledPart("inference", ctx.name, kept, (records.input_record(x),)).as_record())))
        out = load_module(part, ctx).call([x])
        torch.testing.assert_close(out[0], x.exp())
        torch.testing.assert_close(out[1], x * 3)
    consts = Constants(("c",), (torch.randn(3, 5).t(),))
    loaded = records.load_constants(records.constant_records(consts))
    assert loaded.names == ("c",) and torch.equal(loaded.tensors[0], consts.tensors[0])
    assert loaded.tensors[0].stride() == consts.tensors[0].stride()


def test_runtime_plan_fields_are_typed():
    plan = RuntimePlan(num_inputs=1, num_outputs=1)
    assert RuntimePlan.from_record(json.loads(json.dumps(plan.as_record()))) == plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_inputs = 2  # type: ignore[misc]
