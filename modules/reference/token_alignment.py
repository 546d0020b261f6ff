"""The teacher's tokenisation of the student's text, and how the two tokenisations line up (cross-tokenizer
distillation, ``GOLDModule`` with ``use_uld_loss``).

Both sides are described by the UTF-8 byte span ``(start, end)`` each completion token covers in the completion's
text. For a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM: every character of a token's piece stands for
one byte) a token's width is the length of its piece, so the spans are the running sums of the pieces' lengths
(``byte_spans``; TRL 1.16's ``piece_byte_len``). The teacher re-tokenises the student's decoded completion text and
gets an EOS of its own, zero bytes wide at the end (``teacher_rows``; TRL's ``build_teacher_inputs_from_texts``).

``align_spans`` walks both span lists and closes a group each time the two sides end on the same byte: the
positions where the tokenisations agree on a boundary (TRL's ``_align_by_byte_offsets``); tokens left over after
the last common boundary form one last group. ``merge_groups`` turns a group of several tokens into one
(unnormalised) distribution by the chain rule over the tokens actually written (TRL's
``_merge_probabilities_with_alignment_groups``): ``observed`` multiplies the first position's distribution by the
probabilities of the later tokens; ``bayesian`` multiplies the last position's distribution by those of the earlier
tokens. ``matched_vocabulary`` pairs the token strings the two vocabularies share (the hybrid loss compares those
directly).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["align_spans", "byte_spans", "is_byte_level", "matched_vocabulary", "merge_groups", "teacher_rows"]

# the floor of a token's probability in a merged group's product (TRL's)
MERGE_EPS = 1e-8


def is_byte_level(tokenizer: Any) -> bool:
    """Whether a (fast) tokenizer is byte-level BPE: its pre-tokenizer or decoder is ``ByteLevel``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and ("ByteLevel" in repr(backend.pre_tokenizer) or "ByteLevel" in repr(backend.decoder))


def byte_spans(tokenizer: Any, ids: list[int], start: int = 0) -> list[tuple[int, int]]:
    """The byte span of each token of ``ids`` in their text, from byte ``start``: the running sums of the
    pieces' lengths (one byte per character of a byte-level piece; a special token's piece is its text)."""
    spans = []
    for piece in tokenizer.convert_ids_to_tokens(list(ids)):
        spans.append((start, start + len(piece)))
        start += len(piece)
    return spans


def teacher_rows(tokenizer: Any, prompt_texts: list[str], completion_texts: list[str], spans: bool = True,
                 ) -> tuple[list[list[int]], list[list[int]], list[list[tuple[int, int]]]]:
    """The teacher's token ids of the student's prompts and completions: (prompt ids, completion ids + the
    teacher's EOS, the completion tokens' byte spans). A prompt is tokenised with the tokenizer's special tokens
    and without a trailing EOS; a completion without special tokens, then the teacher's EOS (zero bytes wide at the
    text's end). ``spans`` false: zero spans (positional ULD reads none)."""
    eos = tokenizer.eos_token_id
    prompts = tokenizer(list(prompt_texts), add_special_tokens=True)["input_ids"]
    prompts = [list(p[:-1]) if eos is not None and p and p[-1] == eos else list(p) for p in prompts]
    completions, offsets = [], []
    for text in completion_texts:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        row = byte_spans(tokenizer, ids) if spans else [(0, 0)] * len(ids)
        if eos is not None:
            end = len(text.encode("utf-8"))
            ids.append(eos)
            row.append((end, end) if spans else (0, 0))
        completions.append(ids)
        offsets.append(row)
    return prompts, completions, offsets


def align_spans(student: list[tuple[int, int]], teacher: list[tuple[int, int]],
                ) -> tuple[list[list[int]], list[list[int]]]:
    """Group the positions of two tokenisations of one text at their common token boundaries: (student groups,
    teacher groups), the ``g``-th groups covering the same bytes. The side whose current token ends first
    advances; equal ends close a group. What is left after the last common end is one last group on each side
    (possibly empty on one)."""
    s_groups, t_groups = [], []
    s = t = s_first = t_first = 0
    while s < len(student) and t < len(teacher):
        s_end, t_end = student[s][1], teacher[t][1]
        s += s_end <= t_end
        t += t_end <= s_end
        if s_end == t_end:
            s_groups.append(list(range(s_first, s)))
            t_groups.append(list(range(t_first, t)))
            s_first, t_first = s, t
    if s < len(student) or t < len(teacher):
        s_groups.append(list(range(s_first, len(student))))
        t_groups.append(list(range(t_first, len(teacher))))
    return s_groups, t_groups


def merge_groups(probs: torch.Tensor, groups: list[list[int]], ids: list[int], strategy: str) -> torch.Tensor:
    """One distribution per group ``[len(groups), V]`` from per-position distributions ``probs [n, V]``: a single
    token's is its position's; several tokens' is, by ``strategy``, the first (``observed``) or last
    (``bayesian``) position's distribution times the probabilities (floored at 1e-8) the other positions give the
    tokens written there (``ids``). No groups: ``probs`` itself."""
    if not groups:
        return probs
    rows = []
    for group in groups:
        if not group:
            rows.append(torch.zeros_like(probs[0]))
            continue
        base, others = (group[-1], group[:-1]) if strategy == "bayesian" else (group[0], group[1:])
        product = 1.0
        for position in others:
            product = product * probs[position, ids[position]].clamp_min(MERGE_EPS)
        rows.append(probs[base] * product if others else probs[base])
    return torch.stack(rows)


def matched_vocabulary(student_tokenizer: Any, teacher_tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The token strings both vocabularies have: (their teacher ids in increasing order, the student id of each).
    Raises ``ValueError`` when there are none (the hybrid loss then has nothing to compare directly)."""
    student = student_tokenizer.get_vocab()
    pairs = sorted((t_id, student[token]) for token, t_id in teacher_tokenizer.get_vocab().items() if token in student)
    if not pairs:
        raise ValueError("uld_use_hybrid_loss compares the tokens the student's and the teacher's vocabularies share, "
                         "and these share none: set uld_use_hybrid_loss: false.")
    teacher_ids, student_ids = zip(*pairs)
    return torch.tensor(teacher_ids, dtype=torch.long), torch.tensor(student_ids, dtype=torch.long)
