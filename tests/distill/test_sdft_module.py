"""``SDFTModule`` and its teacher prompts: the teacher reads ``[teacher prompt, the student's completion]`` where
the teacher prompt is the row's prompt with its privileged context; the student samples from its own prompt (the
teacher's with ``generate_from_teacher``); the loss is the self-distillation loss of those two forwards with the
first ``num_loss_tokens_to_skip`` tokens left out; the teacher is the initial policy (``base``) or follows the
policy (``ema``, here at rate 1: a copy after every step); rows without a privileged context, or conversations not
ending with the user, are refused naming the row and the column; the shipped config runs through the console script.

Mutations that fail these tests: the teacher forward on the student's rows (or the student's on the teacher's);
the template's placeholders swapped; ``generate_from_teacher`` ignored; the skipped tokens kept; the EMA callback
not added (the teacher stays the initial policy); the base teacher not a copy (it moves with the policy); the
privileged-context check dropped (a KeyError mid-rollout instead of the row's name)."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from datasets import Dataset

from helpers import console_script
from lightalign import PromptDataModule, SDFTModule
from lightalign.datamodules.formats import DataFormatError
from lightalign.modules.losses.self_distill import self_distillation_loss
from lightalign.modules.reference.teacher_context import (DemonstrationPrompts, TeacherPromptKnobs,
                                                          check_prompt_rows)
from lightalign.modules.training.logprobs import completion_logits

ROWS = [{"prompt": f"{a}+{a}=", "privileged_context": f"Answer: {2 * a}"} for a in range(10, 18)]


def test_teacher_prompts_put_the_context_into_the_template():
    build = DemonstrationPrompts(TeacherPromptKnobs(teacher_prompt_template="Q {prompt} | hint {privileged_context}"))
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
    context = [{"role": "assistant", "content": "2"}, {"role": "assistant", "content": [{"type": "text", "text": "!"}]}]
    assert build(["1+1=", chat], ["Answer: 2", context]) == [
        "Q 1+1= | hint Answer: 2",
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q 1+1= | hint 2\n!"}]]
    with pytest.raises(ValueError, match=r"teacher_prompt_template must contain the placeholder\(s\) "
                                         r"\{privileged_context\}"):
        TeacherPromptKnobs(teacher_prompt_template="{prompt} only")
    with pytest.raises(ValueError, match="is not a template of"):
        TeacherPromptKnobs(teacher_prompt_template="{prompt} {privileged_context} {answer}")


@pytest.mark.parametrize("rows, needle", [
    ([{"prompt": "1+1="}], "the training data has ['prompt']"),
    ([{"prompt": "1+1=", "privileged_context": "2"}, {"prompt": "2+2=", "privileged_context": None}],
     "row 1 has no column 'privileged_context'"),
    ([{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
       "privileged_context": "c"}], "training row 0, column 'prompt'"),
])
def test_rows_a_teacher_prompt_cannot_be_made_of_are_refused_by_row_and_column(rows, needle):
    with pytest.raises(DataFormatError) as err:
        check_prompt_rows(Dataset.from_list(rows), "training", True, "SDFT")
    assert needle in str(err.value)


def test_fit_refuses_rows_without_privileged_context_before_any_rollout(tiny_dir):
    rows = [dict(r) for r in ROWS]
    rows[3]["privileged_context"] = None
    module = SDFTModule(str(tiny_dir), from_config=True, num_generations=2, generation_batch_size=4,
                        max_completion_length=4)
    module.rollout = None  # a rollout would fail with a TypeError, not the refusal
    data = PromptDataModule(Dataset.from_list(rows), tokenizer=str(tiny_dir), max_prompt_length=32)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, max_steps=1, limit_val_batches=0)
    with pytest.raises(DataFormatError, match="row 3 has no column 'privileged_context'"):
        trainer.fit(module, data)


class Spy:
    """Records each training rollout's rows, the batch the sampler saw, and the loss recomputed by hand."""

    def __init__(self, module: SDFTModule) -> None:
        self.steps: list[dict] = []
        rollout, distill, sample = module.rollout, module.distill, module.sampling.sample

        def spy_sample(model, tokenizer, batch, n, **kw):
            self.sampled_prompts = list(batch["prompts"])
            return sample(model, tokenizer, batch, n, **kw)

        def spy_distill(student, teacher):
            loss, stats, logits = distill(student, teacher)
            with torch.no_grad():
                t = module.hparams.temperature
                teacher_model = module.ref_model if module.ref_model is not None else module.model
                by_hand, _ = self_distillation_loss(
                    completion_logits(module.model, student) / t, completion_logits(teacher_model, teacher) / t,
                    student["completion_ids"], module.loss_mask(student), module.loss_config)
            self.steps.append({"student": student, "teacher": teacher, "loss": loss.detach(), "by_hand": by_hand,
                               "sampled_prompts": self.sampled_prompts,
                               "teacher_weights": None if module.ref_model is None else
                               {k: v.clone() for k, v in module.ref_model.state_dict().items()},
                               "policy_weights": {k: v.clone() for k, v in module.model.state_dict().items()}})
            return loss, stats, logits

        module.sampling.sample = spy_sample
        module.distill = spy_distill


