"""TRL 1.16's SDPO loss on fixed tensors, saved for tests/distill/test_self_distill_losses.py to compare with ours.

Regenerate by hand from the repository root, in the bench venv (TRL never enters the dev venv):

    OMP_NUM_THREADS=1 .venv-bench/bin/python bench/trl_parity/sdpo.py   # writes tests/fixtures/trl_sdpo_parity.pt

Nothing of lightalign is imported: the inputs are seeded tensors, the outputs are what TRL's own code returns.
``SDPOTrainer.compute_loss`` (a method) runs on a stand-in ``self`` carrying only what it reads: ``args`` (the
distillation knobs and ``distillation_weight``), TRL's own ``_compute_policy_loss`` and
``_compute_self_distillation_loss`` bound to the stand-in, and in place of the two model forwards the seeded logits
(``_compute_teacher_student_logits`` returns them with TRL's loss mask, ``completion_mask * self_distillation_mask``;
``_forward_logits`` the student's). Inputs: student/teacher logits ``[4, 5, 9]`` (already tempered), sampled ids,
completion mask with padding, a ``self_distillation_mask`` with one completion off, advantages, and the sampling
student's log-probs. Cases: ``distillation_weight`` 1, 0.5, 0; each ``distillation_mode``; ``loss_type`` grpo, bnpo,
dr_grpo, dapo; ``importance_sampling_level`` token and sequence; with and without the sampling log-probs (the
clipped importance weight and the policy ratio), ``distillation_is_clip`` 2.0 and None. Saved per case: the loss
and its gradient with respect to the student logits.

Reprompts: TRL's ``SuccessfulRolloutTeacherContextBuilder.build`` on a stand-in trainer (one process; completions
whose ids decode to fixed texts; its tokenisation replaced by a stub that records the teacher messages) for two
groups of 4 with rewards on both sides of ``success_reward_threshold``, string and conversational prompts, feedback
strings (one empty), under several settings of the reprompt knobs. Saved per setting: the teacher messages and the
``self_distillation_mask``.
"""

from __future__ import annotations

import functools
import os
import types
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from trl.experimental.sdpo.sdpo_config import SDPOConfig  # noqa: E402
from trl.experimental.sdpo.sdpo_trainer import (DistillationLogits, SDPOTrainer,  # noqa: E402
                                                 SuccessfulRolloutTeacherContextBuilder)

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "trl_sdpo_parity.pt"
MAX_COMPLETION_LENGTH = 7


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(51)
    b, t, v = 4, 5, 9
    student = torch.randn(b, t, v, generator=g) * 2.0
    teacher = torch.randn(b, t, v, generator=g) * 2.0
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 3:] = 0
    mask[3, 2:] = 0
    student_logps = torch.log_softmax(student, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = student_logps + torch.randn(b, t, generator=g) * 0.5
    return {"student_logits": student, "teacher_logits": teacher, "completion_ids": ids, "completion_mask": mask,
            "self_distillation_mask": torch.tensor([1.0, 1.0, 0.0, 1.0]),
            "advantages": torch.tensor([1.2, -0.7, 0.4, -1.1]), "old_logps": old}


def case(x, weight: float, mode: str, alpha: float, topk, clip, loss_type: str, level: str, with_old: bool) -> dict:
    args = types.SimpleNamespace(distillation_weight=weight, distillation_mode=mode, distillation_alpha=alpha,
                                 distillation_topk=topk, distillation_add_tail=False, distillation_is_clip=clip)
    stand_in = types.SimpleNamespace(
        args=args, use_teacher_server=False, teacher_model=None, current_gradient_accumulation_steps=1,
        model=types.SimpleNamespace(training=True), accelerator=types.SimpleNamespace(gather=lambda t: t),
        _metrics={"train": defaultdict(list)}, _log_self_distillation_metric=lambda mode, value: None,
        importance_sampling_level=level, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type,
        max_completion_length=MAX_COMPLETION_LENGTH)
    student = x["student_logits"].clone().requires_grad_(True)
    stand_in._compute_teacher_student_logits = lambda model, teacher, inputs: DistillationLogits(
        completion_ids=x["completion_ids"], completion_mask=x["completion_mask"],
        loss_mask=x["completion_mask"] * x["self_distillation_mask"].unsqueeze(1), student_logits=student,
        teacher_logits=x["teacher_logits"])
    stand_in._forward_logits = lambda model, input_ids, attention_mask, logits_to_keep: student
    stand_in._compute_policy_loss = functools.partial(SDPOTrainer._compute_policy_loss, stand_in)
    stand_in._compute_self_distillation_loss = functools.partial(SDPOTrainer._compute_self_distillation_loss,
                                                                 stand_in)
    batch = {"prompt_ids": torch.zeros(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1, dtype=torch.long),
             "completion_ids": x["completion_ids"], "completion_mask": x["completion_mask"],
             "advantages": x["advantages"], "self_distillation_mask": x["self_distillation_mask"]}
    if with_old:
        batch["old_per_token_logps"] = x["old_logps"]
    loss = SDPOTrainer.compute_loss(stand_in, stand_in.model, batch)
    loss.backward()
    return {"distillation_weight": weight, "distillation_mode": mode, "distillation_alpha": alpha,
            "distillation_topk": topk, "distillation_is_clip": clip, "loss_type": loss_type,
            "importance_sampling_level": level, "with_old": with_old, "loss": loss.detach(), "grad": student.grad}


REPROMPT_TEXTS = ["12", "<think>hm</think>13", "x", "14", "a", "b", "c", "d"]
REPROMPT_REWARDS = [0.0, 1.0, 0.5, 1.0, 0.2, 0.9, 0.0, 0.99]
REPROMPT_FEEDBACK = ["too short", None, "", "wrong", "off by one", None, "no digits", ""]
REPROMPT_SETTINGS = [
    {},
    {"dont_reprompt_on_self_success": False, "remove_thinking_from_demonstration": True},
    {"include_environment_feedback": True},
    {"include_environment_feedback": True, "environment_feedback_only_without_solution": True},
    {"use_successful_as_teacher": False, "include_environment_feedback": True},
    {"success_reward_threshold": 0.5, "reprompt_template": "[{prompt}]{feedback}{solution}"},
]


def reprompt_prompts() -> list:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "6+7="}]
    return ["11+1="] * 4 + [chat] * 4


