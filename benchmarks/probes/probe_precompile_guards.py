"""Does Dynamo's caching precompile (``CGTREES_PRECOMPILE_CACHE=1``) run a wrong graph when the
program changes something Dynamo guards on with a guard that caching precompile drops?

    python benchmarks/probes/probe_precompile_guards.py          # CPU is enough

Each case runs a small model twice in fresh processes over one cache directory: the first with
variant A, the second with variant B, which must give B's result; the first process also switches
to B after its first call (the same process). Cases: a global function (``ID_MATCH``), a function a
closure holds (``CLOSURE_MATCH``), a function held by a module attribute (a different model
instance: ``ID_MATCH`` on ``L['self']``), and a global bool (``EQUALS_MATCH``, kept: the control).
Prints one line per case and setting: whether each call matched eager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CASE = r'''
import json, sys
import torch
case, variant, switch = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
FUNCS = {"A": torch.relu, "B": torch.sigmoid}
ACT = FUNCS[variant]
FLAG = variant == "A"

def closure(fn):
    def apply(t):
        return fn(t)
    return apply

APPLY = closure(FUNCS[variant])

class M(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.lin, self.act = torch.nn.Linear(8, 8), act
    def forward(self, x):
        y = self.lin(x)
        if case == "global_function":
            return ACT(y)
        if case == "closure":
            return APPLY(y)
        if case == "module_attribute":
            return self.act(y)
        return torch.relu(y) if FLAG else torch.sigmoid(y)

torch.manual_seed(0)
m = M(FUNCS[variant])
x = torch.randn(4, 8)
c = torch.compile(m, backend="cgtrees")
right = []
with torch.no_grad():
    right.append(bool(torch.allclose(c(x), m(x))))
    if switch:  # the same process: the program switches to B after compiling A
        globals().update(ACT=torch.sigmoid, FLAG=False, APPLY=closure(torch.sigmoid))
        m.act = torch.sigmoid
        right.append(bool(torch.allclose(c(x), m(x))))
print("RESULT " + json.dumps(right))
'''


def run(case: str, variant: str, switch: bool, env: dict[str, str]) -> tuple[list[bool], int]:
    proc = subprocess.run([sys.executable, "-c", CASE, case, variant, "1" if switch else "0"],
                          env=env, capture_output=True, text=True, timeout=300)
    dropped = sum("is dropped with caching_precompile=True" in line for line in proc.stderr.splitlines())
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), dropped
    raise RuntimeError(proc.stderr[-2000:])


def main() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CGTREES_", "TORCHINDUCTOR"))}
    base["CGTREES_CPU_PIPELINE"] = "1"
    for case in ("global_function", "closure", "module_attribute", "global_bool"):
        for precompile in ("1", "0"):
            with tempfile.TemporaryDirectory() as tmp:
                env = {**base, "CGTREES_PRECOMPILE_CACHE": precompile, "CGTREES_CACHE_DIR": f"{tmp}/c",
                       "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/ind"}
                first, dropped = run(case, "A", True, env)
                second, _ = run(case, "B", False, env)
            print(f"{case:17} precompile={precompile}: first process right {first[0]}, after switching to B "
                  f"right {first[1]}; second process (B) right {second[0]}; guards dropped {dropped}", flush=True)


if __name__ == "__main__":
    main()
