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

# Qwen3-VL: the same parts, no default system turn.
QWEN3_VL_TEMPLATE = QWEN2_VL_TEMPLATE.replace(
    "{%- if loop.first and message['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}\n", "")

# Gemma 3: <start_of_turn>user / model, a system turn folded into the first user turn, text trimmed, each image
# part <start_of_image> (the processor widens it to \n\n<start_of_image><image_soft_token>*N<end_of_image>\n\n).
GEMMA3_TEMPLATE = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- if messages[0]['content'] is string %}{%- set first_user_prefix = messages[0]['content'] + '\n\n' %}
{%- else %}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}{%- endif %}
{%- set loop_messages = messages[1:] %}
{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
{%- if message['role'] == 'assistant' %}{%- generation %}
{%- if message['content'] is string %}{{- message['content'] | trim }}
{%- else %}{%- for item in message['content'] %}{%- if item['type'] == 'text' %}{{- item['text'] | trim }}{%- endif %}{%- endfor %}
{%- endif %}{{- '<end_of_turn>' }}{%- endgeneration %}{{- '\n' }}
{%- else %}
{%- if message['content'] is string %}{{- message['content'] | trim }}
{%- else %}{%- for item in message['content'] %}
{%- if item['type'] == 'image' %}{{- '<start_of_image>' }}
{%- elif item['type'] == 'text' %}{{- item['text'] | trim }}
{%- endif %}{%- endfor %}{%- endif %}
{{- '<end_of_turn>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"""

# SmolVLM (Idefics3): <|im_start|>User: ...<end_of_utterance>, a turn opening with an image has no space after
# the colon; each image part <image> (the processor widens it to <fake_token_around_image><global-img><image>*N
# <fake_token_around_image>).
SMOLVLM_TEMPLATE = r"""{{- '<|im_start|>' }}
{%- for message in messages %}
{{- message['role'] | capitalize }}
{%- if message['content'] is string %}{{- ': ' }}
{%- elif message['content'][0]['type'] == 'image' %}{{- ':' }}{%- else %}{{- ': ' }}{%- endif %}
{%- if message['role'] == 'assistant' %}{%- generation %}
{%- if message['content'] is string %}{{- message['content'] }}
{%- else %}{%- for line in message['content'] %}{%- if line['type'] == 'text' %}{{- line['text'] }}{%- endif %}{%- endfor %}
{%- endif %}{{- '<end_of_utterance>' }}{%- endgeneration %}{{- '\n' }}
{%- else %}
{%- if message['content'] is string %}{{- message['content'] }}
{%- else %}{%- for line in message['content'] %}
{%- if line['type'] == 'text' %}{{- line['text'] }}{%- elif line['type'] == 'image' %}{{- '<image>' }}{%- endif %}
{%- endfor %}{%- endif %}
{{- '<end_of_utterance>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}"""

# LLaVA 1.5: ROLE: , the turn's images first (<image>\n each; the processor repeats <image> once per patch), then
# its text parts each followed by a space; the assistant's answer ends with </s>.
LLAVA_TEMPLATE = r"""{%- for message in messages %}
{%- if message['role'] != 'system' %}{{- message['role'] | upper + ': ' }}{%- endif %}
{%- if message['content'] is string %}
{%- if message['role'] == 'assistant' %}{%- generation %}{{- message['content'] + '</s>' }}{%- endgeneration %}
{%- else %}{{- message['content'] + ' ' }}{%- endif %}
{%- else %}
{%- for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{- '<image>\n' }}{%- endfor %}
{%- if message['role'] == 'assistant' %}{%- generation %}
{%- for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{- content['text'] }}{%- endfor %}
{{- '</s>' }}{%- endgeneration %}
{%- else %}
{%- for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{- content['text'] + ' ' }}{%- endfor %}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"""

QWEN_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


# ----------------------------------------------------------------------------------------------- helpers


def base_tokenizer(specials: list[str], chat_template: str, named: dict[str, str] | None = None,
                   **token_kwargs):
    """The shipped byte-level tokenizer plus the family's special tokens (ids from 1024 up): ``named`` ones become
    tokenizer attributes (``tokenizer.image_token``, ...: some processors read them), then ``specials``;
    ``token_kwargs`` set bos/eos/pad."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BASE, extra_special_tokens=named or {}, **token_kwargs)
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in (named or {}).values()]})
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


def build_qwen2_vl(out: Path, variant: str = "qwen2_vl", initializer_range: float = 0.02) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = base_tokenizer(QWEN_VL_SPECIALS, QWEN2_VL_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIALS}
    im_end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    eos = [im_end, tok.eos_token_id]
    text = dict(vocab_size=len(tok), rope_parameters={**ROPE, "mrope_section": MROPE_SECTION}, bos_token_id=None,
                eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True, use_cache=True,
                **{**TEXT_SIZE, "initializer_range": initializer_range})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if variant == "qwen2_vl":
        vision = dict(depth=1, embed_dim=32, hidden_size=TEXT_SIZE["hidden_size"], num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, initializer_range=initializer_range)
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
        cls.__init__(self, image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__}).from_pretrained(path)


def build_qwen3_vl(out: Path) -> None:
    from transformers import Qwen3VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = base_tokenizer(QWEN_VL_SPECIALS, QWEN3_VL_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIALS}
    pad = tok.pad_token_id
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    # Qwen3-VL interleaves the (time, height, width) frequencies; the real split is 24/20/20 of 64.
    text = dict(vocab_size=len(tok), head_dim=16, rope_parameters={**ROPE, "mrope_section": [4, 2, 2],
                                                                    "mrope_interleaved": True},
                bos_token_id=None, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True, use_cache=True,
                **TEXT_SIZE)
    # 16 px patches, 2x2 merged: 32 px per image token; a 4x4 learned position grid (interpolated to each image).
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=TEXT_SIZE["hidden_size"],
                  num_heads=2, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, dtype="float32",
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    save_tokenizer(tok, out)
    save_config(cfg, out, eos, pad)
    # 56x56 -> 64x64 -> 2x2 = 4 image tokens, at most 128x128 -> 16 tokens.
    save_image_processor(Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16,
                                                  merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                                  image_std=[0.5] * 3), out)
    finish_folder(out, tok, "Qwen3VLProcessor")


def build_gemma3(out: Path) -> None:
    from transformers import Gemma3Config
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = base_tokenizer(["<bos>", "<start_of_turn>", "<end_of_turn>"], GEMMA3_TEMPLATE, named, bos_token="<bos>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in named.values()}
    pad, bos = tok.pad_token_id, tok.bos_token_id
    eos = [tok.convert_tokens_to_ids("<end_of_turn>"), tok.eos_token_id]
    # Sliding window then global attention, as Gemma 3's 5:1 pattern ends; the window is wider than the test rows.
    text = dict(vocab_size=len(tok), head_dim=16, query_pre_attn_scalar=16, sliding_window=512,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={"sliding_attention": dict(ROPE), "full_attention": dict(ROPE)},
                bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True, use_cache=True,
                **TEXT_SIZE)
    # SigLIP 56 px, 7 px patches: 8x8 patches average-pooled to 4x4 = 16 image tokens per image.
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=56, patch_size=7, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                       boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                       image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True, dtype="float32",
                       bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    save_tokenizer(tok, out)
    save_config(cfg, out, eos, pad)
    save_image_processor(Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, image_mean=[0.5] * 3,
                                                 image_std=[0.5] * 3, do_pan_and_scan=False), out)
    finish_folder(out, tok, "Gemma3Processor", {"image_seq_length": 16})


def build_smolvlm(out: Path) -> None:
    from transformers import Idefics3Config
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    specials = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
    tok = base_tokenizer(specials, SMOLVLM_TEMPLATE)
    pad = tok.pad_token_id
    eos = [tok.convert_tokens_to_ids("<end_of_utterance>"), tok.eos_token_id]
    text = dict(model_type="llama", vocab_size=len(tok), rope_parameters=dict(ROPE), bos_token_id=None,
                eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True, use_cache=True, **TEXT_SIZE)
    # 64 px, 8 px patches: 8x8 patches, pixel-shuffled by 2 -> 4x4 = 16 image tokens per image; no splitting.
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                  patch_size=8)
    cfg = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                         image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True,
                         dtype="float32", eos_token_id=eos, pad_token_id=pad)
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    save_tokenizer(tok, out)
    save_config(cfg, out, eos, pad)
    save_image_processor(Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 64},
                                                   max_image_size={"longest_edge": 64}, image_mean=[0.5] * 3,
                                                   image_std=[0.5] * 3), out)
    finish_folder(out, tok, "Idefics3Processor", {"image_seq_len": 16})


def build_llava(out: Path) -> None:
    from transformers import LlavaConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = base_tokenizer(["<image>", "</s>"], LLAVA_TEMPLATE)
    pad = tok.pad_token_id
    eos = [tok.convert_tokens_to_ids("</s>"), tok.eos_token_id]
    text = dict(model_type="llama", vocab_size=len(tok), rope_parameters=dict(ROPE), bos_token_id=None,
                eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True, use_cache=True, **TEXT_SIZE)
    # CLIP 56 px, 14 px patches: 4x4 = 16 patch features (the CLS one dropped) from the next-to-last layer.
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32)
    cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
                      image_seq_length=16, vision_feature_select_strategy="default", vision_feature_layer=-2,
                      tie_word_embeddings=True, dtype="float32")
    cfg.architectures = ["LlavaForConditionalGeneration"]
    save_tokenizer(tok, out)
    save_config(cfg, out, eos, pad)
    save_image_processor(CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}),
                         out)
    finish_folder(out, tok, "LlavaProcessor", {"patch_size": 14, "vision_feature_select_strategy": "default",
                                               "num_additional_image_tokens": 1, "image_token": "<image>"})


FAMILIES = {
    "tiny-qwen2-vl": build_qwen2_vl,
    "tiny-qwen2.5-vl": lambda out: build_qwen2_vl(out, "qwen2_5_vl"),
    "tiny-qwen3-vl": build_qwen3_vl,
    "tiny-gemma3": build_gemma3,
    "tiny-smolvlm": build_smolvlm,
    "tiny-llava": build_llava,
}
# The VLM quickstart's model: tiny-qwen2-vl with a 5x wider weight initialisation (0.1), with which the demo's SFT
# learns to read the dominant colour from the image within its steps (with 0.02 it answered one colour; docs/vlm.md).
DEMO_FOLDERS = {
    "tiny-qwen2-vl-demo": lambda out: build_qwen2_vl(out, initializer_range=0.1),
}


def build(models_dir: Path = MODELS_DIR, only: list[str] | None = None) -> None:
    for name, builder in {**FAMILIES, **DEMO_FOLDERS}.items():
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
