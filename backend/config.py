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
    remote_cache: str = _field("", affects_codegen=False,
                               doc="a Redis server as the cache's second tier behind the local directory, "
                                   "shared by a cluster: redis://host:port/db; empty: local only (cgtrees.cache)")
    remote_cache_key: str = _field("", affects_codegen=False,
                                   doc="the secret shared by the cluster that signs remote entries (HMAC); set "
                                       "it with the env var CGTREES_REMOTE_CACHE_KEY rather than in code")

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_buckets", _buckets(self.batch_buckets, "batch_buckets"))
        if self.gemm_decisions not in _GEMM_MODES:
            raise ValueError(f"cgtrees: gemm_decisions={self.gemm_decisions!r}; valid values: "
                             f"{', '.join(_GEMM_MODES)}")
        mode = _LAYOUT_MODES.get(str(self.layout_opt).lower())
        if mode is None:
            raise ValueError(f"cgtrees: layout_opt={self.layout_opt!r}; valid values: auto, off, force")
        object.__setattr__(self, "layout_opt", mode)

    @classmethod
    def resolve(cls, mode: str | None = None, options: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> "Config":
        """Build the config from defaults, env vars, mode and options (in rising precedence)."""
        environ = os.environ if environ is None else environ
        names = {f.name: f for f in dataclasses.fields(cls)}
        _warn_unknown_env(environ, names)
        values: dict[str, Any] = {}
        for name, f in names.items():
            raw = environ.get(f"CGTREES_{name.upper()}")
            if raw is not None and raw != "":
                values[name] = _parse(name, f.type, raw, source=f"env CGTREES_{name.upper()}")
        if mode not in (None, "default"):
            if mode not in MODES:
                raise ValueError(f"cgtrees: torch.compile(..., mode={mode!r}) is not a mode of ours; "
                                 f"{_nearest(str(mode), MODES)}valid modes: {', '.join(MODES)}")
            values.update(MODES[mode])
        for name, raw in (options or {}).items():
            if name not in names:
                raise ValueError(f"cgtrees: torch.compile(..., options={{{name!r}: ...}}) is not an option of ours; "
                                 f"{_nearest(str(name), names)}valid options: {', '.join(names)}")
            values[name] = _parse(name, names[name].type, raw, source="options")
        return cls(**values)

    def items(self) -> list[tuple[str, Any]]:
        """Every field's name and value, in order."""
        return list(zip((f.name for f in dataclasses.fields(self)), dataclasses.astuple(self)))

    def codegen_key(self) -> tuple[tuple[str, Any], ...]:
        """Exactly the fields that change generated code, for the cache key."""
        affects = {f.name for f in dataclasses.fields(self) if f.metadata["affects_codegen"]}
        return tuple((name, value) for name, value in self.items() if name in affects)


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


_BUCKETS_EXPECTED = ("positive batch sizes, e.g. options={'batch_buckets': (1, 2, 4, 8)} or "
                     "CGTREES_BATCH_BUCKETS=1,2,4,8")


def _buckets(raw: Any, source: str) -> tuple[int, ...]:
    """Batch buckets from a tuple or list of ints, or a comma-separated string; sorted, unique."""
    items = [p.strip() for p in raw.split(",") if p.strip()] if isinstance(raw, str) else raw
    try:
        values = [int(p) if isinstance(p, str) and p.isdigit() else p for p in items]
    except TypeError:
        values = None
    if values is None or not all(type(v) is int and v > 0 for v in values):
        raise ValueError(f"cgtrees: {source}: batch_buckets={raw!r} is not valid; expected {_BUCKETS_EXPECTED}")
    return tuple(sorted(set(values)))


_LAYOUT_MODES = {"auto": "auto", "1": "auto", "true": "auto", "on": "auto", "off": "off", "0": "off",
                 "false": "off", "force": "force"}
_GEMM_MODES = ("measure", "keep", "rewrite", "align", "unfuse")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(name: str, type_name: Any, raw: Any, *, source: str) -> Any:
    kind = type_name if isinstance(type_name, str) else type_name.__name__
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in _TRUE | _FALSE:
            return str(raw).lower() in _TRUE
    elif kind == "int":
        if isinstance(raw, bool):
            pass
        elif isinstance(raw, int):
            return raw
        elif isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
            return int(raw)
    elif kind == "str":
        return str(raw)
    elif kind == "tuple[int, ...]":
        return _buckets(raw, source)
    raise ValueError(f"cgtrees: {source}: {name}={raw!r} is not a valid {kind}")
