#!/usr/bin/env python
"""Write the tiny random-weight vision-language model folders under ``assets/models/``, from ``assets/models/tiny``.

    python assets/build_vlm_assets.py              # build every family + verify
    python assets/build_vlm_assets.py --no-verify  # build only
    python assets/build_vlm_assets.py --out DIR    # write the folders under DIR instead (the byte-identity test)

Each folder is what a Hugging Face VLM checkpoint holds minus the weights (the project builds models with
``AutoModelForImageTextToText.from_config``): ``config.json`` (a tiny language model: hidden 64, 2 layers, 4 heads /
2 KV heads; a tiny vision tower: 1 layer, hidden 32), ``generation_config.json``, the shipped byte-level tokenizer
plus the family's special tokens (image placeholder, vision start/end, ...), the family's chat template (rendering
conversational content parts ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` and plain string content the
way the real template does; assistant turns inside ``{% generation %}``), and the processor files with an image
budget giving few image tokens per image. Image processors are the PIL ones (no torchvision). Deterministic: a
rebuild is byte-identical.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
MODELS_DIR = ASSETS / "models"
BASE = MODELS_DIR / "tiny"

# The language model of every family (head_dim 16).
TEXT_SIZE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.02)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Qwen's multimodal rotary positions: head_dim / 2 = 8 frequencies split over (time, height, width).
MROPE_SECTION = [2, 3, 3]

# ----------------------------------------------------------------------------------------------- chat templates
# Qwen2-VL / Qwen2.5-VL: ChatML, a default system turn, each image part <|vision_start|><|image_pad|><|vision_end|>
# (the processor repeats <|image_pad|> once per merged patch).
QWEN2_VL_TEMPLATE = r"""{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
{%- if loop.first and message['role'] != 'system' %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}
{{- '<|im_start|>' + message['role'] + '\n' }}
{%- if message['role'] == 'assistant' %}{%- generation %}
{%- if message['content'] is string %}{{- message['content'] }}
{%- else %}{%- for content in message['content'] %}{%- if 'text' in content %}{{- content['text'] }}{%- endif %}{%- endfor %}
{%- endif %}{{- '<|im_end|>' }}{%- endgeneration %}{{- '\n' }}
{%- elif message['content'] is string %}{{- message['content'] + '<|im_end|>\n' }}
{%- else %}
{%- for content in message['content'] %}
{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}
{%- set image_count.value = image_count.value + 1 %}
{%- if add_vision_id %}{{- 'Picture ' + image_count.value | string + ': ' }}{%- endif %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif content['type'] == 'video' or 'video' in content %}
{%- set video_count.value = video_count.value + 1 %}
{%- if add_vision_id %}{{- 'Video ' + video_count.value | string + ': ' }}{%- endif %}
{{- '<|vision_start|><|video_pad|><|vision_end|>' }}
{%- elif 'text' in content %}{{- content['text'] }}
{%- endif %}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

QWEN_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


# ----------------------------------------------------------------------------------------------- helpers


def base_tokenizer(specials: list[str], chat_template: str):
    """The shipped byte-level tokenizer plus ``specials`` (appended in order: ids from 1024 up)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BASE)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = chat_template
    tok.response_template = None
    return tok


def save_tokenizer(tok, out: Path) -> None:
    tok.save_pretrained(out)
    config_file = out / "tokenizer_config.json"  # loading-time keys transformers writes back: not the asset's
    config = {k: v for k, v in json.loads(config_file.read_text()).items()
              if k not in ("is_local", "local_files_only", "response_template")}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_config(cfg, out: Path, eos: list[int], pad: int) -> None:
    from transformers import GenerationConfig

    cfg.save_pretrained(out)
    GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=pad, do_sample=False).save_pretrained(out)


def save_image_processor(ip, out: Path) -> None:
    """``preprocessor_config.json`` naming the PIL class itself: it then loads without torchvision and without the
    fallback warning."""
    ip.save_pretrained(out)
    path = out / "preprocessor_config.json"
    write_json(path, {**json.loads(path.read_text()), "image_processor_type": type(ip).__name__})


def finish_folder(out: Path, tok, processor_class: str, extra_processor: dict | None = None) -> None:
    """chat_template.jinja beside the tokenizer (the processor and the tokenizer both read it) + processor_config."""
    (out / "chat_template.jinja").write_text(tok.chat_template)
    write_json(out / "processor_config.json", {"processor_class": processor_class, **(extra_processor or {})})


# ----------------------------------------------------------------------------------------------- families


def build_qwen2_vl(out: Path, variant: str = "qwen2_vl") -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = base_tokenizer(QWEN_VL_SPECIALS, QWEN2_VL_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIALS}
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    eos = [im_end, tok.eos_token_id]
    text = dict(vocab_size=len(tok), rope_parameters={**ROPE, "mrope_section": MROPE_SECTION}, bos_token_id=None,
                eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True, use_cache=True, **TEXT_SIZE)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if variant == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=TEXT_SIZE["hidden_size"], num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        cfg = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, dtype="float32",
                            **tokens)
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=TEXT_SIZE["hidden_size"],
                      num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[0])
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, dtype="float32",
                               **tokens)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForConditionalGeneration")]
    save_tokenizer(tok, out)
    save_config(cfg, out, eos, pad)
    # 28 px per merged token; 56x56 -> 2x2 = 4 image tokens, at most 112x112 -> 16 tokens.
    save_image_processor(Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                                  merge_size=2, temporal_patch_size=2), out)
    finish_folder(out, tok, "Qwen2VLProcessor" if variant == "qwen2_vl" else "Qwen2_5_VLProcessor")


def load_processor(path: Path):
    """The folder's processor: ``AutoProcessor``, except where its class also takes a video processor and torchvision
    is missing (transformers 5.24's video processors all need it: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM). Then the
    same class without the ``video_processor`` argument: images and text are processed exactly as by the full
    processor, videos are refused."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    processor_class = json.loads((Path(path) / "processor_config.json").read_text())["processor_class"]
    import transformers

    cls = getattr(transformers, processor_class)
    if is_torchvision_available() or "video_processor" not in cls.get_attributes():
        return AutoProcessor.from_pretrained(path)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__}).from_pretrained(path)


FAMILIES = {
    "tiny-qwen2-vl": build_qwen2_vl,
}


def build(models_dir: Path = MODELS_DIR, only: list[str] | None = None) -> None:
    for name, builder in FAMILIES.items():
        if only and name not in only:
            continue
        out = models_dir / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        builder(out)
        print(f"wrote {name}: {sorted(p.name for p in out.iterdir())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=MODELS_DIR)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    build(args.out, args.only)


if __name__ == "__main__":
    main()
