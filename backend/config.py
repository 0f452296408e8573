"""The one typed, frozen configuration object, and the one function that reads the environment.

Precedence for every field: ``options=`` > ``mode=`` > ``CGTREES_<NAME>`` env var > default.
Each field declares whether it changes generated code (``affects_codegen``): the cache key takes
exactly those fields, and a test fails when a field does not declare it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {"cudagraphs": True},
    "max-autotune": {"cudagraphs": True},
    "max-autotune-no-cudagraphs": {"cudagraphs": False},
}


class OptionError(ValueError):
    """A bad option or ``CGTREES_*`` value: the user's to fix. Its message's first line names the option,
    the value, what is accepted and the fix."""


def _field(default: Any, *, affects_codegen: bool, doc: str) -> Any:
    return field(default=default, metadata={"affects_codegen": affects_codegen, "doc": doc})


@dataclass(frozen=True)
class Config:
    cudagraphs: bool = _field(True, affects_codegen=False, doc="wrap CUDA kernel modules in graph trees")
    cache: bool = _field(True, affects_codegen=False, doc="use the persistent on-disk cache")
    max_shapes_per_function: int = _field(8, affects_codegen=False, doc="recordings per distinct shape, then no graphs")
    max_rerecords_per_function: int = _field(4, affects_codegen=False, doc="re-records for changed static addresses")
    max_live_branches_per_function: int = _field(4, affects_codegen=False, doc="branches forced by live outputs")
    max_copy_mb_per_launch: int = _field(8, affects_codegen=False,
                                         doc="a graph whose replays would copy more MiB of inputs than this per "
                                             "kernel launch runs without CUDA graphs (0: no limit)")
    cache_size_mb: int = _field(0, affects_codegen=False, doc="cache size cap with LRU eviction (0: no cap)")
    interpret: bool = _field(False, affects_codegen=True, doc="run Triton kernels through the interpreter (CPU)")
    cpu_pipeline: bool = _field(False, affects_codegen=False,
                                doc="compile graphs that hold no CUDA tensor as on a GPU (AOTAutograd, our "
                                    "partition, the runtime, the cache; kernels only with interpret), to see a "
                                    "model through the pipeline on a machine without one: 1.1-1.3x eager per "
                                    "call. Off, they run as Dynamo captured them (cgtrees.aot.as_captured)")
    debug_dir: str = _field("", affects_codegen=False, doc="write every generated module and graph here")
    cache_dir: str = _field("", affects_codegen=False, doc="cache directory (default: XDG cache/cgtrees)")
    precompile_cache: bool = _field(False, affects_codegen=False,
                                    doc="turn on Dynamo's caching precompile (torch._dynamo.config.caching_precompile) "
                                        "and save its cache at each compiled graph's first call; set it with the "
                                        "env var, which must be in force before torch.compile (cgtrees.precompile)")
    layout_opt: str = _field("auto", affects_codegen=True,
                             doc="channels-last convolution graphs (cgtrees.aot.layout): auto (CUDA graphs "
                                 "whose convolutions gain), off (also 0/false), force (any device: tests)")
    warm_first_calls: bool = _field(True, affects_codegen=False,
                                    doc="a warm load makes its modules' cuDNN/cuBLAS/attention calls once on "
                                        "empty tensors, in a background thread, so the first call finds them "
                                        "loaded (cgtrees.runtime.first_calls)")
    unfuse_addmm: bool = _field(True, affects_codegen=True,
                                doc="run a float32/float64 addmm whose product feeds only pointwise kernels as "
                                    "mm, its bias added in those kernels (cgtrees.codegen.lower_addmm)")

    gemm_decisions: str = _field("measure", affects_codegen=True,
                                 doc="how each GEMM's form is chosen (cgtrees.codegen.gemm_choice): measure "
                                     "(time the forms on the GPU at compile time: rows padded to 16 bytes or "
                                     "not, addmm or mm with the bias in its consumers; as traced where "
                                     "nothing can be timed), keep (as traced), rewrite (always rewritten), "
                                     "align or unfuse (only that rewrite, always: tests)")
    batch_buckets: tuple[int, ...] = _field((), affects_codegen=False,
                                            doc="batch sizes an inference graph with a dynamic batch dimension is "
                                                "padded up to (the next one >= B; rows of row 0, outputs cut back), "
                                                "one CUDA graph per bucket; empty: off (cgtrees.aot.buckets)")
    progress: bool = _field(True, affects_codegen=False,
                            doc="one progress line on stderr for compiles longer than 3 s, where stderr is a "
                                "terminal (cgtrees.progress)")
    remote_cache: str = _field("", affects_codegen=False,
                               doc="a Redis server as the cache's second tier behind the local directory, "
                                   "shared by a cluster: redis://host:port/db; empty: local only (cgtrees.cache)")
    remote_cache_key: str = _field("", affects_codegen=False,
                                   doc="the secret shared by the cluster that signs remote entries (HMAC); set "
                                       "it with the env var CGTREES_REMOTE_CACHE_KEY rather than in code")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # every value, also of a Config(...) built directly
            _check(f.name, f.type, getattr(self, f.name), source="Config")
        object.__setattr__(self, "batch_buckets", _buckets(self.batch_buckets, "batch_buckets"))
        object.__setattr__(self, "layout_opt", _LAYOUT_MODES[str(self.layout_opt).lower()])

    @classmethod
    def resolve(cls, mode: str | None = None, options: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> "Config":
        """Build the config from defaults, env vars, mode and options (in rising precedence)."""
        environ = os.environ if environ is None else environ
        names = {f.name: f for f in dataclasses.fields(cls)}
        _warn_unknown_env(environ, names)
        values: dict[str, Any] = {}
        for name, raw in _environment(environ).items():
            source, kind = f"env CGTREES_{name.upper()}", names[name].type
            values[name] = _parse(name, kind, raw, source=source)
            _check(name, kind, values[name], source=source)
        if mode not in (None, "default"):
            if mode not in MODES:
                raise OptionError(f"cgtrees: torch.compile(..., mode={mode!r}) is not a mode of ours; "
                                  f"{_nearest(str(mode), MODES)}valid modes: {', '.join(MODES)}")
            values.update(MODES[mode])
        for name, raw in (options or {}).items():
            if name not in names:
                raise OptionError(f"cgtrees: torch.compile(..., options={{{name!r}: ...}}) is not an option of "
                                  f"ours; {_nearest(str(name), names)}valid options: {', '.join(names)}")
            if name.endswith("_dir") and isinstance(raw, os.PathLike):
                raw = os.fspath(raw)  # a pathlib.Path is a directory as well as its text
            _check(name, names[name].type, raw, source="options")
            values[name] = raw
        return cls(**values)

    @classmethod
    def set_in_environment(cls, environ: Mapping[str, str] | None = None) -> frozenset[str]:
        """The fields this process sets with ``CGTREES_<NAME>`` (a non-empty value), unparsed."""
        return frozenset(_environment(os.environ if environ is None else environ))

    def items(self) -> list[tuple[str, Any]]:
        """Every field's name and value, in order."""
        return list(zip((f.name for f in dataclasses.fields(self)), dataclasses.astuple(self)))

    def codegen_key(self) -> tuple[tuple[str, Any], ...]:
        """Exactly the fields that change generated code, for the cache key."""
        affects = {f.name for f in dataclasses.fields(self) if f.metadata["affects_codegen"]}
        return tuple((name, value) for name, value in self.items() if name in affects)


