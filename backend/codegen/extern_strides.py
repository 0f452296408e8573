"""The strides of what an aten call returns: which results the kernel module trusts to have their
traced strides, and the check ``call`` makes on the others.

A kernel reads a buffer with the strides traced in FX meta (``meta["val"]``), and the caller gets
an output with the strides the graph was traced with. An aten call (an ``ir.Extern``) need not
return those: its meta function and the kernel that runs may disagree, because the library picks
its kernel, and with it the result's layout, at run time. Seen on the H100: cuDNN's
``convolution_backward`` of a channels-last graph returned a gradient NCHW-contiguous where meta
said channels-last (or the reverse; strides of size-1 dimensions differ too), and the kernels that
read it computed wrong input gradients. Inductor asserts its fallback kernels' strides
(``assert_size_stride``); we put the value in the traced strides instead (``with_traced_strides``,
written once into the module's prelude):

- the strides match (the usual case): the tensor as it is, after one tuple comparison;
- only strides of size-1 dimensions differ: a view with the traced strides (same memory);
- else a copy into a buffer of the traced strides, logged once per value at DEBUG.

Each tensor result of an aten call is checked unless the op is ``trusted``: its result's strides
are the same on every backend as in its meta function, by construction. That is an allow-list,
not a guess, and short on purpose (a check costs a call and a tuple comparison in ``call``, which
under CUDA graphs runs at record time only):

- views (a schema whose result aliases an argument): their strides follow their input's by the
  same view arithmetic in meta and kernel (and a copy would break the aliasing);
- ``TRUSTED``: structured ops whose output is a fresh contiguous tensor whose strides their shared
  meta function sets (the matrix products), and factories of fresh contiguous tensors.

Everything else is checked: convolution and its backward (cuDNN, oneDNN/mkldnn, MIOpen choose the
layout at run time), attention (its backends lay their outputs out differently), the cudnn and
mkldnn ops, custom ops (their fake and their kernel are written apart), every op we have no
lowering for.
"""

from __future__ import annotations

import torch

TRUSTED = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",  # a fresh contiguous product
    "cgtrees::grouped_mm",  # fresh contiguous products (codegen/grouped_gemv.py)
    "cgtrees::mm_silu_mul",  # a fresh contiguous product (codegen/gemv_silu_mul.py)
    "cgtrees::add_rmsnorm_grouped_mm",  # fresh contiguous products and row (codegen/gemv_add_rmsnorm.py)
    "cgtrees::add_rmsnorm_mm_silu_mul",  # a fresh contiguous product and row (codegen/gemv_add_rmsnorm.py)
    "cgtrees::decode_attention",  # a fresh output with the traced call's strides (codegen/decode_attention.py)
    "aten::rand", "aten::randn", "aten::randint", "aten::randperm",  # fresh contiguous factories
})

NAME = "with_traced_strides"

HELPER = f'''\
_RESTRIDED = set()  # values that came back from aten with other strides than traced (logged once)


def {NAME}(t, stride, name):
    """``t``, an aten call's result, with the strides it was traced with, which the code below
    reads it with (backend/codegen/extern_strides.py): itself where aten returned them."""
    if t.stride() == stride:
        return t
    same_memory = all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), stride))
    if name not in _RESTRIDED:
        _RESTRIDED.add(name)
        logging.getLogger("cgtrees.codegen").debug(
            "cgtrees kernel module %s: %s came back from aten with strides %s, traced %s: %s", __file__, name,
            t.stride(), stride, "viewed with the traced strides" if same_memory else "copied into the traced strides")
    if same_memory:
        return t.as_strided(t.shape, stride)
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
'''


def trusted(target: torch._ops.OpOverload) -> bool:
    """Whether ``target``'s tensor results always have the strides its meta function gives."""
    schema = target._schema
    if any(r.alias_info is not None for r in schema.returns):
        return True  # a view: its strides follow its input's
    return schema.name in TRUSTED


def check_line(name: str, stride_text: str) -> str:
    """The line of ``call`` that gives buffer ``name`` its traced strides (``stride_text``, a tuple)."""
    return f"    {name} = {NAME}({name}, {stride_text}, {name!r})"
