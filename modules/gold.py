"""GOLD (General On-policy Logit Distillation): ``GOLDModule``, distillation from a teacher whose tokenizer and
vocabulary may differ from the student's.

``DistillModule``'s loop (the student samples a batch with probability ``lmbda``, else the data's completions are
used) with, under ``use_uld_loss``, a teacher that reads the student's text in its own tokens: each row's prompt and
completion are decoded by the student's tokenizer (special tokens kept) and tokenised again by the teacher's
(``token_alignment.teacher_rows``: the teacher's prompt, completion and EOS, with each completion token's byte span),
the teacher runs on its own rows, and the ULD loss (``uld_loss``) compares the two sides' distributions at the
positions the byte spans align. Without ``use_uld_loss`` it is ``DistillModule``'s GKD, and a teacher of another
vocabulary is refused as there.
"""

from __future__ import annotations

from typing import Any

import torch

from lightalign.knobs import takes_knobs
from lightalign.modules.distill import DistillModule
from lightalign.modules.losses.uld import ULDKnobs, uld_loss
from lightalign.modules.reference.token_alignment import byte_spans, is_byte_level, matched_vocabulary, teacher_rows
from lightalign.modules.rollout.offpolicy.component import update_mismatch_stats
from lightalign.modules.training.logprobs import completion_logits, selective_log_softmax

__all__ = ["GOLDModule"]


def left_pad(rows: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, max(1, longest)]`` ids and mask: at least one column, so a row's first completion token
    always has a position before it (a masked pad when its prompt is empty)."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def right_pad(rows: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    flipped, mask = left_pad([r[::-1] for r in rows], pad_token_id, device)
    return flipped.flip(1), mask.flip(1)