def _fit(tiny_dir, steps=2, **knobs):
    module = SDFTModule(str(tiny_dir), from_config=True, num_generations=2, generation_batch_size=4,
                        max_completion_length=4, learning_rate=5e-2, teacher_prompt_template="{prompt} ({privileged_context})",
                        **knobs)
    spy = Spy(module)
    data = PromptDataModule(Dataset.from_list(ROWS), tokenizer=str(tiny_dir), max_prompt_length=32)
    L.seed_everything(7)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, max_steps=steps, limit_val_batches=0)
    trainer.fit(module, data)
    return module, spy, data.tokenizer


def test_teacher_reads_the_context_and_the_students_completion_and_stays_the_initial_policy(tiny_dir):
    module, spy, tok = _fit(tiny_dir, num_loss_tokens_to_skip=1)
    first = spy.steps[0]
    student, teacher = first["student"], first["teacher"]
    assert torch.equal(student["completion_ids"], teacher["completion_ids"])
    for i in range(student["completion_ids"].shape[0]):
        own = tok.decode(student["prompt_ids"][i][student["prompt_mask"][i].bool()], skip_special_tokens=True)
        shown = tok.decode(teacher["prompt_ids"][i][teacher["prompt_mask"][i].bool()], skip_special_tokens=True)
        a = int(re.match(r"(\d+)\+", own).group(1))
        assert own == f"{a}+{a}=" and shown == f"{a}+{a}= (Answer: {2 * a})", (own, shown)
    assert first["sampled_prompts"] == [p for p in first["sampled_prompts"] if "Answer" not in p]
    for step in spy.steps:  # the loss is the two forwards' loss; the base teacher never moves
        assert torch.allclose(step["loss"], step["by_hand"], rtol=1e-5, atol=1e-7), (step["loss"], step["by_hand"])
        assert all(torch.equal(step["teacher_weights"][k], spy.steps[0]["policy_weights"][k])
                   for k in step["teacher_weights"])
    assert not all(torch.equal(spy.steps[1]["policy_weights"][k], spy.steps[0]["policy_weights"][k])
                   for k in spy.steps[0]["policy_weights"])
    mask = module.loss_mask(student)
    assert not mask[:, 0].any() and mask[:, 1:].sum() > 0


def test_ema_teacher_follows_the_policy_and_generate_from_teacher_samples_the_teacher_prompt(tiny_dir):
    module, spy, _ = _fit(tiny_dir, steps=3, teacher_model_kind="ema", teacher_update_rate=1.0,
                          generate_from_teacher=True)
    assert all("Answer" in p for step in spy.steps for p in step["sampled_prompts"])
    for before, after in zip(spy.steps, spy.steps[1:]):  # rate 1: after each step the teacher is the policy
        assert all(torch.equal(after["teacher_weights"][k], after["policy_weights"][k])
                   for k in after["policy_weights"])
        assert not all(torch.equal(after["teacher_weights"][k], before["teacher_weights"][k])
                       for k in after["policy_weights"])


def test_console_script_fits_the_shipped_config(repo, tmp_path):
    out = console_script.run(repo, "fit", "--config", "configs/sdft_quickstart.yaml", "--trainer.max_steps", "2",
                             "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
                             "--plot.enabled", "false", "--trainer.logger.init_args.save_dir", str(tmp_path),
                             timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout[out.stdout.index("lightalign run summary"):]
    assert re.search(r"^  val/distillation_loss +final [\d.e-]+", summary, re.M), summary
    assert "teacher: the base policy given each row's privileged_context" in out.stdout + out.stderr
    assert (next(tmp_path.rglob("hf_model")) / "config.json").is_file()
