"""One row of the serving benchmark (issue 45) in this process; its figures as one JSON file.

    python benchmarks/serve_worker.py --path loop --backend cgtrees --batch 1 --cache 160 --result row.json [--smoke]

The model (``--model``) is a Llama in bf16 with random weights, made on the device (seconds, even for
8B): ``llama_1b``, 1.1B parameters of TinyLlama's shape (``MODELS``: hidden 2048, 22 layers, 32 heads,
4 KV heads, intermediate 5632, vocab 32000), or ``llama_8b``, Llama-3-8B's shape (hidden 4096, 32
layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256, 16 GB of weights). A row generates
``--new`` tokens (default 128) greedily after a prompt that fills the cache to ``--cache`` tokens at
the end (prompt = cache - new: a cache of 160 holds a 32-token prompt, one of 4096 a 3968-token one).

Two paths:

- ``loop``: a plain decode loop, as gpt-fast writes it. A ``StaticCache``; the prompt runs eagerly
  (prefill); the compiled function is one decode step (the model's forward on one token per
  sequence, then the greedy argmax on the device), called with the token and its position as device
  tensors; the next token is copied into a device buffer. No host synchronisation per token.
- ``hf``: Hugging Face's documented path, ``model.generate(ids, cache_implementation="static",
  compile_config=CompileConfig(fullgraph=True, backend=B))``; generate compiles its decode step and
  runs the prefill eagerly (eager: ``disable_compile=True``; reduce-overhead: backend "inductor",
  CompileConfig's default mode).
- ``hf-forward``: the older path, ``model.forward = torch.compile(model.forward, ...)`` and generate
  with ``disable_compile=True``: the prefill is compiled too (reduce-overhead fails on it: "To prevent
  overwriting, clone the tensor outside of torch.compile()").

Figures (``ms_token``: GPU-synchronised wall time per decode step, batch sequences each):
- ``tokens_s`` = batch / ms_token; ``hbm_fraction`` = the weights' bytes / ms_token / the device's
  peak bandwidth (H100 3.35 TB/s, H200 4.8 TB/s), the fraction DESIGN.md defines (the cache's own
  bytes not counted);
- ``ttft_ms``: from the prompt to the first new token on the host (steady state, compiled);
- ``compile_s``: the first full generation minus a steady one;
- ``profile``: ``size_worker.profile`` of decode steps (device ms a token by kernel category, busy,
  idle = ms_token minus busy, top kernels);
- ``tokens_equal``: how many of the first generation's tokens equal eager's in this process (bf16:
  greedy paths may part at a near tie), ``logits_rel_err``: the first decode step's logits against
  eager's, largest difference over eager's largest magnitude.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

import size_worker

MODELS = {
    "llama_1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096),
    "llama_8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                     rope_theta=500000.0),
}
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, max_position_embeddings=512)
PEAK_TBS = {"H100": 3.35, "H200": 4.8}
# cgtrees-nopdl: cgtrees with its GEMVs launched the plain way (codegen/pdl.py), to measure what the
# early launch gives in the same call
BACKENDS = ("eager", "reduce-overhead", "cgtrees", "cgtrees-nopdl")


def build(smoke: bool, device: torch.device, seed: int = 0, model: str = "llama_1b") -> torch.nn.Module:
    """The model, its weights made where it runs and in the dtype it runs in (an 8B model made on the
    host in float32 and then moved would take minutes and 32 GB of host memory)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**(SMOKE if smoke else MODELS[model]), tie_word_embeddings=False)
    dtype = torch.float32 if smoke else torch.bfloat16
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            built = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return built.to(dtype=dtype).eval()  # float32 buffers (rotary frequencies) in dtype too, as before


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_tbs(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tbs for key, tbs in PEAK_TBS.items() if key in name), None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the plain loop ---------------------------------------------------------------------------------

