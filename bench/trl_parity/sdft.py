"""TRL 1.16's SDFT loss on fixed tensors, saved for tests/distill/test_self_distill_losses.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/sdft.py   # writes tests/fixtures/trl_sdft_parity.pt

Nothing of lightalign is imported: the inputs are seeded tensors, the outputs are what TRL's own code returns.
``SDFTTrainer._compute_self_distillation_loss`` (a method) is called on a stand-in ``self`` carrying only what it
reads (``args`` with the distillation knobs, ``accelerator.gather``, the metric logger) with student/teacher logits
``[3, 6, 11]`` (already tempered, as TRL's forward returns them), sampled ids, a loss mask with a prompt-skip, a
padding tail and one completion with no kept token, and, for the clipping cases, the sampling student's log-probs
(``old_per_token_logps``) chosen so that some ratios exceed the clip. Cases: every ``distillation_mode``; alpha 0,
0.5, 1 (``sampled_token``: 1 only, TRL refuses others); top-k 4 with and without ``distillation_add_tail``; top-k
equal to the vocabulary; ``distillation_is_clip`` 2.0 and 0.5 with old log-probs, and None. Saved per case: the
loss, its gradient with respect to the student logits, and TRL's logged ``distillation_loss``.

Teacher prompts: TRL's ``DemonstrationTeacherContextBuilder.select_generation_prompts`` (the prompts it tokenizes for
the teacher) on a stand-in trainer carrying ``args.teacher_prompt_template``, for string and conversational prompts
and privileged contexts given as a string, a list of messages (text and content-part lists) and a number, under
TRL's default template and another.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from trl.experimental.sdft.sdft_trainer import (DemonstrationTeacherContextBuilder,  # noqa: E402
                                                 DistillationLogits, SDFTTrainer)

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_sdft_parity.pt"


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2026)
    b, t, v = 3, 6, 11
    student = torch.randn(b, t, v, generator=g) * 2.0
    teacher = torch.randn(b, t, v, generator=g) * 2.5
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, :2] = 0  # num_loss_tokens_to_skip 2 on the first completion
    mask[1, 4:] = 0  # padding after the completion
    mask[2, :] = 0  # a completion with no kept token
    student_logps = torch.log_softmax(student, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = student_logps + torch.randn(b, t, generator=g) * 1.5  # ratios on both sides of the clips
    return {"student_logits": student, "teacher_logits": teacher, "completion_ids": ids, "loss_mask": mask,
            "old_logps": old}


def case(x, mode: str, alpha: float, topk, add_tail: bool, clip, with_old: bool) -> dict:
    logged = []
    args = types.SimpleNamespace(distillation_mode=mode, distillation_alpha=alpha, distillation_topk=topk,
                                 distillation_add_tail=add_tail, distillation_is_clip=clip)
    stand_in = types.SimpleNamespace(args=args, accelerator=types.SimpleNamespace(gather=lambda t: t),
                                     _log_self_distillation_metric=lambda mode, value: logged.append(value))
    student = x["student_logits"].clone().requires_grad_(True)
    logits = DistillationLogits(completion_ids=x["completion_ids"], loss_mask=x["loss_mask"], student_logits=student,
                                teacher_logits=x["teacher_logits"])
    batch = {"old_per_token_logps": x["old_logps"]} if with_old else {}
    loss = SDFTTrainer._compute_self_distillation_loss(stand_in, types.SimpleNamespace(training=True), batch, logits)
    loss.backward()
    return {"distillation_mode": mode, "distillation_alpha": alpha, "distillation_topk": topk,
            "distillation_add_tail": add_tail, "distillation_is_clip": clip, "with_old": with_old,
            "loss": loss.detach(), "grad": student.grad, "logged": torch.tensor(logged[0])}


PROMPTS = ["3+4=", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "5+6="}], "7-2="]
CONTEXTS = ["Answer: 7", [{"role": "assistant", "content": "11"},
                          {"role": "user", "content": [{"type": "text", "text": "check"}, {"type": "image"}]}], 5]
TEMPLATES = ["{prompt}\n\n{privileged_context}", "Hint: {privileged_context}. {prompt}"]


def teacher_prompt_cases() -> list[dict]:
    cases = []
    for template in TEMPLATES:
        trainer = types.SimpleNamespace(args=types.SimpleNamespace(teacher_prompt_template=template))
        composed = DemonstrationTeacherContextBuilder(trainer).select_generation_prompts(PROMPTS, CONTEXTS)
        cases.append({"teacher_prompt_template": template, "teacher_prompts": composed})
    return cases


def main() -> None:
    x = inputs()
    cases = []
    for alpha in (0.0, 0.5, 1.0):
        cases.append(case(x, "full_logits", alpha, None, False, None, False))
        for add_tail in (False, True):
            cases.append(case(x, "topk_logits", alpha, 4, add_tail, None, False))
    cases.append(case(x, "topk_logits", 0.5, 11, False, None, False))  # k = V: the full divergence
    cases.append(case(x, "sampled_token", 1.0, None, False, None, False))
    for clip in (2.0, 0.5):
        cases.append(case(x, "topk_logits", 0.5, 4, False, clip, True))
        cases.append(case(x, "sampled_token", 1.0, None, False, clip, True))
        cases.append(case(x, "full_logits", 0.0, None, False, clip, True))
    cases.append(case(x, "topk_logits", 0.5, 4, False, 2.0, False))  # a clip but no old log-probs: no weight
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"inputs": x, "cases": cases, "teacher_prompts": {"prompts": PROMPTS, "contexts": CONTEXTS,
                                                                 "cases": teacher_prompt_cases()}}, OUT)
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