def reprompt_case(settings: dict) -> dict:
    defaults = {f: SDPOConfig.__dataclass_fields__[f].default for f in (
        "use_successful_as_teacher", "success_reward_threshold", "dont_reprompt_on_self_success", "reprompt_template",
        "solution_template", "feedback_template", "include_environment_feedback",
        "environment_feedback_only_without_solution", "remove_thinking_from_demonstration", "max_reprompt_len")}
    args = types.SimpleNamespace(**{**defaults, **settings})
    texts = REPROMPT_TEXTS
    trainer = types.SimpleNamespace(
        args=args, num_generations=4, model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(device="cpu", process_index=0, gather=lambda t: t,
                                          pad_across_processes=lambda t, dim, pad_index: t),
        _tokenizer=types.SimpleNamespace(pad_token_id=0),
        processing_class=types.SimpleNamespace(decode=lambda ids, skip_special_tokens: texts[int(ids[0]) - 1]))
    builder = SuccessfulRolloutTeacherContextBuilder(trainer)
    seen = []

    def record(messages):
        seen.extend(messages)
        return {"prompt_ids": torch.zeros(len(messages), 1, dtype=torch.long),
                "prompt_mask": torch.ones(len(messages), 1, dtype=torch.long)}

    builder._tokenize_teacher_messages = record
    ids = torch.zeros(8, 2, dtype=torch.long)
    ids[:, 0] = torch.arange(1, 9)
    out = builder.build({"completion_ids": ids, "completion_mask": torch.ones(8, 2, dtype=torch.long)},
                        reprompt_prompts(), torch.tensor(REPROMPT_REWARDS), feedbacks=REPROMPT_FEEDBACK)
    return {"settings": settings, "teacher_messages": seen, "self_distillation_mask": out["self_distillation_mask"]}


def main() -> None:
    x = inputs()
    modes = (("sampled_token", 1.0, None), ("topk_logits", 0.5, 4), ("full_logits", 0.0, None))
    cases = []
    for mode, alpha, topk in modes:
        for clip in (2.0, None):
            cases.append(case(x, 1.0, mode, alpha, topk, clip, "dapo", "token", True))
        cases.append(case(x, 1.0, mode, alpha, topk, 2.0, "dapo", "token", False))
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for with_old in (True, False):
            cases.append(case(x, 0.5, "sampled_token", 1.0, None, 2.0, loss_type, "token", with_old))
            cases.append(case(x, 0.0, "sampled_token", 1.0, None, 2.0, loss_type, "token", with_old))
    cases.append(case(x, 0.5, "topk_logits", 0.5, 4, 2.0, "grpo", "sequence", True))
    cases.append(case(x, 0.0, "sampled_token", 1.0, None, 2.0, "grpo", "sequence", True))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    reprompts = {"prompts": reprompt_prompts(), "texts": REPROMPT_TEXTS, "rewards": REPROMPT_REWARDS,
                 "feedback": REPROMPT_FEEDBACK, "cases": [reprompt_case(s) for s in REPROMPT_SETTINGS]}
    torch.save({"inputs": x, "max_completion_length": MAX_COMPLETION_LENGTH, "cases": cases,
                "reprompts": reprompts}, OUT)
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
