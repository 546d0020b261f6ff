"""Tiny random configs of the model families lightalign is checked on (built at test time, no downloads).

Each entry is ``name -> (model_type, config kwargs)``. Every model has 2-4 layers of width 32-64 and a
vocabulary of ``VOCAB`` tokens. Windows, attention chunks and other token-count thresholds are ``WINDOW`` (6)
tokens, shorter than every test sequence (up to ~24 tokens), so a layout that ignores them gives other log-probs;
ALiBi variants put the positions into the attention scores instead of the embeddings. Hybrid entries mix layer
kinds (short convolutions, Mamba2 mixers, linear attention, a real-gated recurrence) with attention layers, so
every kind a layout has to keep apart is in the catalogue.

Dropout-type values (dropout, layer-drop, router / input jitter) are 0 in every entry: ``build`` sets every such
field the entry does not name to 0, whatever the family's default. Only the variants in ``DROPOUT_VARIANTS``
(``falcon-dropout``, ``opt-layerdrop``, ``mixtral-jitter``, ``phimoe-jitter``) name one, for the tests of
training-mode determinism.
"""

from __future__ import annotations

import re

import torch

VOCAB = 1024
WINDOW = 6
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0)
_TWO_KINDS = ["sliding_attention", "full_attention"]
_OPT = dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=32, max_position_embeddings=256, dropout=0.0)
_FALCON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
               attention_dropout=0.0)
_MIXTRAL = dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
_PHIMOE = dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
               mamba_chunk_size=16)
# LongRoPE: short factors up to original_max_position_embeddings tokens, long ones past it (one per frequency)
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.1, 1.2, 1.3],
                 long_factor=[1.5, 2.0, 3.0, 4.0])

FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(_DECODER)),
    "mistral": ("mistral", dict(_DECODER, sliding_window=None)),
    "mistral-sliding": ("mistral", dict(_DECODER, sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(_DECODER)),
    "qwen2-sliding": ("qwen2", dict(_DECODER, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                                    layer_types=_TWO_KINDS)),
    "qwen3": ("qwen3", dict(_DECODER, head_dim=8)),
    "qwen3_moe": ("qwen3_moe", dict(_DECODER, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0])),
    "mixtral": ("mixtral", dict(_MIXTRAL)),
    "gemma2": ("gemma2", dict(_DECODER, head_dim=8, sliding_window=4096, attn_logit_softcapping=None)),
    "gemma2-sliding": ("gemma2", dict(_DECODER, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=None)),
    "gemma3": ("gemma3_text", dict(_DECODER, head_dim=8, sliding_window=WINDOW, layer_types=_TWO_KINDS)),
    "phi3": ("phi3", dict(_DECODER, sliding_window=None, pad_token_id=0)),
    "phi3-sliding": ("phi3", dict(_DECODER, sliding_window=WINDOW, pad_token_id=0)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neox": ("gpt_neox", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256)),
    "opt": ("opt", dict(_OPT)),
    "falcon": ("falcon", dict(_FALCON, alibi=False)),
    "falcon-alibi": ("falcon", dict(_FALCON, alibi=True)),
    # eager attention (the user's attn_implementation) instead of lightalign's sdpa_varlen: the model's own masks
    "llama-eager": ("llama", dict(_DECODER, _attn="eager")),
    "opt-eager": ("opt", dict(_OPT, _attn="eager")),
    "bloom": ("bloom", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                            attention_dropout=0.0)),
    # --- dense decoders -------------------------------------------------------------------------------------
    "gemma": ("gemma", dict(_DECODER, head_dim=8)),
    "cohere": ("cohere", dict(_DECODER)),  # parallel attention + MLP, LayerNorm, logit scale
    "cohere2": ("cohere2", dict(_DECODER, head_dim=8, sliding_window=WINDOW, layer_types=_TWO_KINDS)),
    "olmo2": ("olmo2", dict(_DECODER)),  # norms after attention / MLP, QK norm
    "olmo3": ("olmo3", dict(_DECODER, sliding_window=WINDOW, layer_types=_TWO_KINDS)),  # rope per layer type
    "starcoder2": ("starcoder2", dict(_DECODER, sliding_window=WINDOW, residual_dropout=0.0, embedding_dropout=0.0)),
    "stablelm": ("stablelm", dict(_DECODER, partial_rotary_factor=0.25)),  # rope on a quarter of each head
    "granite": ("granite", dict(_DECODER, embedding_multiplier=2.0, attention_multiplier=0.5, residual_multiplier=0.5,
                                logits_scaling=2.0)),
    "phi": ("phi", dict(_DECODER, num_key_value_heads=4, partial_rotary_factor=0.5)),  # parallel block
    "gptj": ("gptj", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, rotary_dim=4)),
    "codegen": ("codegen", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, n_ctx=256,
                                rotary_dim=4)),
    "internlm3": ("internlm3", dict(_DECODER, head_dim=8)),
    "helium": ("helium", dict(_DECODER, head_dim=8)),
    # SmolLM3: NoPE layers (no_rope_layers[i] == 0 takes no rotary embedding)
    "smollm3": ("smollm3", dict(_DECODER, no_rope_layers=[1, 0], layer_types=["full_attention"] * 2)),
    "glm4": ("glm4", dict(_DECODER, head_dim=8, partial_rotary_factor=0.5)),
    "exaone4": ("exaone4", dict(_DECODER, sliding_window=WINDOW, layer_types=_TWO_KINDS)),
    "ministral": ("ministral", dict(_DECODER, head_dim=8, sliding_window=WINDOW, layer_types=_TWO_KINDS)),
    # Persimmon: partial rotary, QK layernorm, fused QKV
    "persimmon": ("persimmon", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=256, partial_rotary_factor=0.5)),
    # MPT: ALiBi positions from the 2D mask, no position embedding
    "mpt": ("mpt", dict(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256,
                        attn_config={"alibi": True})),
    # GPT-Neo: local attention (a window of WINDOW tokens) in every other layer, learned absolute positions
    "gpt_neo": ("gpt_neo", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                attention_types=[[["global", "local"], 1]], window_size=WINDOW,
                                max_position_embeddings=256)),
    # Phi-3 LongRoPE: 16 pretraining positions, 64 max: sequences past 16 tokens switch to the long factors
    "phi3-longrope": ("phi3", dict(_DECODER, sliding_window=None, pad_token_id=0, max_position_embeddings=64,
                                   original_max_position_embeddings=16, rope_parameters=dict(_LONGROPE))),
    # Llama 4: chunked attention (chunks of WINDOW tokens) on rope layers, a NoPE full-attention layer, MoE
    "llama4-chunked": ("llama4_text", dict(_DECODER, head_dim=8, num_hidden_layers=4, attention_chunk_size=WINDOW,
                                           num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                           intermediate_size_mlp=64, no_rope_layers=[1, 1, 1, 0],
                                           layer_types=["chunked_attention"] * 3 + ["full_attention"])),
    # --- MoE ------------------------------------------------------------------------------------------------
    "qwen2_moe": ("qwen2_moe", dict(_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])),
    "olmoe": ("olmoe", dict(_DECODER, num_experts=4, num_experts_per_tok=2)),
    # DeepSeek-V3: multi-head latent attention, grouped top-k routing, a dense first layer, a shared expert
    "deepseek_v3": ("deepseek_v3", dict(_DECODER, num_key_value_heads=4, moe_intermediate_size=16,
                                        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
    # gpt-oss: attention sinks, sliding / full layers, clamped SwiGLU experts
    "gpt_oss": ("gpt_oss", dict(_DECODER, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=WINDOW, layer_types=_TWO_KINDS, rope_parameters=dict(
                                    rope_type="default", rope_theta=10000.0))),
    "phimoe": ("phimoe", dict(_PHIMOE)),
    # --- hybrids --------------------------------------------------------------------------------------------
    # LFM2: gated short convolutions (a 3-token causal conv) between attention layers
    "lfm2": ("lfm2", dict(_DECODER, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                          block_auto_adjust_ff_dim=False)),
    # LFM2-MoE: the same with a dense first layer and MoE after it
    "lfm2_moe": ("lfm2_moe", dict(_DECODER, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                  moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                  num_dense_layers=1)),
    # Granite-4.0-H: Mamba2 mixers and an attention layer, MoE with a shared expert, no rope
    "granitemoehybrid": ("granitemoehybrid", dict(_DECODER, **_MAMBA2, layer_types=["linear_attention",
                                                                                   "full_attention"],
                                                  num_local_experts=4, num_experts_per_tok=2,
                                                  shared_intermediate_size=32)),
    # Bamba: Mamba2 layers and attention at attn_layer_indices (partial rotary)
    "bamba": ("bamba", dict(_DECODER, **_MAMBA2, attn_layer_indices=[1])),
    # Falcon-H1: attention and a Mamba2 mixer side by side in every layer
    "falcon_h1": ("falcon_h1", dict(_DECODER, **_MAMBA2, mamba_d_ssm=64, head_dim=8)),
    # Nemotron-H: one layer of each kind: Mamba2, MoE, attention, MLP
    "nemotron_h": ("nemotron_h", dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, intermediate_size=64, max_position_embeddings=256,
                                      layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                                      mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                                      chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)),
    # Zamba2: Mamba2 layers with one shared attention block reused at hybrid_layer_ids
    "zamba2": ("zamba2", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                              mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=4, mamba_ngroups=1,
                              chunk_size=16, hybrid_layer_ids=[1, 2], use_mem_rope=True,
                              layers_block_type=["linear_attention", "hybrid", "hybrid"])),
    # Qwen3-Next: gated DeltaNet linear attention and gated full attention, MoE with a shared expert
    "qwen3_next": ("qwen3_next", dict(_DECODER, head_dim=8, layer_types=["linear_attention", "full_attention"],
                                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                      linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    # RecurrentGemma: real-gated linear recurrences (RG-LRU) and local attention over WINDOW tokens
    "recurrent_gemma": ("recurrent_gemma", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                                head_dim=8, lru_width=32, attention_window_size=WINDOW,
                                                block_types=["recurrent", "recurrent", "attention"])),
    # --- dropout-type variants (training-mode determinism tests) --------------------------------------------
    "falcon-dropout": ("falcon", dict(_FALCON, alibi=False, hidden_dropout=0.1)),
    "opt-layerdrop": ("opt", dict(_OPT, layerdrop=0.5)),
    "mixtral-jitter": ("mixtral", dict(_MIXTRAL, router_jitter_noise=0.1)),
    "phimoe-jitter": ("phimoe", dict(_PHIMOE, router_jitter_noise=0.01)),
}
DROPOUT_VARIANTS = frozenset({"falcon-dropout", "opt-layerdrop", "mixtral-jitter", "phimoe-jitter"})
_DROPOUT = re.compile(r"dropout|pdrop|layerdrop|jitter")


def config(name: str):
    """The family's config (transformers ``AutoConfig``), dropout-type fields the entry does not name set to 0."""
    from transformers import AutoConfig

    model_type, kwargs = FAMILIES[name]
    kwargs = {k: v for k, v in kwargs.items() if k != "_attn"}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    for key, value in cfg.to_dict().items():
        if _DROPOUT.search(key) and key not in kwargs and isinstance(value, float) and value:
            setattr(cfg, key, 0.0)
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 0, 1, 2
    return cfg


def build(name: str, attn_implementation: str | None = None, seed: int = 0) -> torch.nn.Module:
    """The family's tiny random model in eval mode (float32, CPU), on ``sdpa`` where the family has it and
    ``eager`` otherwise (what ``from_pretrained`` picks by default), unless ``attn_implementation`` is given."""
    from transformers import AutoModelForCausalLM

    attn_implementation = attn_implementation or FAMILIES[name][1].get("_attn")
    cfg = config(name)
    torch.manual_seed(seed)
    for attn in [attn_implementation] if attn_implementation else ["sdpa", "eager"]:
        try:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
            break
        except ValueError:
            if attn_implementation:
                raise
    return model.eval()