@takes_knobs(ULDKnobs, defaults={"top_p": 0.95, "vllm_server_port": 8001})  # GOLDConfig's defaults
class GOLDModule(DistillModule):
    """Distil a frozen teacher into the policy (the student) on the prompts of ``PromptDataModule``, across
    tokenizers with ``use_uld_loss``.

    TRL 1.16's ``GOLDTrainer`` (docs/gold.md): ``DistillModule``'s knobs and loop (``lmbda``, ``beta``,
    ``temperature`` 0.9 and ``max_completion_length`` 128 to sample; ``top_p`` 0.95 here, GOLD's default) and the ULD
    knobs (``ULDKnobs``). With ``use_uld_loss`` the teacher may have any byte-level BPE tokenizer
    (``teacher_tokenizer_name_or_path``, default the teacher's folder): it re-tokenises the student's prompt and
    completion text and runs on its own rows; the loss is ``uld_loss`` (``temperature`` then only samples:
    ``uld_student_temperature`` / ``uld_teacher_temperature`` divide the distributions) and ``beta`` is the hybrid
    loss's JSD. The rows are padded (``padding_free`` is refused: the two models run on different tokens), the
    completions come from the student or the data (``seq_kd`` is refused: the teacher would sample in its own
    tokens), and ``loss_type`` is ``gkd`` (``on_policy`` reads the teacher's log-prob of the student's tokens,
    which another vocabulary does not have). With ``use_vllm`` the student's engine samples as in
    ``DistillModule`` (the mismatch statistics are logged; ULD reads no sampler log-prob).

    Logged as ``DistillModule``: ``train/loss``, ``train/divergence`` (here the ULD distillation term before its
    weight), the sources, ``train/completions/mean_length``; ``val/divergence`` on the student's samples.
    """

    method_name = "GOLD (cross-tokenizer distillation)"
    takes_images = False  # ULD's teacher re-tokenises the prompts' text: no image prompts (check_image_prompts)
    teacher_tokenizer: Any = None
    matched: tuple[torch.Tensor, torch.Tensor] | None = None

    def check_knob_combinations(self) -> None:
        """With ``use_uld_loss``: ``loss_type`` gkd, no ``seq_kd``, no ``padding_free``, and a teacher tokenizer to
        read for a built teacher."""
        hp = self.hparams
        if hp.use_uld_loss:
            refused = [(hp.loss_type != "gkd", f"loss_type {hp.loss_type!r} (on_policy reads the teacher's log-prob "
                                               "of each student token, which another vocabulary does not have): use "
                                               "loss_type: gkd"),
                       (hp.seq_kd, "seq_kd (the teacher would sample in its own tokens): set seq_kd: false"),
                       (hp.padding_free, "padding_free (student and teacher run on different tokenisations, "
                                         "padded): leave padding_free unset"),
                       (self.knobs.teacher.teacher_model is not None and not hp.teacher_tokenizer_name_or_path,
                        "a built teacher_model without teacher_tokenizer_name_or_path (the teacher's tokenizer "
                        "cannot be told from it): name its tokenizer")]
            for bad, why in refused:
                if bad:
                    raise ValueError(f"use_uld_loss is on, which refuses {why}.")
        super().check_knob_combinations()

    def check_vocabularies(self) -> None:
        """ULD compares sorted distributions: any teacher vocabulary. Without it, ``DistillModule``'s refusal."""
        if not self.hparams.use_uld_loss:
            super().check_vocabularies()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        hp = self.hparams
        if not hp.use_uld_loss or self.teacher_tokenizer is not None:
            return
        from lightalign.hub import ModelNotFoundError, load_tokenizer

        knob = "teacher_tokenizer_name_or_path" if hp.teacher_tokenizer_name_or_path else "teacher_model_name_or_path"
        try:
            self.teacher_tokenizer = load_tokenizer(hp.get(knob), trust_remote_code=hp.trust_remote_code)
        except (ModelNotFoundError, OSError, ValueError) as err:  # named by the knob that gave the path, then raised
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"GOLDModule re-tokenises with the teacher's tokenizer, from {knob} "
                             f"{hp.get(knob)!r}, which cannot be loaded: {first}") from err
        if hp.use_extended_uld:
            for who, tokenizer in (("student", self.tokenizer), ("teacher", self.teacher_tokenizer)):
                if not is_byte_level(tokenizer):
                    raise ValueError(f"use_extended_uld aligns the two tokenisations on byte spans, which needs "
                                     f"byte-level BPE tokenizers; the {who}'s ({type(tokenizer).__name__}) is not. "
                                     "Set use_extended_uld: false (positions paired in order).")
        if hp.uld_use_hybrid_loss:
            self.matched = matched_vocabulary(self.tokenizer, self.teacher_tokenizer)

    def resolve_padding_free(self) -> tuple[bool, str | None]:
        if self.hparams.use_uld_loss:
            return False, "padded rows (use_uld_loss: the teacher runs on its own tokenisation)"
        return super().resolve_padding_free()

    def distill_loss(self, rows: dict[str, torch.Tensor], stats: torch.nn.ModuleDict | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``DistillModule``'s loss, or with ``use_uld_loss`` the ULD loss of the student's rows against the
        teacher's re-tokenisation of their text; rows a vLLM engine sampled (``sampling_logps``) log the
        engine-student mismatch in ``stats`` (the loss reads no sampler log-prob)."""
        if not self.hparams.use_uld_loss:
            return super().distill_loss(rows, stats)
        hp, student_tok, teacher_tok = self.hparams, self.tokenizer, self.teacher_tokenizer
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(rows["prompt_ids"], rows["prompt_mask"])]
        student_ids = [ids[mask.bool()].tolist() for ids, mask in zip(rows["completion_ids"],
                                                                      rows["completion_mask"])]
        decode = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
        prompts, completions, spans = teacher_rows(teacher_tok, student_tok.batch_decode(prompt_ids, **decode),
                                                   student_tok.batch_decode(student_ids, **decode),
                                                   spans=hp.use_extended_uld)
        pad = teacher_tok.pad_token_id
        teacher = dict(zip(("prompt_ids", "prompt_mask"), left_pad(prompts, pad, self.device)))
        teacher.update(zip(("completion_ids", "completion_mask"), right_pad(completions, pad, self.device)))
        with self.training_forward_context():
            student_logits = completion_logits(self.model, rows, through_last=True)
        with torch.no_grad():
            teacher_logits = completion_logits(self.teacher_eval(), teacher, through_last=True)
        if "sampling_logps" in rows and stats is not None:
            with torch.no_grad():
                own = selective_log_softmax(student_logits[:, :-1].detach() / hp.temperature, rows["completion_ids"])
            update_mismatch_stats(stats, own, rows["sampling_logps"].to(own.dtype), rows["completion_mask"].bool())
        loss, parts = uld_loss(
            student_logits, teacher_logits, student_ids, completions,
            [byte_spans(student_tok, ids) for ids in student_ids] if hp.use_extended_uld else None, spans,
            self.knobs.uld, beta=hp.beta, matched=self.matched,
            student_unpredicted_first=[not p for p in prompt_ids], teacher_unpredicted_first=[not p for p in prompts])
        return loss, parts["distillation"]
