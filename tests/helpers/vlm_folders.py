"""A tiny Qwen2-VL folder built in a temporary directory (tests that need a vision-language model before or
beside the shipped ones)."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_qwen2_vl(folder: Path, repo: Path) -> Path:
    """A tiny Qwen2-VL folder: the shipped tiny tokenizer with Qwen's vision tokens, a PIL image processor with a
    small pixel budget, and a random config."""
    from transformers import AutoTokenizer, Qwen2VLConfig

    tok = AutoTokenizer.from_pretrained(repo / "assets/models/tiny")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                                          "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessorPil", "min_pixels": 3136, "max_pixels": 12544,
         "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    ids = tok.convert_tokens_to_ids
    Qwen2VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok),
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_chans=3),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    ).save_pretrained(folder)
    return folder