class Loop:
    """A ``StaticCache``, an eager prefill and a decode step compiled with ``backend``."""

    def __init__(self, model: torch.nn.Module, backend: str, batch: int, cache: int, new: int) -> None:
        from transformers import StaticCache

        self.model, self.new, self.device = model, new, next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=cache)
        self.prompt_len = cache - new
        params = {**inspect.signature(model.forward).parameters, **inspect.signature(model.model.forward).parameters}
        self.kwargs_pos = "cache_position" in inspect.signature(model.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        # torch documents the mark for CUDA-graph backends; a cgtrees inference loop needs none (a
        # generation ends when none of its outputs is alive): SERVE_CGTREES_MARK=0 leaves it out (since
        # cgtrees.marks the mark no longer imports Inductor's compile_fx, 2 s of a warm start before)
        self.mark = backend == "reduce-overhead" or (
            backend == "cgtrees" and os.environ.get("SERVE_CGTREES_MARK") != "0")
        self.step = self.decode if backend == "eager" else torch.compile(
            self.decode, fullgraph=True, **({"mode": "reduce-overhead"} if backend == "reduce-overhead"
                                            else {"backend": "cgtrees"}))
        self.tokens = torch.zeros(batch, new, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.cur = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # the step's input token

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        kwargs = {"cache_position": pos} if self.kwargs_pos else {}
        kwargs[self.cache_arg] = self.cache
        return self.model(input_ids=ids, position_ids=pos.unsqueeze(0), use_cache=True, **kwargs).logits

    def decode(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.forward(ids, pos)[:, -1]
        return logits.argmax(-1, keepdim=True), logits

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        self.cache.reset()
        pos = torch.arange(prompt.shape[1], device=self.device)
        first = self.forward(prompt, pos)[:, -1].argmax(-1, keepdim=True)
        self.pos.fill_(prompt.shape[1])
        return first

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, keep_logits: bool = False) -> torch.Tensor | None:
        """The new tokens fill ``self.tokens``; the first decode step's logits when asked."""
        first_logits = None
        self.cur.copy_(self.prefill(prompt))
        self.tokens[:, 0:1].copy_(self.cur)
        for i in range(1, self.new):
            if self.mark:
                torch.compiler.cudagraph_mark_step_begin()
            tok, logits = self.step(self.cur, self.pos)
            if keep_logits and i == 1:
                first_logits = logits.float().clone()
            self.tokens[:, i:i + 1].copy_(tok)
            self.cur.copy_(tok)
            self.pos += 1
        return first_logits

    def one_token(self) -> Callable[[], None]:
        """A profiling step: one decode step at the cache's last position (the cache is full then)."""
        @torch.no_grad()  # as generate runs it: with grad on, Dynamo would compile a training graph
        def step() -> None:
            if self.mark:
                torch.compiler.cudagraph_mark_step_begin()
            self.pos.fill_(self.prompt_len + self.new - 2)
            self.step(self.cur, self.pos)
        return step


# --- Hugging Face's generate ------------------------------------------------------------------------

class HF:
    older = False  # HFForward: the model's forward compiled, prefill included

    def __init__(self, model: torch.nn.Module, backend: str, batch: int, cache: int, new: int) -> None:
        from transformers.generation import CompileConfig

        self.model, self.new, self.prompt_len = model, new, cache - new
        self.kwargs: dict = {"cache_implementation": "static", "do_sample": False}
        if backend == "eager" or self.older:
            self.kwargs["disable_compile"] = True
            if backend != "eager":  # a new module object: the eager reference keeps the plain forward
                self.model = _with_compiled_forward(model, backend)
        else:
            config = CompileConfig(fullgraph=True, backend="inductor" if backend == "reduce-overhead" else "cgtrees")
            if next(model.parameters()).device.type == "cpu":
                config._compile_all_devices = True  # generate compiles only on accelerators otherwise
            self.kwargs["compile_config"] = config
        self.tokens: torch.Tensor | None = None

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, keep_logits: bool = False, new: int | None = None) -> torch.Tensor | None:
        out = self.model.generate(prompt, max_new_tokens=new or self.new, min_new_tokens=new or self.new,
                                  output_logits=keep_logits, return_dict_in_generate=True, **self.kwargs)
        self.tokens = out.sequences[:, prompt.shape[1]:]
        return out.logits[1].float().clone() if keep_logits else None


class HFForward(HF):
    """The older path: ``model.forward = torch.compile(model.forward, ...)``, then generate with its
    own compilation off; the prefill is compiled too, and makes the static cache inside it."""

    older = True


def _with_compiled_forward(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    import copy

    compiled = copy.copy(model)  # shares the parameters; its own forward attribute
    kwargs = {"mode": "reduce-overhead"} if backend == "reduce-overhead" else {"backend": "cgtrees"}
    compiled.forward = torch.compile(model.forward, **kwargs)
    return compiled


def per_token(prof: dict, new: int) -> dict:
    """A profile of one whole generation (prefill included) as figures per new token."""
    scale = 1.0 / new
    return {**prof, "per": f"generation / {new}", "busy_ms": prof["busy_ms"] * scale,
            "idle_ms": None if prof["idle_ms"] is None else prof["idle_ms"] * scale,
            "categories_ms": {k: v * scale for k, v in prof["categories_ms"].items()},
            "kernels": prof["kernels"] * scale,
            "top": [{**t, "ms": t["ms"] * scale, "launches": t["launches"] * scale} for t in prof["top"]],
            "top_families": [{**t, "ms": t["ms"] * scale, "launches": t["launches"] * scale}
                             for t in prof["top_families"]]}


# --- a row ------------------------------------------------------------------------------------------

def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def measure(spec: dict, phase: Callable[[str], None]) -> dict:
    device = torch.device(spec["device"])
    phase("build")
    model = build(spec["smoke"], device, model=spec["model"])
    make = {"loop": Loop, "hf": HF, "hf-forward": HFForward}[spec["path"]]
    batch, cache, new = spec["batch"], spec["cache"], spec["new"]
    prompt = torch.randint(0, model.config.vocab_size, (batch, cache - new), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    row: dict = {"weight_bytes": weight_bytes(model)}
    phase("eager reference")
    ref = make(model, "eager", batch, cache, new)
    ref_logits = ref.generate(prompt, keep_logits=True)
    ref_tokens = ref.tokens.clone()
    backend = spec["backend"]
    if backend == "cgtrees-nopdl":
        from cgtrees.codegen import pdl

        pdl.ENABLED, backend = False, "cgtrees"
    runner = ref if backend == "eager" else make(model, backend, batch, cache, new)
    phase("first generation")
    first_s = timed(lambda: runner.generate(prompt), device)
    phase("errors")
    logits = runner.generate(prompt, keep_logits=True)
    row["tokens_equal"] = int((runner.tokens == ref_tokens).all(0).long().cumprod(0).sum())
    row["logits_rel_err"] = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    phase("steady")
    whole = sorted(timed(lambda: runner.generate(prompt), device) for _ in range(spec["repeats"]))[spec["repeats"] // 2]
    if spec["path"] == "loop":
        ttft = sorted(timed(lambda: runner.prefill(prompt), device) for _ in range(3))[1]
    else:
        ttft = sorted(timed(lambda: runner.generate(prompt, new=1), device) for _ in range(3))[1]
    ms_token = (whole - ttft) / (new - 1) * 1e3
    tbs = peak_tbs(device)
    row.update(first_s=first_s, generate_s=whole, ttft_ms=ttft * 1e3, ms_token=ms_token,
               tokens_s=batch / ms_token * 1e3, compile_s=first_s - whole,
               hbm_fraction=None if tbs is None else row["weight_bytes"] / (ms_token / 1e3) / (tbs * 1e12))
    if device.type == "cuda" and spec["profiled"]:
        phase("profile")
        if spec["path"] == "loop":
            row["profile"] = size_worker.profile(runner.one_token(), device, 20, ms_token)
        else:
            prof = size_worker.profile(lambda: runner.generate(prompt), device, 1, whole * 1e3)
            row["profile"] = per_token(prof, new)
    row["counters"] = size_worker._counters()
    return row


def run(spec: dict) -> dict:
    row = {**spec, "status": "ok", "ok": True, "environment": size_worker.environment(spec["device"])}
    where = {"phase": "start"}

    def phase(name: str) -> None:
        where["phase"] = name
        row_name = f"{spec['model']} {spec['path']} {spec['backend']} b{spec['batch']} c{spec['cache']}"
        print(f"[{time.strftime('%H:%M:%S')}] {row_name}: {name}", flush=True)

    try:
        row.update(measure(spec, phase))
    except Exception as e:  # the row's error, never a crash
        row.update(status="error", ok=False, error=f"{where['phase']}: {type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc()[-4000:])
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", choices=("loop", "hf", "hf-forward"), required=True)
    p.add_argument("--model", choices=tuple(MODELS), default="llama_1b")
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cache", type=int, default=160, help="cache length: the prompt fills it but --new tokens")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="steady generations timed (median)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--smoke", action="store_true", help="a tiny fp32 model (CPU: cgtrees's kernels interpreted)")
    p.add_argument("--device", default=None)
    p.add_argument("--result", required=True)
    a = p.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    spec = {"model": a.model, "path": a.path, "backend": a.backend, "batch": a.batch, "cache": a.cache, "new": a.new,
            "repeats": a.repeats, "profiled": not a.no_profile, "smoke": a.smoke, "device": device}
    if device == "cpu" and a.backend == "reduce-overhead":
        row = {**spec, "status": "skipped", "ok": False, "error": "reduce-overhead needs CUDA"}
    else:
        row = run(spec)
    tmp = Path(a.result).with_suffix(".tmp")
    tmp.write_text(json.dumps(row, indent=1, default=str))
    os.replace(tmp, a.result)


if __name__ == "__main__":
    sys.exit(main())
