"""Every torch private API the cache itself uses, in one place (torch 2.11 on the GPU, 2.13 in CI):
what the level-1 key reads of torch's state (autocast, AOTAutograd's settings), what ``load``
checks of the inputs, a constant's bytes, and the guards a symbolic graph's entry is valid under
(``Symbols``). What the driver reads of AOTAutograd to rebuild its wrappers is ``aot.compat``'s.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.fx

log = logging.getLogger("cgtrees.cache")

__all__ = [
    "Uncacheable", "storage_id", "saved_tensors_hooks_inlined", "autocast_enabled", "tensor_bytes", "is_fake",
    "Symbols", "autocast_text", "concrete_int", "functorch_config_text",
]


class Uncacheable(Exception):
    """A graph the first cache level does not rebuild; the message is the reason (logged)."""



def storage_id(t: torch.Tensor) -> Any:
    """A hashable identity of ``t``'s storage (fake tensors' too): views of one tensor share it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def saved_tensors_hooks_inlined() -> bool:
    """AOTAutograd inlines some saved-tensor hooks into the graphs and disables them at runtime."""
    utils = torch._functorch._aot_autograd.utils
    top = getattr(utils, "top_saved_tensors_hooks", None)
    inlineable = getattr(utils, "saved_tensors_hooks_are_inlineable", None)
    if top is None or inlineable is None:
        return False
    return bool(inlineable(top()))


def autocast_enabled() -> bool:
    return bool(torch._C._is_any_autocast_enabled())


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_text(devices: Iterable[str] = ()) -> str:
    """Autocast's state, for the key: the device types it is on for (each with its dtype) and
    whether it caches casts; "off" when it is off everywhere (the text of every graph compiled
    without autocast, so their keys do not change when a torch adds a device type)."""
    if not autocast_enabled():
        return "off"
    on = []
    for device in dict.fromkeys((*_AUTOCAST_DEVICES, *devices)):
        try:
            if torch.is_autocast_enabled(device):
                on.append(f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}")
        except (RuntimeError, TypeError, ValueError):  # a device type this torch does not know
            continue
    return " ".join(on) + f" cache={torch.is_autocast_cache_enabled()}"


def concrete_int(s: Any) -> int | None:
    """``s`` as an int where it is one: an int, or a SymInt that a guard specialized (``s0`` replaced
    by 2: Dynamo may pass such a size in a tensor's shape); None for a symbolic size."""
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        return s.node.maybe_as_int()
    return None


def is_fake(x: Any) -> bool:
    """A fake tensor (DDPOptimizer hands its pieces' example activations as fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


# ---- symbolic shapes: the guards a level-1 entry is valid under -----------------------------------
#
# A graph with symbolic sizes is compiled for every size its ShapeEnv's guards allow. AOTAutograd
# and our passes add guards of their own while compiling it (a size that must not be 0 or 1, a
# divisibility), after Dynamo traced the graph and before it reads the guards off the ShapeEnv.
# So an entry keeps, besides its key, the guards on its graph's size inputs at the end of the
# compile (``ShapeEnv.produce_guards_expression``, Python over ``L['t0']``, ``L['t1']``, ...); a
# lookup evaluates them on this call's sizes (a false one is a miss), and a hit adds them to the
# ShapeEnv, so Dynamo guards on them as it would have after compiling.

class Symbols:
    """A Dynamo graph's size inputs (the SymInt example inputs that are one backed symbol each, in
    input order: Dynamo lifts every symbol of a tensor's sizes as such an input) and their ShapeEnv."""

    def __init__(self, example_inputs: Iterable[Any]) -> None:
        self.symints = [x for x in example_inputs if isinstance(x, torch.SymInt) and x.node.has_hint()]
        self.shape_env = self.symints[0].node.shape_env if self.symints else None
        self.start = len(self.shape_env.guards) if self.shape_env is not None else 0
        # the symbols now: a guard of the compile may specialize one (``Eq(s0, 13)`` replaces s0 by 13)
        self.names = {symbol for s in self.symints for symbol in s.node.expr.free_symbols}

    def __bool__(self) -> bool:
        return self.shape_env is not None

    def settings_text(self) -> str:
        """The ShapeEnv's settings (0/1 specialization, duck sizing, ...): for the key."""
        return repr(getattr(self.shape_env, "settings", None))

    def guards_text(self) -> str | None:
        """The guards on the size inputs now, as Python (None: none). Uncacheable where a guard
        added since ``__init__`` (while compiling) reads a symbol that is not a size input: it could
        not be checked on a later call's sizes."""
        env = self.shape_env
        for guard in env.guards[self.start:]:
            if not guard.expr.free_symbols <= self.names:
                raise Uncacheable(f"the compile added the guard {guard.expr}, on sizes that are not graph inputs")
        try:
            return env.produce_guards_expression(self.symints, guards=env.get_pruned_guards(self.symints))
        except Exception as exc:  # noqa: BLE001 - the graph is compiled, not cached at this level
            raise Uncacheable(f"its guards could not be written ({type(exc).__name__}: {exc})") from None

    def hold(self, text: str) -> bool:
        """Whether the guards ``text`` hold for the sizes of this call (their hints); adds no guard."""
        try:
            return bool(self.shape_env.evaluate_guards_expression(text, [int(s.node.hint) for s in self.symints]))
        except Exception:  # noqa: BLE001 - guards of another torch or graph: not this call's entry
            return False

    def install(self, text: str) -> bool:
        """Add the guards ``text`` to the ShapeEnv (evaluated on the symbols themselves): Dynamo
        then guards the frame on them, as after a compile that added them."""
        return bool(self.shape_env.evaluate_guards_expression(text, self.symints))


def functorch_config_text() -> str:
    """AOTAutograd's settings (they change the graphs it hands us)."""
    cfg = torch._functorch.config
    getter = getattr(cfg, "get_config_copy", None)
    items = getter() if getter is not None else {}
    # Callables print their address, which changes every process: key on their name only.
    return repr(sorted((k, getattr(v, "__qualname__", None) or repr(v)) for k, v in items.items()
                       if not k.startswith("_")))


def tensor_bytes(value: torch.Tensor) -> bytes:
    """The bytes of a real tensor in row-major order, also while a fake mode is active (inside
    AOTAutograd, where a plain ``.cpu()`` would be dispatched to the fake mode and fail)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        if flat.dtype.is_complex:
            flat = torch.view_as_real(flat).reshape(-1)
        return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
