"""More Hugging Face architectures than ``tests/test_hf_models.py`` keeps in CI, each compiled whole with
``backend="cgtrees"`` and checked against eager by the suite's own ``check_inference`` and
``check_training`` (outputs, loss and every gradient): encoders, decoders, state-space models,
encoder-decoders and vision models at the suite's tiny sizes, random weights. A CPU is enough:

    CGTREES_CPU_PIPELINE=1 python benchmarks/probes/hf_sweep.py              # graphs run as aten calls
    CGTREES_CPU_PIPELINE=1 CGTREES_INTERPRET=1 python benchmarks/probes/hf_sweep.py --interpret
    ... --only mamba,swin

One line per model and mode: ok (graphs compiled, whole-graph fallbacks, kernels generated; a cache
directory of its own unless ``CGTREES_CACHE_DIR`` is set) or the failure. A training run that misses
eager float32's tolerance is judged again against float64 (``referee``): ok, with both distances,
where ours is as close to float64 as eager float32 is (within ``REFEREE_FACTOR``). An architecture that fails
belongs in the suite, with its fix.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

os.environ.setdefault("CGTREES_CACHE_DIR", tempfile.mkdtemp(prefix="cgtrees-sweep-"))  # every graph compiled

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))

import hf_helpers as H  # noqa: E402
from hf_helpers import VOCAB, Case, _causal_lm_inputs, _masked_lm_inputs, _seq2seq_inputs, _special  # noqa: E402


def _model(model: str, config: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**kw))
    return build


def _encoder(model: str, config: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    return _model(model, config, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, pad_token_id=0, **kw)


def _decoder(model: str, config: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, **_special())
    return _model(model, config, **{**sizes, **kw})


def _images() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([1, 3])}


_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=5)
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=0, **_special())
_SSM = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
            use_cache=False, **_special())

CASES = {
    "roberta": Case(_encoder("RobertaForMaskedLM", "RobertaConfig"), _masked_lm_inputs),
    "electra": Case(_encoder("ElectraForMaskedLM", "ElectraConfig", embedding_size=16), _masked_lm_inputs),
    "distilbert": Case(_model("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=32, n_layers=2,
                              n_heads=4, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
                              attention_dropout=0.0, pad_token_id=0), _masked_lm_inputs),
    "albert": Case(_encoder("AlbertForMaskedLM", "AlbertConfig", embedding_size=16), _masked_lm_inputs),
    "modernbert": Case(_decoder("ModernBertForMaskedLM", "ModernBertConfig", global_attn_every_n_layers=2,
                                local_attention=8, embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0,
                                pad_token_id=0), _masked_lm_inputs),
    "opt": Case(_model("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                       word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **_special()), _causal_lm_inputs),
    "gptj": Case(_model("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                        n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_special()),
                 _causal_lm_inputs),
    "mpt": Case(_model("MptForCausalLM", "MptConfig", vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2,
                       expansion_ratio=2, max_seq_len=64, **_special()), _causal_lm_inputs),
    "olmoe": Case(_decoder("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2,
                           num_key_value_heads=2), _causal_lm_inputs),
    "granitemoe": Case(_decoder("GraniteMoeForCausalLM", "GraniteMoeConfig", num_local_experts=4,
                                num_experts_per_tok=2, num_key_value_heads=2), _causal_lm_inputs),
    "qwen2_tied_mqa": Case(_decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=1,
                                    tie_word_embeddings=True), _causal_lm_inputs),
    "mamba": Case(_model("MambaForCausalLM", "MambaConfig", **_SSM), _causal_lm_inputs),
    "falcon_mamba": Case(_model("FalconMambaForCausalLM", "FalconMambaConfig", use_mambapy=False, **_SSM),
                         _causal_lm_inputs),
    "mamba2": Case(_model("Mamba2ForCausalLM", "Mamba2Config", vocab_size=VOCAB, hidden_size=32, num_heads=4,
                          head_dim=16, state_size=8, num_hidden_layers=2, expand=2, n_groups=1, conv_kernel=4,
                          chunk_size=8, use_cache=False, **_special()), _causal_lm_inputs),
    "jamba": Case(_decoder("JambaForCausalLM", "JambaConfig", num_key_value_heads=2, num_experts=2,
                           num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                           attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                           use_mamba_kernels=False, use_cache=False), _causal_lm_inputs),
    "pegasus": Case(_model("PegasusForConditionalGeneration", "PegasusConfig", **_SEQ2SEQ), _seq2seq_inputs,
                    seq2seq=True),
    "vit": Case(_model("ViTForImageClassification", "ViTConfig", hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, **_VIT), _images),
    "dinov2": Case(_model("Dinov2ForImageClassification", "Dinov2Config", hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, drop_path_rate=0.0, **_VIT), _images),
    "swin": Case(_model("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=4, embed_dim=16,
                        depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=5, drop_path_rate=0.0), _images),
    "convnext": Case(_model("ConvNextForImageClassification", "ConvNextConfig", num_stages=2, hidden_sizes=[8, 16],
                            depths=[1, 1], num_labels=5, drop_path_rate=0.0), _images),
    "siglip": Case(_model("SiglipForImageClassification", "SiglipConfig", num_labels=5, vision_config=dict(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64)), _images),
    # 2026-11-29 (session 40): more decoders, encoders and vision models
    "gemma3": Case(_decoder("Gemma3ForCausalLM", "Gemma3TextConfig", num_key_value_heads=2, head_dim=8,
                            sliding_window=4, layer_types=["sliding_attention", "full_attention"]), _causal_lm_inputs),
    "phi": Case(_decoder("PhiForCausalLM", "PhiConfig", resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
                _causal_lm_inputs),
    "stablelm": Case(_decoder("StableLmForCausalLM", "StableLmConfig", num_key_value_heads=2), _causal_lm_inputs),
    "starcoder2": Case(_decoder("Starcoder2ForCausalLM", "Starcoder2Config", num_key_value_heads=2,
                                residual_dropout=0.0, embedding_dropout=0.0), _causal_lm_inputs),
    "olmo2": Case(_decoder("Olmo2ForCausalLM", "Olmo2Config", num_key_value_heads=2), _causal_lm_inputs),
    "granite": Case(_decoder("GraniteForCausalLM", "GraniteConfig", num_key_value_heads=2, logits_scaling=2.0,
                             residual_multiplier=0.5, embedding_multiplier=2.0), _causal_lm_inputs),
    "glm4": Case(_decoder("Glm4ForCausalLM", "Glm4Config", num_key_value_heads=2, head_dim=8), _causal_lm_inputs),
    "smollm3": Case(_decoder("SmolLM3ForCausalLM", "SmolLM3Config", num_key_value_heads=2), _causal_lm_inputs),
    "nemotron": Case(_decoder("NemotronForCausalLM", "NemotronConfig", num_key_value_heads=2), _causal_lm_inputs),
    "cohere2": Case(_decoder("Cohere2ForCausalLM", "Cohere2Config", num_key_value_heads=2, sliding_window=4),
                    _causal_lm_inputs),
    "persimmon": Case(_decoder("PersimmonForCausalLM", "PersimmonConfig"), _causal_lm_inputs),
    "qwen3_moe": Case(_decoder("Qwen3MoeForCausalLM", "Qwen3MoeConfig", num_key_value_heads=2, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=16), _causal_lm_inputs),
    "gpt_bigcode": Case(_model("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_positions=64,
                               n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               **_special()),
                        _causal_lm_inputs),
    "codegen": Case(_model("CodeGenForCausalLM", "CodeGenConfig", vocab_size=VOCAB, n_positions=64, n_ctx=64,
                           n_embd=32, n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, **_special()), _causal_lm_inputs),
    "biogpt": Case(_encoder("BioGptForCausalLM", "BioGptConfig"), _causal_lm_inputs),
    "xglm": Case(_model("XGLMForCausalLM", "XGLMConfig", vocab_size=VOCAB, max_position_embeddings=64, d_model=32,
                        ffn_dim=64, num_layers=2, attention_heads=4, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, **_special()), _causal_lm_inputs),
    "deberta": Case(_encoder("DebertaForMaskedLM", "DebertaConfig"), _masked_lm_inputs),
    "mpnet": Case(_encoder("MPNetForMaskedLM", "MPNetConfig"), _masked_lm_inputs),
    "convbert": Case(_encoder("ConvBertForMaskedLM", "ConvBertConfig", embedding_size=32), _masked_lm_inputs),
    "esm": Case(_encoder("EsmForMaskedLM", "EsmConfig", position_embedding_type="rotary", mask_token_id=3),
                _masked_lm_inputs),
    "mbart": Case(_model("MBartForConditionalGeneration", "MBartConfig", **_SEQ2SEQ), _seq2seq_inputs, seq2seq=True),
    "beit": Case(_model("BeitForImageClassification", "BeitConfig", hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, drop_path_rate=0.0, use_relative_position_bias=True, **_VIT),
                 _images),
    "deit": Case(_model("DeiTForImageClassification", "DeiTConfig", hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, **_VIT), _images),
    "segformer": Case(_model("SegformerForImageClassification", "SegformerConfig", num_encoder_blocks=2, depths=[1, 1],
                             sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2],
                             num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=5, drop_path_rate=0.0,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0),
                      _images),
    "resnet": Case(_model("ResNetForImageClassification", "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                          depths=[1, 1], num_labels=5), _images),
    "regnet": Case(_model("RegNetForImageClassification", "RegNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                          depths=[1, 1], groups_width=4, num_labels=5), _images),
    "mobilevit": Case(_model("MobileViTForImageClassification", "MobileViTConfig", image_size=32,
                             hidden_sizes=[16, 24, 32],
                             neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_attention_heads=2, num_labels=5,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0),
                      _images),
    "focalnet": Case(_model("FocalNetForImageClassification", "FocalNetConfig", image_size=32, patch_size=4,
                            embed_dim=16, depths=[1, 1], focal_levels=[2, 2], focal_windows=[3, 3], num_labels=5,
                            drop_path_rate=0.0, hidden_dropout_prob=0.0), _images),
    # 2026-11-29 (session 40, second batch): hybrids, mixtures of experts, seq2seq and more vision
    "bamba": Case(_decoder("BambaForCausalLM", "BambaConfig", num_key_value_heads=2, mamba_n_heads=4,
                           mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, attn_layer_indices=[1], use_cache=False),
                  _causal_lm_inputs),
    "lfm2": Case(_decoder("Lfm2ForCausalLM", "Lfm2Config", num_key_value_heads=2,
                          layer_types=["conv", "full_attention"], use_cache=False), _causal_lm_inputs),
    "recurrent_gemma": Case(_decoder("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", num_key_value_heads=1,
                                     lru_width=32, attention_window_size=8, block_types=["recurrent", "attention"],
                                     use_cache=False), _causal_lm_inputs),
    "helium": Case(_decoder("HeliumForCausalLM", "HeliumConfig", num_key_value_heads=2, head_dim=8), _causal_lm_inputs),
    "olmo3": Case(_decoder("Olmo3ForCausalLM", "Olmo3Config", num_key_value_heads=2, sliding_window=4),
                  _causal_lm_inputs),
    "ernie4_5": Case(_decoder("Ernie4_5ForCausalLM", "Ernie4_5Config", num_key_value_heads=2, head_dim=8),
                     _causal_lm_inputs),
    "exaone4": Case(_decoder("Exaone4ForCausalLM", "Exaone4Config", num_key_value_heads=2, sliding_window=4),
                    _causal_lm_inputs),
    "phimoe": Case(_decoder("PhimoeForCausalLM", "PhimoeConfig", num_key_value_heads=2, num_local_experts=4,
                            num_experts_per_tok=2, router_jitter_noise=0.0), _causal_lm_inputs),  # no random routing
    "glm4_moe": Case(_decoder("Glm4MoeForCausalLM", "Glm4MoeConfig", num_key_value_heads=2, n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                              n_group=1, topk_group=1), _causal_lm_inputs),
    "xlnet": Case(_model("XLNetLMHeadModel", "XLNetConfig", vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4,
                         d_inner=64, dropout=0.0, **_special()), _causal_lm_inputs),
    "funnel": Case(_model("FunnelForMaskedLM", "FunnelConfig", vocab_size=VOCAB, d_model=32, n_head=4, d_head=8,
                          d_inner=64, block_sizes=[1, 1], hidden_dropout=0.0, attention_dropout=0.0,
                          activation_dropout=0.0), _masked_lm_inputs),
    "fnet": Case(_encoder("FNetForMaskedLM", "FNetConfig"), _masked_lm_inputs),
    "bigbird": Case(_encoder("BigBirdForMaskedLM", "BigBirdConfig", attention_type="original_full"), _masked_lm_inputs),
    "mt5": Case(_model("MT5ForConditionalGeneration", "MT5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                       num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, **_special()),
                _seq2seq_inputs, seq2seq=True),
    "convnextv2": Case(_model("ConvNextV2ForImageClassification", "ConvNextV2Config", num_stages=2,
                              hidden_sizes=[8, 16], depths=[1, 1], num_labels=5, drop_path_rate=0.0), _images),
    "mobilenet_v2": Case(_model("MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=32,
                                depth_multiplier=0.25, num_labels=5, classifier_dropout_prob=0.0), _images),
    "efficientnet": Case(_model("EfficientNetForImageClassification", "EfficientNetConfig", image_size=32,
                                width_coefficient=0.1, depth_coefficient=0.1, num_labels=5, dropout_rate=0.0,
                                drop_connect_rate=0.0, hidden_dim=128), _images),
    "pvt_v2": Case(_model("PvtV2ForImageClassification", "PvtV2Config", image_size=32, num_encoder_blocks=2,
                          depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2],
                          patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], num_labels=5, drop_path_rate=0.0),
                   _images),
    "levit": Case(_model("LevitForImageClassification", "LevitConfig", image_size=32, hidden_sizes=[16, 32],
                         num_attention_heads=[1, 2], depths=[1, 1], key_dim=[8, 8], mlp_ratio=[2, 2],
                         attention_ratio=[2, 2], down_ops=[["Subsample", 8, 2, 4, 2, 2]], num_labels=5), _images),
    "poolformer": Case(_model("PoolFormerForImageClassification", "PoolFormerConfig", num_encoder_blocks=2,
                              depths=[1, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2],
                              padding=[2, 1], num_labels=5, drop_path_rate=0.0), _images),
}


REFEREE_FACTOR = 4.0  # ours may be this many times eager float32's own distance from float64,
REFEREE_FLOOR = 1e-5  # or this far (the suite's own tolerance, over the values' largest magnitude)


def _scaled_errors(got: torch.nn.Module, out: Any, want: torch.nn.Module, want_out: Any) -> dict[str, float]:
    """Distance from float64's of the logits and of each gradient, each over its own largest
    magnitude (a gradient's at least 1e-3 of the largest of all: a gradient zero in exact arithmetic
    is rounding noise at any precision)."""
    errors = {"logits": ((out.logits.double() - want_out.logits).abs().max() / want_out.logits.abs().max()).item()}
    grads = {n: p.grad for n, p in want.named_parameters() if p.grad is not None}
    floor = 1e-3 * max(g.abs().max().item() for g in grads.values())
    for n, p in got.named_parameters():
        if n in grads and p.grad is not None:
            scale = max(grads[n].abs().max().item(), floor)
            errors[n] = (p.grad.double() - grads[n]).abs().max().item() / scale
    return errors


def referee(name: str, options: dict[str, Any]) -> str | None:
    """A training failure against eager float32, judged against float64: one step of ours, of eager
    float32 and of eager float64 from the failing run's weights (both seeded alike) and inputs. Where ours is within
    ``REFEREE_FACTOR`` times eager float32's own distance from float64, or within ``REFEREE_FLOOR``
    of float64, for the logits and for every gradient (each over its largest magnitude), the
    difference is float32's rounding (batch norms over a few values amplify it): the line says so,
    with the worst of both. None where ours is further."""
    import copy

    case = H.CASES[name]
    torch.manual_seed(0)
    model = H.build(name).train()
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    inputs = case.inputs()
    out = H.compile_model(model, options)(**inputs)
    want32 = eager(**inputs)
    want64 = exact(**{k: v.double() if v.is_floating_point() else v for k, v in inputs.items()})
    for value in (out, want32, want64):
        value.loss.backward()
    ours, theirs = _scaled_errors(model, out, exact, want64), _scaled_errors(eager, want32, exact, want64)
    if ours.keys() != theirs.keys() or any(ours[k] > max(REFEREE_FACTOR * theirs[k], REFEREE_FLOOR) for k in ours):
        return None
    grads = [k for k in ours if k != "logits"]
    worst = max(grads, key=lambda k: ours[k])
    return (f"float32 rounding: against float64, logits {ours['logits']:.1e} (eager float32 {theirs['logits']:.1e}), "
            f"worst gradient {ours[worst]:.1e} (eager float32 {theirs[worst]:.1e})")


def _judged(name: str, options: dict[str, Any]) -> str | None:
    """``referee``'s verdict; None (the failure stands) where the referee itself cannot run (a model
    without logits, say)."""
    try:
        return referee(name, options)
    except Exception:  # noqa: BLE001 - the eager float32 failure is what is reported then
        traceback.print_exc(limit=-4, file=sys.stderr)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="our generated kernels, through Triton's interpreter")
    parser.add_argument("--only", default="", help="comma-separated names")
    args = parser.parse_args()
    from torch._dynamo.utils import counters

    H.CASES.update(CASES)
    options = {"interpret": True} if args.interpret else {}
    mode = "interpreted" if args.interpret else "aten"
    for name in args.only.split(",") if args.only else CASES:
        for kind, check in (("inference", H.check_inference), ("training", H.check_training)):
            start = time.perf_counter()
            counters["cgtrees"].clear()
            torch._dynamo.reset()
            try:
                torch.manual_seed(0)  # the weights ``referee`` builds again
                check(name, options)
            except Exception as e:  # noqa: BLE001 - a failure is a line of the report
                why = _judged(name, options) if kind == "training" and isinstance(e, AssertionError) else None
                if why is None:
                    print(f"{name:15s} {kind:9s} {mode:11s} FAIL {type(e).__name__}: {str(e)[:400]}", flush=True)
                    traceback.print_exc(limit=-4, file=sys.stderr)
                else:
                    missed = str(e).splitlines()[0][:200]
                    print(f"{name:15s} {kind:9s} {mode:11s} ok   {why} (eager float32's tolerance missed: {missed})",
                          flush=True)
                continue
            seen = dict(counters["cgtrees"])
            graphs = f"{seen.get('graphs_compiled', 0)} (+{seen.get('graphs_loaded', 0)} from the cache)"
            print(f"{name:15s} {kind:9s} {mode:11s} ok   {time.perf_counter() - start:5.1f} s, graphs {graphs}, "
                  f"fallbacks {seen.get('graph_fallbacks', 0)}, kernels {seen.get('kernels_generated', 0)}", flush=True)


if __name__ == "__main__":
    main()
