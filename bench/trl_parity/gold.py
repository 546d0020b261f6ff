"""TRL 1.16's cross-tokenizer GOLD pieces on fixed inputs, saved for tests/distill/test_uld_parity.py to compare with
ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/gold.py   # writes tests/fixtures/trl_gold_parity.pt

Nothing of lightalign is imported. The student's tokenizer is ``assets/models/tiny`` (byte-level BPE, 1024 tokens,
one token per digit), the teacher's ``assets/models/tiny-bpe320`` (byte-level BPE, 320 tokens, digits in runs of up
to three). Four prompt/completion pairs (ASCII and non-ASCII text, numbers the two split differently, one completion
without EOS as a truncated sample leaves it, one empty prompt so that the teacher's completion starts its sequence)
are laid out as TRL's on-policy path lays them out:

* student: the completion token ids (EOS appended except on the truncated one) after left-padded prompts, labels
  -100 on prompt and padding; the byte offsets from ``GOLDTrainer._maybe_add_completion_byte_offsets`` (called on a
  stand-in ``self``); the completion text decoded from the labelled tokens with special tokens kept;
* teacher: ``build_teacher_inputs_from_texts`` on the decoded prompt and completion texts (ids, labels, byte
  offsets);
* seeded logits of both vocabularies over both layouts; ``ULDLoss`` built from a stand-in config holding the knobs
  of each case, called as ``GOLDTrainer.compute_loss`` calls it. Saved per case: the knobs, the loss and its gradient
  with respect to the student's logits: which rows are nonzero, and those rows projected on a fixed formula
  matrix (``projection``; the logits are stored as float16 values): the file stays ~250 kB.

Cases: the defaults (observed merge, extended alignment, both EOS skipped), bayesian merge, positional ULD (both
strategies), each EOS kept, temperatures, the cross-entropy term, the hybrid loss (adaptive and fixed weights,
beta 0, 0.5, 1). Also saved: TRL's vocabulary mapping of the hybrid loss (teacher id -> student id).
"""

from __future__ import annotations

import os
import types
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
import trl  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl.experimental.gold.gold_trainer import GOLDTrainer, ULDLoss, build_teacher_inputs_from_texts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "trl_gold_parity.pt"
PROMPTS = ["12 plus 7?", "French:", "", "Add 345, 12."]
COMPLETIONS = ["12 plus 7 is 19.", " café ½ prix", "Paris 2024", "345+12=357"]
EOS_ON = [True, True, True, False]  # the last one was cut at max_completion_length: no EOS

DEFAULTS = dict(uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
                uld_teacher_temperature=1.0, uld_skip_student_eos=True, uld_skip_teacher_eos=True,
                use_extended_uld=True, uld_token_merge_strategy="observed", uld_use_hybrid_loss=False,
                uld_hybrid_matched_weight=None, uld_hybrid_unmatched_weight=None, beta=0.5)
CASES = [
    {},
    {"uld_token_merge_strategy": "bayesian"},
    {"use_extended_uld": False},
    {"use_extended_uld": False, "uld_token_merge_strategy": "bayesian"},
    {"uld_skip_student_eos": False},
    {"uld_skip_teacher_eos": False},
    {"uld_skip_student_eos": False, "uld_skip_teacher_eos": False, "uld_token_merge_strategy": "bayesian"},
    {"uld_student_temperature": 2.0, "uld_teacher_temperature": 0.5},
    {"uld_crossentropy_weight": 0.5, "uld_distillation_weight": 0.7},
    {"uld_use_hybrid_loss": True},
    {"uld_use_hybrid_loss": True, "uld_token_merge_strategy": "bayesian", "beta": 0.0},
    {"uld_use_hybrid_loss": True, "uld_hybrid_matched_weight": 0.7, "uld_hybrid_unmatched_weight": 0.3, "beta": 1.0},
]


