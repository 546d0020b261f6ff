"""Tiny random configs of the model families lightalign is checked on (built at test time, no downloads).

Each entry is ``name -> (model_type, config kwargs)``. Sliding-window variants use a window of 6 tokens, shorter
than every test sequence, so a layout that ignores the window gives other log-probs; ALiBi variants put the
positions into the attention scores instead of the embeddings. Every model has 2 layers of width 32.
"""

from __future__ import annotations

import torch

VOCAB = 1024
WINDOW = 6
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0)
_TWO_KINDS = ["sliding_attention", "full_attention"]

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
    "mixtral": ("mixtral", dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "gemma2": ("gemma2", dict(_DECODER, head_dim=8, sliding_window=4096, attn_logit_softcapping=None)),
    "gemma2-sliding": ("gemma2", dict(_DECODER, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=None)),
    "gemma3": ("gemma3_text", dict(_DECODER, head_dim=8, sliding_window=WINDOW, layer_types=_TWO_KINDS)),
    "phi3": ("phi3", dict(_DECODER, sliding_window=None, pad_token_id=0)),
    "phi3-sliding": ("phi3", dict(_DECODER, sliding_window=WINDOW, pad_token_id=0)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neox": ("gpt_neox", dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256)),
    "opt": ("opt", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                        word_embed_proj_dim=32, max_position_embeddings=256, dropout=0.0)),
    "falcon": ("falcon", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              alibi=False, hidden_dropout=0.0, attention_dropout=0.0)),
    "falcon-alibi": ("falcon", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    alibi=True, hidden_dropout=0.0, attention_dropout=0.0)),
    # eager attention (the user's attn_implementation) instead of lightalign's sdpa_varlen: the model's own masks
    "llama-eager": ("llama", dict(_DECODER, _attn="eager")),
    "opt-eager": ("opt", dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                              word_embed_proj_dim=32, max_position_embeddings=256, dropout=0.0, _attn="eager")),
    "bloom": ("bloom", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                            attention_dropout=0.0)),
}


def build(name: str, attn_implementation: str | None = None, seed: int = 0) -> torch.nn.Module:
    """The family's tiny random model in eval mode (float32, CPU), on ``sdpa`` where the family has it and
    ``eager`` otherwise (what ``from_pretrained`` picks by default), unless ``attn_implementation`` is given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = FAMILIES[name]
    kwargs = dict(kwargs)
    attn_implementation = attn_implementation or kwargs.pop("_attn", None)
    config = AutoConfig.for_model(model_type, **kwargs)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    torch.manual_seed(seed)
    for attn in [attn_implementation] if attn_implementation else ["sdpa", "eager"]:
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
            break
        except ValueError:
            if attn_implementation:
                raise
    return model.eval()