def _environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The one place the environment is read: each field's ``CGTREES_<NAME>`` that is set, non-empty."""
    found = {}
    for f in dataclasses.fields(Config):
        raw = environ.get(f"CGTREES_{f.name.upper()}")
        if raw is not None and raw != "":
            found[f.name] = raw
    return found


def _nearest(name: str, valid: Iterable[str], shown: str = "{!r}") -> str:
    """``did you mean X? `` for the valid name closest to ``name`` (written as ``shown``), or ''."""
    near = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.75)
    return f"did you mean {shown.format(near[0])}? " if near else ""


_WARNED: set[str] = set()  # unknown variables already named, once a process


def _warn_unknown_env(environ: Mapping[str, str], names: Mapping[str, Any]) -> None:
    """Name each ``CGTREES_*`` variable that no option reads (a typo of one is otherwise ignored
    without a word), with the nearest valid name, once a process."""
    known = [f"CGTREES_{name.upper()}" for name in names]
    for var in sorted(environ):
        if var.startswith("CGTREES_") and var not in known and var not in _WARNED:
            _WARNED.add(var)
            hint = _nearest(var.removeprefix("CGTREES_"), [n.upper() for n in names], shown="CGTREES_{}")
            logging.getLogger("cgtrees").warning(
                "cgtrees: environment variable %s is not one of ours and is ignored; %svalid: %s",
                var, hint, ", ".join(known))


_BUCKETS_EXPECTED = ("positive batch sizes: a tuple of ints in options=, comma-separated in "
                     "CGTREES_BATCH_BUCKETS; fix: options={'batch_buckets': (1, 2, 4, 8)} or "
                     "CGTREES_BATCH_BUCKETS=1,2,4,8")


def _buckets(raw: Any, source: str) -> tuple[int, ...]:
    """Batch buckets from a tuple or list of ints, or a comma-separated string; sorted, unique."""
    items = [p.strip() for p in raw.split(",") if p.strip()] if isinstance(raw, str) else raw
    try:
        values = [int(p) if isinstance(p, str) and p.isdigit() else p for p in items]
    except TypeError:
        values = None
    if values is None or not all(type(v) is int and v > 0 for v in values):
        raise OptionError(f"cgtrees: {source}: batch_buckets={raw!r} is not valid; expected {_BUCKETS_EXPECTED}")
    return tuple(sorted(set(values)))


