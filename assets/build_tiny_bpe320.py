#!/usr/bin/env python
"""Build ``assets/models/tiny-bpe320``: a tiny model whose tokenizer is NOT the shipped one (the student of
``configs/gold_quickstart.yaml``, whose teacher has the shipped tokenizer: cross-tokenizer distillation).

    python assets/build_tiny_bpe320.py            # writes assets/models/tiny-bpe320 (deterministic)
    python assets/build_tiny_bpe320.py OUT_DIR    # writes the same files into OUT_DIR

The tokenizer is byte-level BPE like the shipped one (cross-tokenizer ULD aligns byte spans, which needs byte-level
pieces) but trained with another split: digits in runs of up to three (``\\p{N}{1,3}``, as Llama 3 splits them,
where the shipped tokenizer isolates each digit) and only 320 tokens, so the two vocabularies share the 256 byte
tokens, the three special tokens and some merges, and differ in the rest (``12+7=19`` is ``12 + 7 = 1 9`` here,
``1 2 + 7 = 1 9`` for the student: 313 of the 320 token strings are the student's too). The model is ``tiny``'s shape as a Llama (``LlamaForCausalLM``: transformers
rebuilds a ``qwen2`` folder's tokenizer with Qwen2's own digit split, and keeps this one as saved), random weights
from the config; the folder has no weights (``from_config``), like every model under ``assets/models``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
OUT = ASSETS / "models" / "tiny-bpe320"
VOCAB_SIZE = 320
# The shipped split with digits grouped in runs of up to three instead of one by one.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)


def train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from build_assets import CORPUS, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def build(out: Path = OUT) -> Path:
    import shutil

    from build_assets import MODEL_SPECS, make_config, make_generation_config, wrap_tokenizer

    hf_tok = wrap_tokenizer(train_tokenizer())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    hf_tok.save_pretrained(out)
    cfg = make_config("llama", MODEL_SPECS["tiny-llama"][1], hf_tok)
    cfg.save_pretrained(out)
    make_generation_config(cfg).save_pretrained(out)
    return out


def verify(out: Path = OUT) -> None:
    from transformers import AutoTokenizer

    from tokenizers import Tokenizer

    tok = AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ("12+7=19", "What is 12 plus 7?", "naïve café ½", "<|im_start|>user\nhi<|im_end|>\n"):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == text, text
    assert tok.convert_ids_to_tokens(tok.encode("12+7=19", add_special_tokens=False)) == ["12", "+", "7", "=", "1", "9"]
    assert len(tok) == VOCAB_SIZE and tok.eos_token_id == 0


if __name__ == "__main__":
    sys.path.insert(0, str(ASSETS))
    target = build(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    verify(target)
    print(f"wrote {target}: {sorted(p.name for p in target.iterdir())}")
