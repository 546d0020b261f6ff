"""Cross-tokenizer distillation's pieces (modules/losses/uld.py, modules/reference/token_alignment.py) against TRL
1.16's own ``ULDLoss``, ``build_teacher_inputs_from_texts`` and student byte offsets on identical inputs
(tests/fixtures/trl_gold_parity.pt, written by bench/trl_parity/gold.py in the bench venv): the student's tokenizer
is the shipped ``tiny`` one, the teacher's the shipped ``tiny-bpe320`` (another byte-level BPE vocabulary).

Mutations that fail these tests (each tried): ULD without sorting the probabilities (``sorted_l1`` on the unsorted
rows); a misaligned span (``byte_spans`` one byte short on multi-character pieces; ``align_spans`` closing a group on
the start instead of the end byte); the student's temperature applied to the teacher (wrong temperature); the
cross-entropy term dropped; ``observed`` reading the logits predicting the token (no shift); the hybrid loss's
adaptive weight from the student's vocabulary size.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from lightalign.modules.losses.uld import ULDKnobs, uld_loss
from lightalign.modules.reference.token_alignment import byte_spans, matched_vocabulary, teacher_rows

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "trl_gold_parity.pt"
ASSETS = Path(__file__).resolve().parents[2] / "assets" / "models"


@functools.cache
def fixture() -> dict:
    return torch.load(FIXTURE, weights_only=True)


@functools.cache
def tokenizers():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS / "tiny"), AutoTokenizer.from_pretrained(ASSETS / "tiny-bpe320")


def projection(width: int) -> torch.Tensor:
    """bench/trl_parity/gold.py's fixed matrix the gradients' rows are saved projected on."""
    v = torch.arange(1, width + 1, dtype=torch.float64)[:, None]
    k = torch.arange(1, 17, dtype=torch.float64)[None, :]
    return torch.cos(v * k * 0.6180339887)


def labelled(labels: torch.Tensor) -> list[torch.Tensor]:
    return [(row != -100).nonzero().flatten() for row in labels]


def teacher_side() -> tuple[list[list[int]], list[list[tuple[int, int]]], list[int]]:
    """TRL's teacher completion ids, byte offsets and answer starts, per row."""
    t = fixture()["teacher"]
    ids, spans, starts = [], [], []
    for i, positions in enumerate(labelled(t["labels"])):
        ids.append(t["input_ids"][i, positions].tolist())
        spans.append([tuple(x) for x in t["byte_offsets"][i, positions].tolist()])
        starts.append(int(positions[0]))
    return ids, spans, starts


def test_teacher_tokenisation_and_byte_spans_are_trls():
    """The teacher re-tokenises the student's decoded text as TRL does (prompt with its special tokens and no
    trailing EOS, completion plus the teacher's EOS), and both sides' byte spans are TRL's, non-ASCII text
    included; the hybrid loss's shared vocabulary is TRL's mapping."""
    f = fixture()
    s_tok, t_tok = tokenizers()
    student = f["student"]
    prompts, completions, spans = teacher_rows(t_tok, student["prompt_texts"], student["completion_texts"])
    ids, trl_spans, starts = teacher_side()
    assert completions == ids
    assert [len(p) for p in prompts] == starts
    assert spans == trl_spans
    for i, positions in enumerate(labelled(student["labels"])):
        ours = byte_spans(s_tok, student["completion_ids"][i])
        assert ours == [tuple(x) for x in student["byte_offsets"][i, positions].tolist()]
    teacher_ids, student_ids = matched_vocabulary(s_tok, t_tok)
    mapping = torch.full((int(teacher_ids.max()) + 1,), -1, dtype=torch.long)
    mapping[teacher_ids] = student_ids
    assert torch.equal(mapping, f["mapping"])
    assert len(teacher_ids) < len(t_tok) and len(teacher_ids) > 256  # the vocabularies differ, and overlap


def windows(logits: torch.Tensor, starts: list[int], sizes: list[int]) -> torch.Tensor:
    """``[B, max(size) + 1, V]``: row i's logits from the one predicting its first completion token (a zero row when
    the completion starts the sequence) to the one after its last."""
    rows = []
    width = max(sizes) + 1
    for i, (start, size) in enumerate(zip(starts, sizes)):
        row = logits[i, max(start - 1, 0):start + size]
        if start == 0:
            row = torch.cat([torch.zeros_like(logits[i, :1]), row])
        rows.append(torch.cat([row, row.new_zeros(width - row.shape[0], row.shape[1])]))
    return torch.stack(rows)


@pytest.mark.parametrize("index", range(12))
def test_uld_loss_and_gradient_match_trl(index):
    f = fixture()
    case = f["cases"][index]
    knobs = dict(case["knobs"])
    beta = knobs.pop("beta", 0.5)
    config = ULDKnobs(use_uld_loss=True, **knobs)
    s_tok, t_tok = tokenizers()
    student = f["student"]
    s_ids = student["completion_ids"]
    s_spans = [byte_spans(s_tok, ids) for ids in s_ids]
    t_ids, t_spans, t_starts = teacher_side()
    full = f["student_logits"].float().requires_grad_(True)
    width = student["prompt_width"]
    s_windows = windows(full, [width] * len(s_ids), [len(x) for x in s_ids])
    t_windows = windows(f["teacher_logits"].float(), t_starts, [len(x) for x in t_ids])
    matched = matched_vocabulary(s_tok, t_tok) if config.uld_use_hybrid_loss else None
    loss, stats = uld_loss(s_windows, t_windows, s_ids, t_ids, s_spans, t_spans, config, beta=beta, matched=matched,
                           teacher_unpredicted_first=[start == 0 for start in t_starts])
    loss.backward()
    assert loss.item() == pytest.approx(case["loss"].item(), rel=2e-6, abs=1e-7)
    rows = case["grad_rows"]  # TRL's nonzero rows; ours elsewhere are zero up to float32 rounding
    assert full.grad[~rows].abs().max().item() < 1e-7
    ours = full.grad[rows].double() @ projection(full.shape[-1])
    torch.testing.assert_close(ours, case["grad_projected"], rtol=1e-4, atol=1e-6)
    assert stats["distillation"].item() > 0


def test_every_main_knob_is_covered_and_changes_the_loss():
    """The fixture's cases set each main knob away from its default at least once, and each case's loss differs from
    the defaults' (but the teacher-EOS case: the teacher's EOS is zero bytes wide and its group is empty on the
    student's side, so extended ULD drops it, as TRL does)."""
    cases = fixture()["cases"]
    covered = set().union(*(c["knobs"] for c in cases))
    assert covered >= {"uld_token_merge_strategy", "use_extended_uld", "uld_skip_student_eos", "uld_skip_teacher_eos",
                       "uld_student_temperature", "uld_teacher_temperature", "uld_crossentropy_weight",
                       "uld_distillation_weight", "uld_use_hybrid_loss", "uld_hybrid_matched_weight", "beta"}
    default = cases[0]["loss"].item()
    moved = [c["loss"].item() != default for c in cases[1:]]
    assert moved == [c["knobs"] != {"uld_skip_teacher_eos": False} for c in cases[1:]]
