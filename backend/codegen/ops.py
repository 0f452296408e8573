"""The pointwise op table: one entry per operation a kernel body may apply.

Each entry gives the Triton text for compiled kernels and, where it differs, for Triton's
interpreter (which has no libdevice): ``None`` there means the op is not lowered in interpreter
mode and runs through aten instead. ``{0}``, ``{1}``... are the rendered arguments.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpDef:
    gpu: str
    interp: str | None = "same"

    def template(self, interpret: bool) -> str | None:
        if not interpret or self.interp == "same":
            return self.gpu
        return self.interp


_LD = "libdevice"
_TANH_POLY = ("{0} * (1.0 + {0} * {0} * (-0.3333333333333333 + {0} * {0} * (0.13333333333333333"
              " + {0} * {0} * (-0.05396825396825397 + {0} * {0} * 0.021869488536155203))))")
_TANH_EXP = "(1.0 - tl.exp(-2.0 * tl.abs({0}))) / (1.0 + tl.exp(-2.0 * tl.abs({0})))"
_INTERP_LOG1P = "tl.where(1.0 + {0} == 1.0, {0}, tl.log(1.0 + {0}) * {0} / ((1.0 + {0}) - 1.0))"
_INTERP_EXPM1 = ("tl.where(tl.exp({0}) == 1.0, {0}, tl.where(tl.exp({0}) - 1.0 == -1.0, -1.0,"
                 " (tl.exp({0}) - 1.0) * {0} / tl.log(tl.exp({0}))))")
_INTERP_TANH = f"tl.where(tl.abs({{0}}) < 0.1, {_TANH_POLY}, tl.where({{0}} < 0, -1.0, 1.0) * {_TANH_EXP})"

OPS: dict[str, OpDef] = {
    # arithmetic
    "add": OpDef("{0} + {1}"),
    "sub": OpDef("{0} - {1}"),
    "mul": OpDef("{0} * {1}"),
    "truediv": OpDef("{0} / {1}"),
    "neg": OpDef("-{0}"),
    "abs": OpDef("tl.abs({0})"),
    "reciprocal": OpDef("1.0 / {0}"),
    "fmax": OpDef("tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"),
    "fmin": OpDef("tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"),
    "imax": OpDef("tl.maximum({0}, {1})"),
    "imin": OpDef("tl.minimum({0}, {1})"),
    # C division and remainder truncate toward zero; torch floors, so correct the sign cases
    "ifloordiv": OpDef("({0} // {1}) - ((({0} % {1}) != 0) & (({0} < 0) != ({1} < 0))).to({0}.dtype)"),
    "iremainder": OpDef("({0} % {1}) + {1} * ((({0} % {1}) != 0) & ((({0} % {1}) < 0) != ({1} < 0)))"),
    "ifmod": OpDef("{0} % {1}"),
    "itruncdiv": OpDef("{0} // {1}"),
    "ffloordiv": OpDef("tl.floor({0} / {1})"),
    "fremainder": OpDef("{0} - tl.floor({0} / {1}) * {1}"),
    "ffmod": OpDef(f"{_LD}.fmod({{0}}, {{1}})", None),
    "pow": OpDef(f"{_LD}.pow({{0}}, {{1}})", None),
    "square": OpDef("{0} * {0}"),
    "cube": OpDef("{0} * {0} * {0}"),
    "atan2": OpDef(f"{_LD}.atan2({{0}}, {{1}})", None),
    # comparisons and logic (bool results)
    "eq": OpDef("{0} == {1}"),
    "ne": OpDef("{0} != {1}"),
    "lt": OpDef("{0} < {1}"),
    "le": OpDef("{0} <= {1}"),
    "gt": OpDef("{0} > {1}"),
    "ge": OpDef("{0} >= {1}"),
    "and": OpDef("{0} & {1}"),
    "or": OpDef("{0} | {1}"),
    "xor": OpDef("{0} ^ {1}"),
    "invert": OpDef("~{0}"),
    "not": OpDef("{0} == 0"),
    "lshift": OpDef("{0} << {1}"),
    "rshift": OpDef("{0} >> {1}"),
    "where": OpDef("tl.where({0}, {1}, {2})"),
    "isnan": OpDef("{0} != {0}"),
    "isinf": OpDef("tl.abs({0}) == float('inf')"),
    # unary math (float32 or float64 arguments)
    "exp": OpDef("tl.exp({0})"),
    "exp2": OpDef("tl.exp2({0})"),
    "log": OpDef("tl.log({0})"),
    "log2": OpDef("tl.log2({0})"),
    "log10": OpDef(f"{_LD}.log10({{0}})", "tl.log({0}) * 0.4342944819032518"),
    "sqrt": OpDef("tl.sqrt({0})"),
    "rsqrt": OpDef("tl.rsqrt({0})"),
    "sin": OpDef("tl.sin({0})"),
    "cos": OpDef("tl.cos({0})"),
    "tan": OpDef(f"{_LD}.tan({{0}})", "tl.sin({0}) / tl.cos({0})"),
    # interpreter: an odd polynomial near 0, where 2 * sigmoid(2x) - 1 cancels (11% off at 0.001:
    # Gemma-2's soft-capping, tanh(s / 50) * 50), else (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.82
    "tanh": OpDef(f"{_LD}.tanh({{0}})", _INTERP_TANH),
    "sigmoid": OpDef("tl.sigmoid({0})"),
    "erf": OpDef("tl.erf({0})"),
    # interpreter: Goldberg's and Kahan's corrections, exact to a few roundings near 0, where
    # log(1 + x) and exp(x) - 1 lose every digit that 1 + x and exp(x) round away
    "log1p": OpDef(f"{_LD}.log1p({{0}})", _INTERP_LOG1P),
    "expm1": OpDef(f"{_LD}.expm1({{0}})", _INTERP_EXPM1),
    "floor": OpDef("tl.floor({0})"),
    "ceil": OpDef("tl.ceil({0})"),
    "trunc": OpDef(f"{_LD}.trunc({{0}})", "tl.where({0} < 0, tl.ceil({0}), tl.floor({0}))"),
    "round": OpDef(f"{_LD}.nearbyint({{0}})", None),
    "sign": OpDef("({0} > 0).to({0}.dtype) - ({0} < 0).to({0}.dtype)"),
    "asin": OpDef(f"{_LD}.asin({{0}})", None),
    "acos": OpDef(f"{_LD}.acos({{0}})", None),
    "atan": OpDef(f"{_LD}.atan({{0}})", None),
    "sinh": OpDef(f"{_LD}.sinh({{0}})", None),
    "cosh": OpDef(f"{_LD}.cosh({{0}})", None),
    "asinh": OpDef(f"{_LD}.asinh({{0}})", None),
    "acosh": OpDef(f"{_LD}.acosh({{0}})", None),
    "atanh": OpDef(f"{_LD}.atanh({{0}})", None),
    # a float64 constant (a bare literal is a float32 one)
    "fp64_const": OpDef("tl.full([], {0}, tl.float64)"),
    # float32 -> bfloat16, rounded to nearest even (the interpreter's own cast truncates): the bits
    # plus 0x7FFF plus the lowest kept bit, then the top half (c10's round_to_nearest_even)
    "to_bf16": OpDef("{0}.to(tl.bfloat16)",
                     "((({0}.to(tl.uint32, bitcast=True) + 0x7FFF + (({0}.to(tl.uint32, bitcast=True) >> 16) & 1))"
                     " >> 16).to(tl.uint16)).to(tl.bfloat16, bitcast=True)"),
    # casts: ``to_<dtype>``, rendered by the kernel printer (bool is ``!= 0``)
    "cast": OpDef("{0}.to({dtype})"),
}


def template(name: str, interpret: bool) -> str | None:
    op = OPS.get(name)
    return None if op is None else op.template(interpret)


def uses_libdevice(text: str) -> bool:
    return f"{_LD}." in text
