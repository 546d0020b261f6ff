#!/usr/bin/env python
"""Rebuild everything under ``assets/models/`` from shipped text, then verify it.

    python assets/build_assets.py               # build + verify
    python assets/build_assets.py --no-verify   # build only

Steps (deterministic; no network):

1. Train a byte-level BPE tokenizer (vocab 1024 incl. specials, single-digit
   tokens) on ``assets/tokenizer_corpus.txt`` with the ``tokenizers`` library.
2. Wrap it in ``transformers.PreTrainedTokenizerFast`` with a ChatML chat template
   (assistant turns wrapped in ``{% generation %}`` for assistant-only masks) and
   save it into every model folder.
3. Write ``config.json`` + ``generation_config.json`` (no weights) for each tiny
   model; the project instantiates them with ``AutoModelForCausalLM.from_config``.
4. Verify: tokenizer round-trips, digits split, chat template + assistant mask are
   correct, every model builds, runs forward/generate, and save/load round-trips.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
CORPUS = ASSETS / "tokenizer_corpus.txt"
MODELS_DIR = ASSETS / "models"

VOCAB_SIZE = 1024
EOS = "<|endoftext|>"  # eos + pad
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]  # -> ids 0, 1, 2
MODEL_MAX_LENGTH = 2048
# Qwen2 / GPT-4-style split regex (copied from transformers' tokenization_qwen2.py).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML. Assistant content + <|im_end|> is inside {% generation %} so that
# apply_chat_template(..., return_assistant_tokens_mask=True) masks exactly those tokens.
# With ``tools=`` the tool list (one JSON schema a line) opens the system turn, an assistant's ``tool_calls`` are
# rendered after its content as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and a tool result is a
# ``tool`` turn; without tools every conversation renders exactly as before tools were added.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- 'Tools:\\n' }}"
    "{%- for tool in tools %}{{- (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{{- '\\n' }}{%- endfor %}"
    "{{- 'Call one as <tool_call>{\\\"name\\\": ..., \\\"arguments\\\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>' + {'name': call['name'], 'arguments': call['arguments']} | tojson + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# How transformers' ``tokenizer.parse_response`` reads an assistant turn of this template back into a message
# (``content`` and ``tool_calls``): the tool-calling rollouts parse the policy's calls with it.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

# name -> (architecture family, size kwargs)
MODEL_SPECS: dict[str, tuple[str, dict]] = {
    # ~1.0M params (tied embeddings)
    "tiny": ("qwen2", dict(hidden_size=128, intermediate_size=448, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)),
    "tiny-llama": ("llama", dict(hidden_size=128, intermediate_size=448, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2)),
    # ~30M params (tied embeddings)
    "small": ("qwen2", dict(hidden_size=512, intermediate_size=1920, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4)),
    # ~96M params (tied embeddings): the wider model of the benchmark suite (bench/suite.py)
    "medium": ("qwen2", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=8)),
}


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())  # byte-level: no unk token needed
    # Same normalizer / pre-tokenizer / decoder as transformers' Qwen2Tokenizer. This matters:
    # in transformers 5.x AutoTokenizer loads folders whose config.json says model_type=qwen2
    # with Qwen2Tokenizer, which REBUILDS this pipeline from vocab+merges and ignores the one
    # stored in tokenizer.json. Matching it exactly makes every loading path identical.
    # The regex isolates every digit (the "\\p{N}" alternative), i.e. one token per digit.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # No post-processor: no bos/eos are added automatically and offsets are untrimmed
    # (char_to_token, used for assistant masks, then works for every character).
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        response_template=RESPONSE_TEMPLATE,
    )


# --------------------------------------------------------------------------- configs


def make_config(family: str, size: dict, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    common = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        # Chat turns end with <|im_end|>, plain text with <|endoftext|>: stop on both.
        # Stored in config.json too because from_config() ignores generation_config.json.
        eos_token_id=[im_end_id, eos_id],
        pad_token_id=eos_id,
        use_cache=True,
        dtype="float32",
        **size,
    )
    if family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "llama":
        cfg = LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    else:
        raise ValueError(family)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def make_generation_config(cfg):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=None,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        do_sample=False,
    )


def build() -> None:
    tok = train_tokenizer()
    hf_tok = wrap_tokenizer(tok)
    print(f"tokenizer: vocab={len(hf_tok)} "
          + " ".join(f"{t}={hf_tok.convert_tokens_to_ids(t)}" for t in SPECIAL_TOKENS))
    for name, (family, size) in MODEL_SPECS.items():
        out = MODELS_DIR / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        hf_tok.save_pretrained(out)
        cfg = make_config(family, size, hf_tok)
        cfg.save_pretrained(out)
        make_generation_config(cfg).save_pretrained(out)
        print(f"wrote {out.relative_to(ASSETS.parent)}: {sorted(p.name for p in out.iterdir())}")
    from build_tool_families import build as build_tool_families  # tiny-llama3, tiny-mistral: from models/tiny

    build_tool_families()


# --------------------------------------------------------------------------- verify


def verify() -> dict[str, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tokenizers import Tokenizer

    torch.manual_seed(0)
    counts = {}
    probe_lines = CORPUS.read_text(encoding="utf-8").splitlines() + [
        "(hello) [world] {x}\n\n  indented\r\nline", "It's 3.14159!", "x=-12; y=+7", "naïve café ½ ² ٣",
        "<|im_start|>user\nhi<|im_end|>\n", "tabs\tand   spaces ", "emoji 🙂 ok", "",
    ]
    for name in MODEL_SPECS:
        path = MODELS_DIR / name
        tok = AutoTokenizer.from_pretrained(path)
        assert len(tok) == VOCAB_SIZE
        assert tok.bos_token is None and tok.eos_token == EOS and tok.pad_token == EOS and tok.unk_token is None
        assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
        assert tok.eos_token_id == tok.pad_token_id == 0
        assert tok.padding_side == "right" and tok.model_max_length == MODEL_MAX_LENGTH

        # Round trip + digit splitting.
        for s in ["Hello, world!  How are you?\n\tFine.", "12+7=19", " leading space", "héllo ünïcode ✓",
                  "What is 12 plus 7?", "def f(x):\n    return x * 2\n"]:
            ids = tok.encode(s, add_special_tokens=False)
            assert tok.decode(ids) == s, (s, tok.decode(ids))
        # Whatever class AutoTokenizer picked (Qwen2Tokenizer for qwen2 folders, TokenizersBackend
        # otherwise), it must tokenize exactly like the trained tokenizer.json.
        raw = Tokenizer.from_file(str(path / "tokenizer.json"))
        for s in probe_lines:
            assert tok.encode(s, add_special_tokens=False) == raw.encode(s, add_special_tokens=False).ids, s
        toks = tok.convert_ids_to_tokens(tok.encode("12+7=19", add_special_tokens=False))
        assert toks == ["1", "2", "+", "7", "=", "1", "9"], toks
        assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)

        # Chat template.
        msgs = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 12 plus 7?"},
            {"role": "assistant", "content": "12 plus 7 is 19."},
            {"role": "user", "content": "Reverse the word apple"},
            {"role": "assistant", "content": "elppa"},
        ]
        text = tok.apply_chat_template(msgs, tokenize=False)
        assert text == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n"
            "<|im_start|>assistant\n12 plus 7 is 19.<|im_end|>\n"
            "<|im_start|>user\nReverse the word apple<|im_end|>\n"
            "<|im_start|>assistant\nelppa<|im_end|>\n"
        ), repr(text)
        gp = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
        assert gp.endswith("<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n<|im_start|>assistant\n"), repr(gp)
        assert text.startswith(tok.apply_chat_template(msgs[:4], tokenize=False, add_generation_prompt=True))

        out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = out["input_ids"], out["assistant_masks"]
        assert len(ids) == len(mask)
        masked = [i for i, m in zip(ids, mask) if m]
        expected = (tok.encode("12 plus 7 is 19.", add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)]
                    + tok.encode("elppa", add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)])
        assert masked == expected, (tok.convert_ids_to_tokens(masked), tok.convert_ids_to_tokens(expected))
        assert tok.decode(masked) == "12 plus 7 is 19.<|im_end|>elppa<|im_end|>"
        # the rendered text tokenizes identically whether or not we asked for the mask
        assert ids == tok(text, add_special_tokens=False)["input_ids"]
        # batched + tensors
        bout = tok.apply_chat_template([msgs, msgs[:3]], tokenize=True, return_dict=True, padding=True,
                                       return_assistant_tokens_mask=True, return_tensors="pt")
        assert bout["assistant_masks"].shape == bout["input_ids"].shape
        assert bout["assistant_masks"][0].tolist() == mask

        # Model: from_config, forward, generate, save/load round trip.
        cfg = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_config(cfg)
        n = sum(p.numel() for p in model.parameters())
        counts[name] = n
        enc = tok(["12+7=", "What is 3 plus 4?"], return_tensors="pt", padding=True)
        with torch.no_grad():
            logits = model(**enc).logits
        assert logits.shape == (2, enc["input_ids"].shape[1], VOCAB_SIZE)
        prompt = tok.apply_chat_template(msgs[:2], add_generation_prompt=True, return_dict=True, return_tensors="pt")
        gen = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        assert gen.shape[1] <= prompt["input_ids"].shape[1] + 5
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            tok.save_pretrained(d)
            m2 = AutoModelForCausalLM.from_pretrained(d)
            t2 = AutoTokenizer.from_pretrained(d)
            with torch.no_grad():
                assert torch.allclose(m2(**enc).logits, logits)
            assert t2.chat_template == tok.chat_template and t2.get_vocab() == tok.get_vocab()
            assert m2.generation_config.eos_token_id == cfg.eos_token_id
        print(f"ok {name:11s} {cfg.model_type:6s} {type(tok).__name__:17s} params={n:,} ({n / 1e6:.2f}M)  "
              f"generate -> {tok.decode(gen[0, prompt['input_ids'].shape[1]:])!r}")
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args()
    build()
    if not args.no_verify:
        verify()


if __name__ == "__main__":
    main()