def student_batch(tok) -> dict:
    """TRL's on-policy student layout of the pairs: left-padded prompts, right-padded completions, labels."""
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    completions = [tok(c, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if e else [])
                   for c, e in zip(COMPLETIONS, EOS_ON)]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width_p - len(p)) + p + c + [pad] * (width_c - len(c))
                              for p, c in zip(prompts, completions)])
    labels = torch.full_like(input_ids, -100)
    for i, c in enumerate(completions):
        labels[i, width_p:width_p + len(c)] = torch.tensor(c)
    texts = tok.batch_decode([c for c in completions], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    prompt_texts = tok.batch_decode(prompts, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    stand_in = types.SimpleNamespace(use_uld_loss=True, teacher_tokenizer=object(),
                                     uld_loss_fn=types.SimpleNamespace(use_extended_uld=True), _tokenizer=tok)
    slice_ = {"input_ids": input_ids, "labels": labels}
    GOLDTrainer._maybe_add_completion_byte_offsets(stand_in, slice_)
    return {"input_ids": input_ids, "labels": labels, "byte_offsets": slice_["byte_offsets"],
            "prompt_width": width_p, "completion_ids": completions, "prompt_texts": prompt_texts,
            "completion_texts": texts}


def case(knobs: dict, student: dict, teacher: dict, s_logits: torch.Tensor, t_logits: torch.Tensor, tokenizers):
    config = types.SimpleNamespace(**{**DEFAULTS, **knobs})
    loss_fn = ULDLoss(config, student_tokenizer=tokenizers[0], teacher_tokenizer=tokenizers[1])
    logits = s_logits.clone().requires_grad_(True)
    loss = loss_fn(student_logits=logits, teacher_logits=t_logits, student_labels=student["labels"],
                   teacher_labels=teacher["labels"], student_input_ids=student["input_ids"],
                   teacher_input_ids=teacher["input_ids"], student_byte_offsets=student["byte_offsets"],
                   teacher_byte_offsets=teacher["byte_offsets"])
    loss.backward()
    rows = logits.grad.abs().sum(-1) != 0
    out = {"knobs": knobs, "loss": loss.detach(), "grad_rows": rows, "grad_projected": projected(logits.grad[rows])}
    return out


def projection(width: int) -> torch.Tensor:
    """A fixed dense ``[width, 16]`` matrix from a formula (no RNG): the gradients' rows are saved projected on it
    (a few kB per case instead of the whole ``[rows, 1024]``; any change of a row moves its projection)."""
    v = torch.arange(1, width + 1, dtype=torch.float64)[:, None]
    k = torch.arange(1, 17, dtype=torch.float64)[None, :]
    return torch.cos(v * k * 0.6180339887)


def projected(grad: torch.Tensor) -> torch.Tensor:
    return grad.double() @ projection(grad.shape[-1])


def main() -> None:
    s_tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "models" / "tiny")
    t_tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "models" / "tiny-bpe320")
    student = student_batch(s_tok)
    ids, labels, _, offsets = build_teacher_inputs_from_texts(t_tok, student["prompt_texts"],
                                                              student["completion_texts"], use_extended_uld=True)
    teacher = {"input_ids": ids, "labels": labels, "byte_offsets": offsets}
    g = torch.Generator().manual_seed(4321)
    # float16-exact values, saved as float16 (half the file) and used as float32 on both sides
    s_logits = (torch.randn(*student["input_ids"].shape, len(s_tok), generator=g) * 2.0).half()
    t_logits = (torch.randn(*ids.shape, len(t_tok), generator=g) * 3.0).half()
    cases = [case(knobs, student, teacher, s_logits.float(), t_logits.float(), (s_tok, t_tok)) for knobs in CASES]
    mapping = ULDLoss(types.SimpleNamespace(**{**DEFAULTS, "uld_use_hybrid_loss": True}), s_tok, t_tok).mapping_tensor
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"trl_version": str(trl.__version__), "torch_version": str(torch.__version__),
                "prompts": PROMPTS, "completions": COMPLETIONS, "eos_on": EOS_ON,
                "student": student, "teacher": teacher, "student_logits": s_logits, "teacher_logits": t_logits,
                "mapping": mapping, "cases": cases}, OUT)
    print(f"TRL {trl.__version__}: {len(cases)} ULD cases -> {OUT} ({OUT.stat().st_size} bytes)")
    for c in cases:
        print(f"  {c['knobs']}: {c['loss'].item():.7f}")


if __name__ == "__main__":
    main()