_LAYOUT_MODES = {"auto": "auto", "1": "auto", "true": "auto", "on": "auto", "off": "off", "0": "off",
                 "false": "off", "force": "force"}
_GEMM_MODES = ("measure", "keep", "rewrite", "align", "unfuse")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_MINIMUM = {"max_shapes_per_function": 1}  # other ints: 0 or more (0: none, or no limit, as documented)
_REMOTE_SCHEMES = ("redis://", "rediss://")
_CHOICES = {"gemm_decisions": _GEMM_MODES, "layout_opt": ("auto", "off", "force")}  # layout_opt: also 1/0, ...


def _kind(type_name: Any) -> str:
    return type_name if isinstance(type_name, str) else type_name.__name__


def _bad(name: str, raw: Any, source: str, accepted: str, example: Any) -> OptionError:
    """The error for ``raw``: where it came from, what is accepted, and a value that would do."""
    if source.startswith("env"):
        var = f"CGTREES_{name.upper()}"
        shown = example if isinstance(example, str) else ",".join(map(str, example)) \
            if isinstance(example, tuple) else str(int(example) if isinstance(example, bool) else example)
        return OptionError(f"cgtrees: {source}: {name}={raw!r} is not valid; expected {accepted}; "
                           f"fix: export {var}={shown} or unset it")
    return OptionError(f"cgtrees: {source}: {name}={raw!r} is not valid; expected {accepted}; "
                       f"fix: torch.compile(..., options={{{name!r}: {example!r}}})")


def _parse(name: str, type_name: Any, raw: Any, *, source: str) -> Any:
    """``raw`` as the field's type. An env var is text; options are Python values and get no conversion
    (``"yes"`` is not a bool there, ``"8"`` not an int, ``"1,2"`` not a tuple)."""
    kind, env = _kind(type_name), source.startswith("env")
    if not env:
        return raw  # checked, with the rest, by Config's __post_init__
    text = str(raw).strip()
    if kind == "bool":
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise _bad(name, raw, source, f"{', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off)", _example(name))
    if kind == "int":
        if text.isdigit():
            return int(text)
        raise _bad(name, raw, source, _int_accepted(name), _example(name))
    if kind == "tuple[int, ...]":
        return _buckets(raw, source)
    return text


def _example(name: str) -> Any:
    """A valid value to show in a fix: the default, or a URL where the default is off."""
    if name == "remote_cache":
        return "redis://localhost:6379/0"
    if name == "batch_buckets":
        return (1, 2, 4, 8)
    return next(f.default for f in dataclasses.fields(Config) if f.name == name)


def _int_accepted(name: str) -> str:
    low = _MINIMUM.get(name, 0)
    return f"a whole number >= {low}" + (" (0: none or no limit)" if low == 0 else "")


def _check(name: str, type_name: Any, value: Any, *, source: str) -> None:
    """Strict types and ranges: OptionError naming the option, the value, what is accepted and the fix."""
    kind = _kind(type_name)
    if kind == "bool" and type(value) is not bool:
        raise _bad(name, value, source, "True or False (as an env var: 1/0, true/false, yes/no, on/off)",
                   _example(name))
    if kind == "int" and (type(value) is not int or value < _MINIMUM.get(name, 0)):
        as_int = "" if source.startswith("env") else ", as an int (not a string or a bool)"
        raise _bad(name, value, source, _int_accepted(name) + as_int, _example(name))
    if kind == "tuple[int, ...]" and isinstance(value, str) and not source.startswith("env"):
        raise OptionError(f"cgtrees: {source}: batch_buckets={value!r} is not valid; expected {_BUCKETS_EXPECTED}")
    if kind != "str" or (name == "layout_opt" and type(value) is bool):  # layout_opt=False: off, True: auto
        return
    if not isinstance(value, str):
        raise _bad(name, value, source, "a string", _example(name))
    known = _LAYOUT_MODES if name == "layout_opt" else _CHOICES.get(name, ())
    if name in _CHOICES and str(value).lower() not in known:
        raise OptionError(f"cgtrees: {name}={value!r}; valid values: {', '.join(_CHOICES[name])}; "
                          f"{_nearest(str(value), _CHOICES[name])}fix: options={{{name!r}: {_CHOICES[name][0]!r}}} "
                          f"or CGTREES_{name.upper()}={_CHOICES[name][0]}")
    if name == "remote_cache" and value and not value.startswith(_REMOTE_SCHEMES):
        raise _bad(name, value, source, "a Redis URL, redis://host:port/db (rediss:// with TLS), or '' (local only)",
                   _example(name))
