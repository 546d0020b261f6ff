"""``SDPOModule`` and its reprompts: each completion's teacher prompt shows another successful completion of its
group (reward >= ``success_reward_threshold``; never itself with ``dont_reprompt_on_self_success``) and/or the row's
feedback; a completion with neither keeps its prompt and is not distilled; the training loss is ``sdpo_loss`` of
the student's forward on ``[prompt, completion]`` and the teacher's on ``[teacher prompt, completion]``; knobs SDPO
cannot honour are refused naming them; the shipped config runs through the console script.

Mutations that fail these tests: a completion shown itself; the threshold compared with ``>``; the group taken
across group boundaries; the feedback shown despite ``environment_feedback_only_without_solution``; the teacher
forward on the student's prompt; the ``self_distillation_mask`` not scattered (every completion distilled)."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from datasets import Dataset

from helpers import console_script
from lightalign import PromptDataModule, SDPOModule
from lightalign.modules.losses.sdpo import sdpo_loss
from lightalign.modules.reference.teacher_context import RepromptKnobs, Reprompts
from lightalign.modules.training.logprobs import completion_logits

TEMPLATE = dict(reprompt_template="{prompt}|{solution}|{feedback}", solution_template="S:{successful_previous_attempt}",
                feedback_template="F:{feedback_raw}")


def test_reprompts_show_another_success_of_the_group_or_the_feedback():
    texts = ["a", "b", "c", "<think>x</think>d", "e", "f", "g", "h"]
    rewards = [0.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.99, float("nan")]  # the second group has no success
    feedback = ["fb0", None, None, None, "too long", "", None, None]  # fb0: its group has a success to show
    build = Reprompts(RepromptKnobs(**TEMPLATE, include_environment_feedback=True,
                                    environment_feedback_only_without_solution=True,
                                    remove_thinking_from_demonstration=True))
    out, active, stats = build(["P"] * 8, texts, rewards, feedback, group=4)
    assert out[:4] == ["P|S:b|", "P|S:d|", "P|S:b|", "P|S:b|"]
    assert out[4:] == ["P||F:too long", "P", "P", "P"] and active == [True] * 5 + [False] * 3
    assert stats == {"success_group_fraction": 0.5, "success_sample_fraction": 0.5, "feedback_used_fraction": 0.125,
                     "reprompt_sample_fraction": 0.625}
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "Q"}]
    out, active, _ = Reprompts(RepromptKnobs(**TEMPLATE, dont_reprompt_on_self_success=False))(
        [chat] * 2, ["x", "y"], [1.0, 0.0], ["fb", "fb"], group=2)
    assert out == [[chat[0], {"role": "user", "content": "Q|S:x|"}]] * 2 and active == [True, True]
    with pytest.raises(ValueError, match=r"solution_template must contain the placeholder\(s\) "):
        RepromptKnobs(solution_template="no slot")


def alternating_reward(prompts, completions, completion_ids, **kwargs):
    """1 for the first completion of each group of 2 (the rollout's even rows), 0 for the second: one success per
    group, by construction."""
    return [float(i % 2 == 0) for i in range(len(completions))]


@pytest.mark.parametrize("knobs, needle", [({"beta": 0.1}, "does not take beta"),
                                           ({"padding_free": True}, "does not take prompt_sharing / padding_free"),
                                           ({"distillation_weight": 1.5}, "distillation_weight must lie in [0, 1]")])
def test_knobs_sdpo_cannot_honour_are_refused(tiny_dir, knobs, needle):
    with pytest.raises(ValueError) as err:
        SDPOModule(str(tiny_dir), from_config=True, reward_funcs=[alternating_reward], **knobs)
    assert needle in str(err.value)


@pytest.mark.parametrize("knob, value", [("sync_ref_model", True), ("update_ref_model", True), ("max_staleness", 2),
                                         ("tools", [len])])
def test_knobs_of_groups_sdpo_drops_are_unknown(tiny_dir, knob, value):
    """SDPO does not take the reference sync, BEMA, sampling-ahead and tool groups (``takes_knobs(without=...)``):
    the generic unknown-knob refusal, naming the methods that take the knob (SDPO not among them)."""
    with pytest.raises(TypeError, match=f"SDPOModule has no knob '{knob}'; .*GRPOModule.* take it") as err:
        SDPOModule(str(tiny_dir), from_config=True, reward_funcs=[alternating_reward], **{knob: value})
    assert "SDPOModule take" not in str(err.value) and "A2POModule" not in str(err.value)


def test_teacher_reads_the_reprompt_and_the_loss_is_sdpo_loss_of_the_two_forwards(tiny_dir):
    module = SDPOModule(str(tiny_dir), from_config=True, reward_funcs=[alternating_reward], num_generations=2,
                        generation_batch_size=4, max_completion_length=4, learning_rate=5e-2, distillation_weight=0.5,
                        distillation_mode="topk_logits", distillation_topk=5, distillation_alpha=0.5,
                        steps_per_generation=2, **TEMPLATE)
    steps = []
    take = module.next_micro_batch

    def spy(batch):
        mb, slot = take(batch)
        t = module.hparams.temperature
        with torch.no_grad():
            student = completion_logits(module.model, mb) / t
            teacher_rows = {"prompt_ids": mb["teacher_prompt_ids"], "prompt_mask": mb["teacher_prompt_mask"],
                            "completion_ids": mb["completion_ids"], "completion_mask": mb["completion_mask"]}
            teacher = completion_logits(module.ref_model, teacher_rows) / t
            by_hand, _ = sdpo_loss(student, teacher, mb["completion_ids"], mb["completion_mask"],
                                   (mb["row"] % 2).float(), mb["advantages"], mb.get("old_logps"),
                                   distillation_weight=0.5, distill_config=module.distill_config,
                                   policy_config=module.loss_config, max_completion_length=4,
                                   num_items_in_batch=mb["completion_mask"].sum())
        steps.append({"mb": {k: v.clone() for k, v in mb.items()}, "by_hand": by_hand, "texts": module.rollout_text})
        return mb, slot

    module.next_micro_batch = spy
    step_loss = module.training_step

    def record(batch, batch_idx):
        loss = step_loss(batch, batch_idx)
        steps[-1]["loss"] = loss.detach()
        return loss

    module.training_step = record
    rows = [{"prompt": f"{a}+1="} for a in range(10, 14)]
    data = PromptDataModule(Dataset.from_list(rows), tokenizer=str(tiny_dir), max_prompt_length=32)
    L.seed_everything(5)
    L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, num_sanity_val_steps=0, max_steps=2, limit_val_batches=0).fit(module, data)
    tok = data.tokenizer
    for step in steps:
        mb = step["mb"]
        prompts, texts, _ = step["texts"]
        # each group of 2: its first completion succeeds and is shown to the second; the first is never shown itself,
        # so it keeps its own prompt and is not distilled
        assert torch.equal(mb["self_distillation_mask"], (mb["row"] % 2).float())
        for i, row in enumerate(mb["row"].tolist()):
            shown = tok.decode(mb["teacher_prompt_ids"][i][mb["teacher_prompt_mask"][i].bool()])
            own = tok.decode(mb["prompt_ids"][i][mb["prompt_mask"][i].bool()])
            assert own == prompts[row], (own, prompts[row])
            assert shown == (f"{prompts[row]}|S:{texts[row - 1]}|" if row % 2 else own), (row, shown)
        assert torch.allclose(step["loss"], step["by_hand"], rtol=1e-5, atol=1e-7), (step["loss"], step["by_hand"])


def test_console_script_fits_the_shipped_config(repo, tmp_path):
    out = console_script.run(repo, "fit", "--config", "configs/sdpo_quickstart.yaml", "--trainer.max_steps", "2",
                             "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                             "--plot.enabled", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
                             timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "teacher: the ema policy shown a successful completion" in out.stdout + out.stderr
    metrics = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert {"train/distillation_loss", "train/reprompt_sample_fraction", "val/reward/mean"} <= set(metrics), metrics
    assert (next(tmp_path.rglob("hf_model")) / "config.json").is_file()
