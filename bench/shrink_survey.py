"""Does ``shrink_config`` give a tiny, working probe model for every decoder-only causal LM of transformers?

For every model_type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: the family's real-size default config
(``AutoConfig.for_model``), shrunk with ``max_tokens=None``, built with ``AutoModelForCausalLM.from_config`` in
float32 (sdpa where the family has it, eager otherwise), and run forward on 48 tokens. Prints one row per family
(parameters, layers kept, shrink + build time, forward time, or the error) and the families skipped, with why.
Targets: under 3M parameters, forward under 0.5 s.

    OMP_NUM_THREADS=1 python bench/shrink_survey.py [--only llama,qwen2] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

PARAM_CAP, FORWARD_CAP = 3_000_000, 0.5

# Decoder halves of encoder-decoder models, and encoders with a causal-LM head (is_decoder flag): not
# decoder-only language models.
ENCODER_DECODER = {"bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
                   "plbart", "prophetnet", "trocr", "whisper"}
ENCODERS = {"bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
            "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta",
            "xlm-roberta-xl", "xmod"}
# Causal-LM entries that are not plain token-in decoders (pixels, audio codebooks, permutation LM).
NON_TEXT = {"moshi": "audio codebooks (Moshi)", "git": "image captioning model, needs pixel_values",
            "fuyu": "image+text model, needs image patches", "phi4_multimodal": "multimodal wrapper (audio/vision)",
            "musicgen": "audio-codebook decoder conditioned on a text encoder",
            "musicgen_melody": "audio-codebook decoder conditioned on a text encoder",
            "xlnet": "permutation language model (bidirectional with permutation masks)"}


# Families whose real-size default config cannot build or run a model in transformers itself, whatever the size
# (a field the code needs is None, or a default no checkpoint has): the survey patches the fields the released
# checkpoints set, and says so in its note.
DEFAULT_FIXES = {
    "hunyuan_v1_dense": ({"head_dim": 128}, "default head_dim=None"),
    "hunyuan_v1_moe": ({"head_dim": 128}, "default head_dim=None"),
    "ministral": ({"head_dim": 128}, "default head_dim=None"),
    "nemotron": ({"num_key_value_heads": 8}, "default num_key_value_heads=None"),
    "deepseek_v2": ({"num_experts_per_tok": 6}, "default num_experts_per_tok=None"),
    "dots1": ({"n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 2},
              "default expert counts None"),
    "dbrx": ({"attn_config": {"kv_n_heads": 8, "rope_theta": 500000.0, "clip_qkv": 8.0}},
             "default attn_config has no rope_theta and clip_qkv=None"),
    "cohere_compass_text": ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 50000.0}}},
                            "default rope_parameters={}"),
    "lfm2_moe": (lambda c: {"layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv"
                                            for i in range(c.num_hidden_layers)]}, "default layer_types=None"),
    "reformer": ({"is_decoder": True}, "a causal-LM head needs is_decoder=True"),
}
for _name in ("qwen4_exp", "qwen4_exp_text"):
    DEFAULT_FIXES[_name] = ({"indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 256,
                             "indexer_budget": 2048, "indexer_compress_ratio": 4}, "default indexer fields None")


def default_config(model_type: str):
    """``AutoConfig.for_model(model_type)``, with DEFAULT_FIXES applied (and the fix's note, or None)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    if model_type not in DEFAULT_FIXES:
        return config, None
    fix, why = DEFAULT_FIXES[model_type]
    fix = fix(config.get_text_config(decoder=True)) if callable(fix) else fix
    if config.get_text_config(decoder=True) is not config:
        fix = {"text_config": {**config.get_text_config(decoder=True).to_dict(), **fix}}
    return AutoConfig.for_model(model_type, **fix), f"default patched ({why})"


def default_fails(model_type: str) -> str | None:
    """Why the family's real-size default config cannot build a model (on the meta device, no memory), or None."""
    from transformers import AutoModelForCausalLM

    try:
        config, _ = default_config(model_type)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as error:
        return f"{type(error).__name__}: {' '.join(str(error).split())[:120]}"
    return None


def skip_reason(model_type: str, class_name: str) -> str | None:
    if model_type in ENCODER_DECODER:
        return "decoder of an encoder-decoder model"
    if model_type in ENCODERS:
        return "encoder model with a causal-LM head"
    if model_type in NON_TEXT:
        return NON_TEXT[model_type]
    if model_type.endswith("_assistant"):
        return "speculative-decoding drafter: runs on the main model's inputs_embeds and shared KV states"
    if class_name.endswith("ForConditionalGeneration"):
        return "multimodal wrapper (ForConditionalGeneration)"
    return None


def survey_one(model_type: str, max_tokens: int | None) -> dict:
    from transformers import AutoModelForCausalLM

    from lightalign.modules.adaptations.shrink import PROBE_LENGTH, shrink_config

    row: dict = {"model_type": model_type, "notes": []}
    start = time.perf_counter()
    config, patched = default_config(model_type)
    if patched:
        row["notes"].append(patched)
    shrunk, facts = shrink_config(config, max_tokens)
    row["layers"] = facts.get("layers", {})
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(shrunk, attn_implementation="sdpa", dtype=torch.float32)
    except (ValueError, ImportError):
        model = AutoModelForCausalLM.from_config(shrunk, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    row["build_s"] = time.perf_counter() - start
    row["params"] = sum(p.numel() for p in model.parameters())
    row["attn"] = model.config._attn_implementation
    vocab = shrunk.get_text_config(decoder=True).vocab_size
    ids = torch.randint(3, min(vocab, 200), (1, PROBE_LENGTH))
    start = time.perf_counter()
    with torch.no_grad():
        try:
            logits = model(input_ids=ids).logits
        except Exception:  # a family whose cache set-up fails: training forwards run without a cache
            logits = model(input_ids=ids, use_cache=False).logits
            row["notes"].append("forward only with use_cache=False")
    row["forward_s"] = time.perf_counter() - start
    if not torch.isfinite(logits).all():
        raise ValueError("non-finite logits")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    only = {m for m in args.only.split(",") if m}
    rows, failures, broken, skipped, over = [], [], [], [], []
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"{'model_type':26} {'params':>9} {'layers':>8} {'attn':>5} {'build s':>8} {'fwd s':>6}  note")
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if only and model_type not in only:
            continue
        if (reason := skip_reason(model_type, class_name)) is not None:
            skipped.append((model_type, reason))
            continue
        try:
            row = survey_one(model_type, args.max_tokens)
        except Exception as error:  # reported, not hidden
            if (why := default_fails(model_type)) is not None:
                broken.append((model_type, why))
                print(f"{model_type:26} {'BROKEN':>9}  the default config fails unshrunk too: {why}")
                continue
            failures.append((model_type, f"{type(error).__name__}: {' '.join(str(error).split())[:150]}"))
            print(f"{model_type:26} {'FAILED':>9}  {failures[-1][1]}")
            continue
        layers = row["layers"]
        note = list(row["notes"])
        targets = []
        if row["params"] >= PARAM_CAP:
            targets.append(f"over {PARAM_CAP / 1e6:.0f}M params")
        if row["forward_s"] >= FORWARD_CAP:
            targets.append(f"forward over {FORWARD_CAP} s")
        if targets:
            over.append((model_type, ", ".join(targets)))
        note += targets
        depth = f"{layers.get('from', '-')}>{layers.get('to', '-')}" if layers else "-"
        print(f"{model_type:26} {row['params']:>9,} {depth:>8} {row['attn'][:5]:>5} {row['build_s']:>8.2f} "
              f"{row['forward_s']:>6.3f}  {', '.join(note)}")
        rows.append(row)
    print(f"\n{len(rows)} built and ran, {len(failures)} failed, {len(broken)} with a default config that fails "
          f"unshrunk, {len(over)} over a target, {len(skipped)} skipped")
    for model_type, error in failures:
        print(f"  FAILED {model_type}: {error}")
    for model_type, error in broken:
        print(f"  BROKEN {model_type}: {error}")
    for model_type, note in over:
        print(f"  OVER   {model_type}: {note}")
    print("skipped:")
    for model_type, reason in skipped:
        print(f"  {model_type}: {reason}")


if __name__ == "__main__":
    main()
