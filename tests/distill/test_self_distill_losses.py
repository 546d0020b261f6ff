"""The self-distillation losses (modules/losses/self_distill.py) against TRL 1.16's own SDFT and SDPO loss code on
identical tensors (tests/fixtures/trl_sdft_parity.pt and trl_sdpo_parity.pt, written by bench/trl_parity/sdft.py and
sdpo.py in the bench venv), and the knob group's refusals.

Mutations that fail these tests: the divergence's direction swapped (``alpha`` read as ``1 - alpha``: the alpha 0
and 1 cases), the top-k support renormalised with the tail bucket too or not renormalised at all (the
``topk_logits`` cases), the importance weight dropped or not clipped (the clip cases), the reduction as one mean
over every kept token instead of per completion then over completions (every case: the completions keep different
token counts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightalign.modules.losses.self_distill import SelfDistillLossKnobs, self_distillation_loss

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _config(case: dict) -> SelfDistillLossKnobs:
    return SelfDistillLossKnobs(distillation_alpha=case["distillation_alpha"],
                                distillation_mode=case["distillation_mode"],
                                distillation_topk=case["distillation_topk"],
                                distillation_is_clip=case["distillation_is_clip"],
                                distillation_add_tail=case["distillation_add_tail"])


def _ours(x: dict, case: dict, mask: torch.Tensor):
    student = x["student_logits"].clone().requires_grad_(True)
    loss, stats = self_distillation_loss(student, x["teacher_logits"], x["completion_ids"], mask, _config(case),
                                         old_logps=x["old_logps"] if case["with_old"] else None)
    loss.backward()
    return loss.detach(), student.grad, stats["distillation_loss"]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # float32 arithmetic on O(1) values over a few hundred terms: a few ulps of the largest entry
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().max())))


def test_sdft_loss_matches_trl():
    saved = torch.load(FIXTURES / "trl_sdft_parity.pt", weights_only=True)
    x = saved["inputs"]
    assert len(saved["cases"]) == 18
    for case in saved["cases"]:
        loss, grad, logged = _ours(x, case, x["loss_mask"])
        label = {k: case[k] for k in ("distillation_mode", "distillation_alpha", "distillation_topk",
                                      "distillation_add_tail", "distillation_is_clip", "with_old")}
        assert float(case["loss"]) != 0.0, label
        assert _close(loss, case["loss"]), (label, float(loss), float(case["loss"]))
        assert _close(grad, case["grad"]), label
        assert _close(logged, case["logged"]), label


def test_sdft_teacher_prompts_match_trl():
    """SDFT's teacher prompts (``DemonstrationPrompts``) against TRL's ``DemonstrationTeacherContextBuilder`` for
    string and conversational prompts and string / message-list / other privileged contexts, two templates.
    Mutations: the placeholders swapped, a message list's texts joined by a space, the system message dropped --
    each fails."""
    from lightalign.modules.reference.teacher_context import DemonstrationPrompts, TeacherPromptKnobs

    saved = torch.load(FIXTURES / "trl_sdft_parity.pt", weights_only=True)["teacher_prompts"]
    assert len(saved["cases"]) == 2
    for case in saved["cases"]:
        build = DemonstrationPrompts(TeacherPromptKnobs(teacher_prompt_template=case["teacher_prompt_template"]))
        assert build(saved["prompts"], saved["contexts"]) == case["teacher_prompts"], case["teacher_prompt_template"]


@pytest.mark.parametrize("values, needle", [
    ({"distillation_mode": "sampled_token", "distillation_alpha": 0.5}, "needs distillation_alpha 1.0"),
    ({"distillation_mode": "topk_logits", "distillation_topk": None}, "set distillation_topk"),
    ({"distillation_alpha": 1.5}, "must lie in [0, 1]"),
    ({"distillation_mode": "logits"}, "distillation_mode must be one of"),
    ({"distillation_is_clip": 0.0}, "distillation_is_clip must be > 0"),
])
def test_knob_refusals_name_the_knob(values, needle):
    with pytest.raises(ValueError, ) as err:
        SelfDistillLossKnobs(**values)
    assert needle in str(err.value)


def test_sdpo_loss_matches_trl():
    """SDPO's objective (``sdpo_loss``: GRPO's policy term and the self-distillation term, mixed by
    ``distillation_weight``) against ``SDPOTrainer.compute_loss``. Mutations: the weights swapped (``w`` on the policy
    term), the ``self_distillation_mask`` ignored (every completion distilled), the policy term's old log-probs not
    passed (the ratio always 1) -- each fails a case."""
    from lightalign.modules.losses.grpo import GRPOLossConfig
    from lightalign.modules.losses.sdpo import sdpo_loss

    saved = torch.load(FIXTURES / "trl_sdpo_parity.pt", weights_only=True)
    x = saved["inputs"]
    assert len(saved["cases"]) == 27
    for case in saved["cases"]:
        label = {k: v for k, v in case.items() if k not in ("loss", "grad")}
        config = SelfDistillLossKnobs(distillation_alpha=case["distillation_alpha"],
                                      distillation_mode=case["distillation_mode"],
                                      distillation_topk=case["distillation_topk"],
                                      distillation_is_clip=case["distillation_is_clip"])
        policy = GRPOLossConfig(loss_type=case["loss_type"], epsilon=0.2, epsilon_high=0.28,
                                importance_sampling_level=case["importance_sampling_level"])
        student = x["student_logits"].clone().requires_grad_(True)
        loss, stats = sdpo_loss(student, x["teacher_logits"], x["completion_ids"], x["completion_mask"],
                            x["self_distillation_mask"], x["advantages"], x["old_logps"] if case["with_old"] else None,
                            distillation_weight=case["distillation_weight"], distill_config=config,
                            policy_config=policy, max_completion_length=saved["max_completion_length"])
        loss.backward()
        assert float(case["loss"]) != 0.0, label
        assert _close(loss.detach(), case["loss"]), (label, float(loss), float(case["loss"]))
        assert _close(student.grad, case["grad"]), label
        assert _close(stats["loss"], case["loss"]), label  # the logged loss (no loss_scale here)


def test_sdpo_reprompts_match_trl():
    """SDPO's teacher prompts (``Reprompts``) against TRL's ``SuccessfulRolloutTeacherContextBuilder.build`` for
    six settings of the reprompt knobs on string and conversational prompts (two groups of 4, rewards on both sides
    of the threshold, feedback with an empty string). Mutations: a completion shown itself, ``>`` for ``>=``, the
    feedback shown despite ``environment_feedback_only_without_solution``, the think block kept -- each fails a
    setting."""
    from lightalign.modules.reference.teacher_context import RepromptKnobs, Reprompts

    saved = torch.load(FIXTURES / "trl_sdpo_parity.pt", weights_only=True)["reprompts"]
    assert len(saved["cases"]) == 6
    for case in saved["cases"]:
        out, active, _ = Reprompts(RepromptKnobs(**case["settings"]))(
            saved["prompts"], saved["texts"], saved["rewards"], saved["feedback"], group=4)
        assert out == case["teacher_messages"], case["settings"]
        assert active == [bool(v) for v in case["self_distillation_mask"].tolist()], case["settings"]
